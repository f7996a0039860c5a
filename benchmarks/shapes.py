"""The attention shapes the benchmarks time and tune, (B, H, T, D) by name: read by attention.py and tune.py alike
(kept apart so that neither imports the other)."""

SHAPES = {"gpt2s_T1024": (16, 12, 1024, 64), "T4096": (4, 12, 4096, 64), "mini_T256": (32, 12, 256, 64),
          "D128_T2048": (8, 16, 2048, 128)}
