"""The host-side caches of the Triton path (kernels/ops.py _knobs, kernels/triton_launch.py _rows_per_head): a cached
object equals a fresh build for every argument, distinct arguments never share one, and benchmarks/host_overhead.py
times both ways on a CPU (kernels stubbed)."""
import dataclasses
import sys
from pathlib import Path

import pytest

from flash_forensics.kernels import ops
from flash_forensics.kernels import triton_launch as tf
from flash_forensics.kernels.config import AttentionKnobs

ROOT = Path(__file__).resolve().parents[2]

CALLS = [
    ("fa2", True, 64, 64, "safe", 2.0, 1e-3, "dO_O", False, None, -1, "ieee"),
    ("paper_bf16", True, 128, 128, "stabilized", 1.5, 1e-3, "dO_O", False, [1, 3], -1, "ieee"),
    ("paper_bf16", True, 128, 128, "stabilized", 1.5, 1e-3, "dO_O", False, [1, 3], 0, "ieee"),
    ("fp32", False, 64, 32, "safe", 2.0, 1e-4, "dpp", True, [], -1, "tf32x3"),
]


@pytest.mark.parametrize("args", CALLS)
def test_cached_knobs_equal_a_fresh_build(args):
    cached = ops._knobs(*args)
    ops._knobs_cached.cache_clear()
    fresh = ops._knobs(*args)  # built again
    assert fresh is not cached and dataclasses.asdict(cached) == dataclasses.asdict(fresh)
    cached = fresh
    assert ops._knobs(*args) is cached  # the same call: the same object
    assert cached.o_fp32_heads == list(args[9] or ())


def test_distinct_calls_never_share_knobs():
    objs = [ops._knobs(*a) for a in CALLS]
    assert len({id(o) for o in objs}) == len(CALLS)
    # a list and a tuple of the same heads, 1 and True: one key, equal knobs
    assert ops._knobs("fa2", 1, 64, 64, fp32_heads=[2]) is ops._knobs("fa2", True, 64, 64, fp32_heads=(2,))


@pytest.mark.parametrize("T,tiling,bq,bk", [(1024, True, 64, 64), (1000, True, 128, 32), (37, True, 64, 16),
                                            (256, False, 64, 64)])
def test_rows_per_head_cached_equals_the_loop(T, tiling, bq, bk):
    knobs = AttentionKnobs(tiling=tiling, block_q=bq, block_k=bk)
    by_hand = T if not tiling else sum((min(qs + min(bq, T), T) - qs) * -(-min(qs + min(bq, T), T) // min(bk, T))
                                       for qs in range(0, T, min(bq, T)))
    assert tf._rows_per_head(T, knobs) == tf._rows_per_head_of(T, tiling, bq, bk) == by_hand


def test_host_overhead_benchmark_times_both_ways_on_a_cpu(tmp_path):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    pytest.importorskip("triton")
    from benchmarks import host_overhead
    saved = tf._k
    try:
        doc = host_overhead.main(["--shapes", "1x2x64x16", "--knobs", "fa2,paper_bf16_counters", "--rounds", "2",
                                  "--iters", "3", "--out", str(tmp_path / "h.json")])
        # a second run in one process: its no-op ops registered once
        again = host_overhead.main(["--shapes", "1x2x64x16", "--knobs", "fa2", "--rounds", "1", "--iters", "1",
                                    "--out", str(tmp_path / "h2.json")])
        after = tf._k  # the benchmark's own stubs, the timing proxies gone again
    finally:
        tf._k = saved  # the benchmark stubs the kernels for its own process
    assert [r["knobs"] for r in doc["rows"]] == ["fa2", "paper_bf16_counters"]
    assert all(r[f"host_us_{m}"] > 0 for r in doc["rows"] for m in ("cached", "rebuilt", "dispatch"))
    assert set(doc["schema"]) == {"schema_18_args", "schema_8_args"} and all(v > 0 for v in doc["schema"].values())
    for r in doc["rows"]:  # where the host time goes: each kernel's launch (stubbed here: ~0) and the rest
        assert set(r["launch_us"]) == set(host_overhead.KERNELS)  # the delta kernel's 0: its delta is the dQ kernel's
        assert {k for k, v in r["launch_us"].items() if v > 0} == set(host_overhead.KERNELS) - {"_bwd_delta_kernel"}
        assert 0 < r["host_us_outside_launches"] < r["host_us_outside_launches"] + sum(r["launch_us"].values())
    assert all(isinstance(getattr(after, n), host_overhead._NoLaunch) for n in host_overhead.KERNELS)
    assert again["rows"][0]["knobs"] == "fa2"
    prof = doc["host_profile"]  # the first knobs' cached path under cProfile, its functions by own time
    assert prof["knobs"] == "fa2" and prof["calls"] == 60 and 0 < len(prof["top"]) <= 25
    own = [r["own_us"] for r in prof["top"]]
    assert own == sorted(own, reverse=True) and own[0] > 0 and all(r["cum_us"] >= r["own_us"] for r in prof["top"])
    assert any("triton_launch.py" in r["function"] or "ops.py" in r["function"] for r in prof["top"])
    assert ops._knobs_cached.__wrapped__ is not ops._knobs_cached  # the cache is back after the `rebuilt` method
    with pytest.raises(SystemExit):
        host_overhead.main(["--knobs", "nope", "--out", str(tmp_path / "x.json")])
