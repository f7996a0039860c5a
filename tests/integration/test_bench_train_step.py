"""benchmarks/train_step.py on a CPU (a smoke check: its timings are not speeds; the GPU run is `scripts/gpu.sh
speed`): every variant built from the same weights and fed the same batches, timed round-robin with the order
rotated, the SDPA op that ran recorded, the JSON rewritten each round; the compiled-vs-eager comparison by hand."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import train_step as bench  # noqa: E402


def test_cpu_smoke_round_robin_same_batches_and_the_sdpa_op(tmp_path):
    out = tmp_path / "ts.json"
    doc = bench.main(["--device", "cpu", "--model", "tiny", "--shapes", "2x32", "--steps", "4", "--rounds", "2",
                      "--warmup", "1", "--variants", "sdpa,emulator_paper_bf16", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["partial"] is False and doc["errors"] == []
    assert doc["order_by_round"] == {"2x32": [["sdpa", "emulator_paper_bf16"], ["emulator_paper_bf16", "sdpa"]]}
    rows = {r["variant"]: r for r in doc["rows"]}
    assert [(v, r["steps_timed"], len(r["losses"])) for v, r in rows.items()] == [
        ("sdpa", 4, 5), ("emulator_paper_bf16", 4, 5)]  # fmt: skip
    assert rows["sdpa"]["sdpa_ops"] == ["flash"] and rows["emulator_paper_bf16"]["sdpa_ops"] == []
    assert all(0 < r["host_ms"] <= r["step_ms"] for r in rows.values())  # each step: enqueued <= done
    assert rows["emulator_paper_bf16"]["routes"] == ["flash/emulator/paper_bf16"]
    # the same initial weights and first batch: the first losses differ only by the attention's arithmetic
    assert rows["sdpa"]["losses"][0] == pytest.approx(rows["emulator_paper_bf16"]["losses"][0], abs=2e-2)
    assert rows["sdpa"]["losses"][0] != rows["sdpa"]["losses"][4]  # it trains: a later batch, a different loss
    assert set(doc["summary"]["B2_T32"]["tokens_per_s"]) == {"sdpa", "emulator_paper_bf16"}


def test_compiled_vs_eager_by_hand():
    def row(v, losses):
        return dict(variant=v, batch=2, T=8, tokens_per_s=100.0, losses=losses)
    s = bench.summarize([row("sdpa+compile", [3.0, 2.5, 2.25]), row("sdpa", [3.0, 2.5, 2.0]),
                         row("paper_1gpu", [3.0, 2.5]), row("paper_1gpu+compile", [3.0, 2.5, 9.0])])["B2_T8"]
    assert s["compiled_vs_eager"] == {
        "sdpa": dict(steps=3, bit_identical=False, first_diff_step=2, max_abs_loss_diff=0.25),
        "paper_1gpu": dict(steps=2, bit_identical=True, first_diff_step=None, max_abs_loss_diff=0.0)}
    assert s["vs_sdpa_compile"]["paper_1gpu"] == 1.0


def test_a_bad_variant_stops_before_anything_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--variants", "sdpa,sdpa+compil", "--out", str(tmp_path / "x.json")])
    assert "'sdpa+compil' is not allowed" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
