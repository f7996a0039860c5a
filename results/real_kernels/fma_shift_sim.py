"""What Triton's FMA contraction of the scale into the softmax's subtract does to fa2's forward, simulated on a CPU.

On the GPU (scripts/kernel_sass.py, Triton 3.6 and 3.9, sm_90) fa2's forward computes the exp argument as
FFMA(S, scale, -m): one rounding of S*scale - m. The emulator (and the counters) round S*scale to FP32 first:
fl(fl(S*scale) - m). This runs one head-tiled online softmax (64 x 64 tiles, causal, B1 H2 T256) both ways with
everything else equal (S, exp2, sums and P̄V products evaluated in FP64 and rounded to FP32, P̄ rounded to BF16) and
counts the O elements whose bits agree. Not a model of the kernel's summation orders: only the contraction differs.

    python results/real_kernels/fma_shift_sim.py          # about a minute on a CPU; output: fma_shift_sim.txt
"""
import math

import torch

LOG2E = 1.4426950408889634


def f32(x):
    return x.to(torch.float32).to(torch.float64)


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float64)


def forward(q, k, v, fused: bool, bm: int = 64, bn: int = 64):
    B, H, T, D = q.shape
    scale = f32(torch.tensor(1 / math.sqrt(D), dtype=torch.float64))
    out = torch.empty(B, H, T, D, dtype=torch.float64)
    for i in range(0, T, bm):
        qi = q[:, :, i:i + bm]
        n = qi.shape[2]
        m = torch.full((B, H, n), -3.4e38, dtype=torch.float64)
        l = torch.zeros(B, H, n, dtype=torch.float64)
        acc = torch.zeros(B, H, n, D, dtype=torch.float64)
        for j in range(0, min(i + n, T), bn):
            S = f32(qi @ k[:, :, j:j + bn].transpose(-1, -2))
            ok = torch.arange(j, j + S.shape[-1])[None, :] <= torch.arange(i, i + n)[:, None]
            s = f32(S * scale).masked_fill(~ok, -3.39e38)
            m_new = torch.maximum(m, s.amax(-1))
            x = f32((S * scale if fused else s) - m_new[..., None])  # S * scale exact in FP64 (24 x 24 bits)
            p = f32(torch.exp2(f32(x * LOG2E))).masked_fill(~ok, 0)
            alpha = f32(torch.exp2(f32(f32(m - m_new) * LOG2E)))
            l = f32(f32(alpha * l) + f32(p.sum(-1)))
            acc = f32(f32(acc * alpha[..., None]) + f32(bf16(p) @ v[:, :, j:j + bn]))
            m = m_new
        out[:, :, i:i + bm] = f32(acc / l[..., None])
    return out


def main():
    torch.manual_seed(0)
    for name, amp in (("random", 1.0), ("random x2", 2.0)):
        for D in (64, 128):
            q, k, v = (bf16(torch.randn(1, 2, 256, D) * amp) for _ in range(3))
            a, b = forward(q, k, v, False), forward(q, k, v, True)
            same16 = (a.to(torch.bfloat16) == b.to(torch.bfloat16)).double().mean().item()
            same32 = (a == b).double().mean().item()
            print(f"{name:10s} D{D:<4d} scale {1 / math.sqrt(D):.6f}: O identical, stored BF16 {100 * same16:.4f}%, "
                  f"FP32 {100 * same32:.4f}%")


if __name__ == "__main__":
    main()
