"""Speed-only launch tables (kernels/triton_launch.py SHAPE_TABLE): per tile size for paper_bf16, loaded from a tune
JSON (FF_LAUNCH_TABLE, --tuned-table), scoped to a benchmark variant, and never moving a block size a recipe fixes."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from flash_forensics.kernels import triton_launch as tl_
from flash_forensics.kernels.config import AttentionKnobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = AttentionKnobs(recipe="paper_bf16", backend="triton", block_q=128, block_k=128, counters=True)
SMALL = AttentionKnobs(recipe="paper_bf16", backend="triton", counters=True)  # 64x64 tiles


def _tune_json(tmp_path, table) -> str:
    p = tmp_path / "tune.json"
    p.write_text(json.dumps({"shape_table": table}))
    return str(p)


def test_a_preset_tile_entry_moves_only_that_tile_size_and_never_a_fixed_block():
    assert tl_.table_family("paper_bf16", PRESET) == "paper_bf16_128x128"
    assert tl_.table_family("paper_bf16", SMALL) == "paper_bf16_64x64"
    assert tl_.table_family("fa2", PRESET) == "fa2"
    small_before = (tl_._fwd_blocks(SMALL, 64, 1024), tl_._bwd_blocks(SMALL, 64, 1024))
    table_before = dict(tl_.SHAPE_TABLE)
    table = {"fwd/paper_bf16_128x128/64/long": [128, 32, 8, 2],
             "bwd/paper_bf16_128x128/64/long": [32, 32, 16, 32, 8, 2]}
    with tl_.shape_table_scope(table):
        fwd, bwd = tl_._fwd_blocks(PRESET, 64, 1024), tl_._bwd_blocks(PRESET, 64, 1024)
        assert (tl_._fwd_blocks(SMALL, 64, 1024), tl_._bwd_blocks(SMALL, 64, 1024)) == small_before
    assert tl_.SHAPE_TABLE == table_before  # the scope restored the table
    # the key tile (forward BLOCK_N), the dK/dV query tile and the dQ key tile stay the preset's 128
    assert fwd[2:] == (8, 2) and bwd[2:] == (8, 2)
    if not tl_._interpret():
        assert fwd[:2] == (128, 128) and bwd[0] == (128, 32) and bwd[1] == (16, 128)


def test_a_generic_family_entry_still_applies_where_no_tile_entry_exists():
    with tl_.shape_table_scope({"fwd/paper_bf16/32/long": [32, 64, 8, 4]}):  # (no paper_bf16_128x128 entry at D32)
        assert tl_._fwd_blocks(PRESET, 32, 1024)[2:] == (8, 4)
        with tl_.shape_table_scope({"fwd/paper_bf16_128x128/32/long": [64, 64, 4, 1]}):
            assert tl_._fwd_blocks(PRESET, 32, 1024)[2:] == (4, 1)  # the tile entry first


def test_the_preset_launch_is_the_measured_one_and_other_tiles_keep_theirs():
    """SHAPE_TABLE's paper_bf16_128x128 entries (2 stages, measured on an H100 to keep the bits) apply to
    experiment=paper_1gpu's attention at T1024 and to no other tile size; paper_bf16's default 64x64 tiles have their
    own backward entries (2 stages, measured at T1024 and T4096), and keep BWD_TABLE's launch where none was measured
    (T <= 256)."""
    assert tl_.launch_config(PRESET, 64, 1024)["bwd"]["num_stages"] == 2
    assert tl_.launch_config(PRESET, 64, 1024)["fwd"]["num_stages"] == 2
    default = tl_.BWD_TABLE["paper_bf16"][64]
    assert default[5] == 3
    for T, stages in ((256, 3), (1024, 2), (4096, 2)):
        bwd = tl_.launch_config(SMALL, 64, T)["bwd"]
        assert (bwd["dkdv"], bwd["dq"], bwd["num_warps"], bwd["num_stages"]) == ([64, 64], [64, 64], 4, stages), T
        assert bwd["maxnreg"]["dkdv"] == 168  # REGISTER_TABLE's cap, measured for both launches
    for other in (dataclasses.replace(SMALL, block_q=32, block_k=32), dataclasses.replace(SMALL, tiling=False)):
        assert tl_.launch_config(other, 64, 1024)["bwd"]["num_stages"] == default[5]  # other tiles: not measured


def test_a_bad_launch_table_names_the_file_and_what_it_expected(tmp_path):
    with pytest.raises(ValueError, match=r"launch table '.*nothere.json' is not allowed: expected a tune JSON"):
        tl_.load_shape_table(str(tmp_path / "nothere.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="with a shape_table"):
        tl_.load_shape_table(str(bad))


def test_ff_launch_table_loads_at_import_in_a_fresh_process(tmp_path):
    path = _tune_json(tmp_path, {"bwd/paper_bf16_128x128/64/long": [128, 32, 32, 128, 8, 2]})
    code = ("from flash_forensics.kernels import triton_launch as t; from flash_forensics.kernels.config import "
            "AttentionKnobs as K; print(t._bwd_blocks(K(recipe='paper_bf16', block_q=128, block_k=128), 64, 1024)[2:])")
    env = dict(os.environ, FF_LAUNCH_TABLE=path, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("(8, 2)")
    env["FF_LAUNCH_TABLE"] = str(tmp_path / "missing.json")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "missing.json' is not allowed" in out.stderr


def test_tune_refuses_an_unknown_family_or_shape_by_name(capsys):
    from benchmarks import tune
    for argv, flag, value in ((["--families", "paper_2gpu"], "--families", "paper_2gpu"),
                              (["--shapes", "T9999"], "--shapes", "T9999")):
        with pytest.raises(SystemExit):
            tune.main(argv)
        err = capsys.readouterr().err
        assert f"{flag}: {value!r} is not allowed: expected names from" in err


def test_tune_that_would_time_nothing_says_why_and_fails_before_the_gpu():
    """--shapes D128_T2048 with tune's default family (paper_1gpu, D64 candidates only) timed nothing and wrote an
    empty table with exit 0 on an H100 (results/bench/gpu-h100-2026-12-06g/tune-D128-none.json): now the plan names
    each skipped (family, shape) and why, and a run with nothing to time exits non-zero before asking for a GPU."""
    from benchmarks import tune
    from benchmarks.shapes import SHAPES
    todo, skipped = tune.plan([SHAPES["D128_T2048"]], ["paper_1gpu"])
    assert todo == [] and [s["family"] for s in skipped] == ["paper_1gpu"]
    assert "no launch candidates at head dim 128" in skipped[0]["why"]
    with pytest.raises(SystemExit) as e:
        tune.main(["--shapes", "D128_T2048", "--families", "paper_1gpu"])
    assert "nothing to time" in str(e.value) and "paper_1gpu at [8, 16, 2048, 128]" in str(e.value)
    todo, skipped = tune.plan([SHAPES["D128_T2048"], SHAPES["T4096"]], ["fa2", "fp32", "paper_1gpu"])
    assert [(f, s[2], s[3]) for f, _, s in todo] == [("fa2", 2048, 128), ("fp32", 2048, 128), ("fa2", 4096, 64),
                                                     ("paper_1gpu", 4096, 64)]
    assert {(s["family"], s["shape"][2]) for s in skipped} == {("paper_1gpu", 2048), ("fp32", 4096)}
    assert "up to T=2048" in next(s["why"] for s in skipped if s["family"] == "fp32")


def test_tune_never_chooses_a_faster_candidate_that_changes_a_fixed_tile_family_s_bits(monkeypatch):
    """benchmarks/tune.py tune_shape with a stand-in launcher on the CPU: the forward candidate (32, ...) is the
    fastest but moves O's bits, so paper_1gpu keeps the next fastest of the bit-identical ones; fa2 (free tiles)
    takes the fastest."""
    import types

    import torch

    from benchmarks import tune
    table = {}
    speed = {32: 0.1, 64: 0.5, 128: 0.3}  # ms by the candidate's BLOCK_M (forward) or dK/dV BLOCK_N (backward)

    def blocks(kind):
        return lambda knobs, D, T: table.get(kind, (64, 128, 4, 3) if kind == "fwd" else (128, 64, 64, 128, 4, 3))

    def forward(q, k, v, knobs, rep=None, maxl=None):
        bm = blocks("fwd")(knobs, 0, 0)[0]
        return q + (1e-3 if bm == 32 else 0.0), q.sum(-1), None, None  # BLOCK_M 32: other bits

    def backward(do, q, k, v, o, lse, knobs):
        return do, do, do

    class Table(dict):
        def __setitem__(self, key, c):
            table[key[0]] = c

        def pop(self, key, default=None):
            return table.pop(key[0], default)

    fake = types.SimpleNamespace(SHAPE_TABLE=Table(), _forward=forward, _backward=backward,
                                 _fwd_blocks=blocks("fwd"), _bwd_blocks=blocks("bwd"), length_class=lambda T: "long",
                                 table_family=lambda fam, knobs: fam, fwd_family=lambda knobs: "paper_bf16",
                                 bwd_family=lambda knobs: "paper_bf16")
    monkeypatch.setattr(tune, "_time", lambda fn: (speed[table["fwd"][0]] if "bwd" not in table
                                                    else speed[table["bwd"][1] if table["bwd"][1] in speed else 64],
                                                    "stand-in"))
    monkeypatch.setattr(tune, "FWD", {**tune.FWD, "paper_1gpu": {8: [(64, 128, 4, 3), (32, 128, 4, 3),
                                                                      (128, 128, 8, 3)]}})
    monkeypatch.setattr(tune, "BWD", {**tune.BWD, "paper_1gpu": {8: [(128, 64, 64, 128, 4, 3)]}})
    res = tune.tune_shape(fake, "paper_1gpu", tune.FAMILIES["paper_1gpu"], 1, 2, 16, 8, torch.device("cpu"),
                          lambda msg: None)
    assert res["keep_bits"] and res["fwd_best"] == (128, 128, 8, 3)
    assert [r["same_bits"] for r in res["fwd"]] == [True, False, True]
    table.clear()
    monkeypatch.setattr(tune, "FWD", {**tune.FWD, "bf16": {8: [(64, 128, 4, 3), (32, 128, 4, 3)]}})
    monkeypatch.setattr(tune, "BWD", {**tune.BWD, "bf16": {8: [(128, 64, 64, 128, 4, 3)]}})
    res = tune.tune_shape(fake, "fa2", tune.FAMILIES["fa2"], 1, 2, 16, 8, torch.device("cpu"), lambda msg: None)
    assert not res["keep_bits"] and res["fwd_best"] == (32, 128, 4, 3)


def test_tune_times_its_candidates_under_the_register_caps_given_and_refuses_a_bad_one(monkeypatch, capsys):
    """--regs fwd=128,dkdv=168: every launch tune_shape makes runs under those caps (register_limit), so a candidate
    with fewer pipeline stages is timed at the cap its default twin has; the scope ends with the family. A bad pair
    is refused by name before any GPU work."""
    from benchmarks import tune
    from flash_forensics.kernels import triton_launch as tl_
    seen = []

    def shape(tf, fam, knobs, B, H, T, D, dev, log):
        seen.append((fam, tf.register_cap("dkdv", knobs, D, ((64, 64), (64, 64), 4, 2), True),
                     tf.register_cap("fwd", knobs, D, (64, 64, 4, 2), True),
                     tf.register_cap("dq", knobs, D, None, True)))
        return dict(family=fam)
    monkeypatch.setattr(tune, "tune_shape", shape)
    out = tune.tune_all("cpu", [(2, 2, 1024, 64)], log=lambda m: None, families=["paper_bf16"],
                        regs=tune.parse_regs("fwd=128,dkdv=168"))
    assert seen == [("paper_bf16", 168, 128, None)] and out["regs"] == {"fwd": 128, "dkdv": 168}
    knobs = tune.FAMILIES["paper_bf16"]
    assert tl_.register_cap("fwd", knobs, 64, (64, 64, 4, 2), True) is None  # the scope ended
    tune.tune_all("cpu", [(2, 2, 1024, 64)], log=lambda m: None, families=["paper_bf16"])
    assert seen[-1] == ("paper_bf16", 168, None, None)  # no --regs: each launch's own (REGISTER_TABLE's where measured)
    for bad in ("dkdv=300", "wgrad=128", "fwd"):
        with pytest.raises(SystemExit):
            tune.main(["--regs", bad])
        assert f"--regs {bad!r} is not allowed" in capsys.readouterr().err
