"""benchmarks/stabilizers.py on a CPU (a smoke check: its timings are not speeds; the GPU task is
`scripts/gpu.sh stabilizer-cost`): the Triton kind timed before the emulator kind, the JSON rewritten after every
variant and read by `flash-forensics stabilizers`, `--max-seconds` leaving out what does not fit (partial: true, the
missing rounds named), and a SIGTERM or a log file that is not a terminal losing nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import stabilizers as bench  # noqa: E402

TINY = "train.device=cpu model.n_layer=1 model.n_head=2 model.n_embd=32 model.block_size=16 train.batch_size=2"
VARIANTS = "baseline,fp16_baseline,sfa"  # fp16_baseline: Triton lacks its recipe (emulator kind), in the middle


def _args(out, *extra):
    return ["--device", "cpu", "--shapes", "mini", "--variants", VARIANTS, "--overrides", TINY, "--out", str(out),
            *extra]  # fmt: skip


def _table(tmp_path, bench_json):
    """The consumer: `flash-forensics stabilizers` over a report of the three interventions, with this benchmark."""
    from flash_forensics.orchestrator.analysis import stabilizers

    rep = tmp_path / "report"
    rep.mkdir(exist_ok=True)
    runs = [dict(job=f"forks/{n}", intervention=n, observed="stable", divergence_step=None, fork_step=None,
                 steps_done=10, final_loss=3.0) for n in VARIANTS.split(",")]  # fmt: skip
    (rep / "verdicts.json").write_text(json.dumps({"runs": runs}))
    paths = stabilizers.write([rep], bench_json, "table", results=tmp_path / "results")
    rows = {r["intervention"]: r for r in json.loads(paths["json"].read_text())["rows"]}
    return rows, paths["md"].read_text()


def _old_format(doc):
    """What the script wrote before --max-seconds: no partial/missing/order keys, rows without the new fields."""
    new_top = {"partial", "stopped", "max_seconds", "elapsed_s", "rounds", "rounds_completed", "missing", "skipped",
               "order"}  # fmt: skip
    new_row = {"route_kind", "rounds_completed", "build_s", "build_parts", "warmup_s"}
    rows = [{k: v for k, v in r.items() if k not in new_row} for r in doc["rows"]]
    return dict({k: v for k, v in doc.items() if k not in new_top}, rows=rows)


@pytest.fixture
def writes(monkeypatch):
    """Every document the script writes, in order (the file itself is written too)."""
    seen = []
    real = bench._write

    def spy(out, path):
        seen.append(json.loads(json.dumps(out)))
        real(out, path)

    monkeypatch.setattr(bench, "_write", spy)
    return seen


def test_a_full_tiny_run_times_the_triton_kind_first_and_writes_after_every_variant(tmp_path, writes):
    out = tmp_path / "stab.json"
    doc = bench.main(_args(out, "--rounds", "2", "--steps", "2", "--emulator-steps", "2"))
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["partial"] is False and doc["stopped"] is None and doc["missing"] == []
    assert doc["rounds"] == doc["rounds_completed"] == 2
    assert doc["order"] == {"mini": ["baseline", "sfa", "fp16_baseline"]}  # the emulator kind last, whatever the order
    rows = {r["variant"]: r for r in doc["rows"]}
    assert {n: r["route_kind"] for n, r in rows.items()} == {"baseline": "triton", "sfa": "triton",
                                                              "fp16_baseline": "emulator"}  # fmt: skip
    assert all(r["steps_timed"] == 4 and r["rounds_completed"] == 2 and r["tokens_per_s"] > 0 for r in rows.values())
    for r in rows.values():  # where a build's time went (Hydra's compose, the model), within the build's time
        assert set(r["build_parts"]) == {"compose_s", "model_s"} and min(r["build_parts"].values()) >= 0
        # each of the three figures is rounded to the millisecond: up to 0.5 ms apiece (CI saw 0.147 + 0.023 > 0.169)
        assert sum(r["build_parts"].values()) <= r["build_s"] + 3 * 0.0005 + 1e-9
    # a write after every variant's timing (3 variants x 2 rounds), partial until the last one
    timed = [tuple(r["steps_timed"] for r in w["rows"]) for w in writes]
    assert len(set(timed)) >= 1 + 3 * 2, timed
    assert all(w["partial"] is True for w in writes[:-1]) and writes[-1]["partial"] is False
    assert not list(tmp_path.glob("*.tmp*"))  # the atomic write's temporary file is gone
    # the consumer reads it, and the same file in the old format alike
    table, md = _table(tmp_path, out)
    assert all(table[n]["cost"]["mini"] is not None for n in ("sfa", "fp16_baseline"))
    (tmp_path / "old.json").write_text(json.dumps(_old_format(doc)))
    old, _ = _table(tmp_path, tmp_path / "old.json")
    assert {n: r["cost"] for n, r in old.items()} == {n: r["cost"] for n, r in table.items()}
    assert "not measured" not in md.split("\n- ")[0]


class FakeClock:
    """The budget's clock: a triton-kind step (or warmup) takes 1 s, an emulator-kind one 10 s, a build none."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_max_seconds_leaves_out_what_does_not_fit_and_writes_a_partial_file_the_table_reads(
    tmp_path, writes, monkeypatch
):
    fake = FakeClock()
    monkeypatch.setattr(bench, "clock", fake)
    real_run = bench.Variant.run

    def run(self, batches, timer, record):
        real_run(self, batches, timer, record)
        fake.t += 10.0 if self.kind == "emulator" else 1.0

    monkeypatch.setattr(bench.Variant, "run", run)
    out = tmp_path / "stab.json"
    # 0-3 s baseline (warmup, 2 steps), 3-6 sfa, 6-16 fp16_baseline's warmup (estimated 1 s: no warmup of its kind
    # yet); its steps (~10 s each) no longer fit in 20 s, round 2's triton-kind steps (16-20 s) still do
    doc = bench.main(_args(out, "--rounds", "2", "--steps", "2", "--emulator-steps", "2", "--max-seconds", "20"))
    assert json.loads(out.read_text())["partial"] is True
    assert doc["partial"] is True and doc["stopped"] == "max_seconds" and doc["max_seconds"] == 20
    assert doc["elapsed_s"] == 20 and doc["rounds_completed"] == 0
    rows = {r["variant"]: r for r in doc["rows"]}
    assert (rows["baseline"]["steps_timed"], rows["sfa"]["steps_timed"], rows["fp16_baseline"]["steps_timed"]) == (
        4,
        4,
        0,
    )
    assert rows["fp16_baseline"]["warmup_s"] == 10 and rows["fp16_baseline"]["tokens_per_s"] is None
    assert doc["missing"] == [dict(shape="mini", variant="fp16_baseline", route_kind="emulator", set_up=True,
                                   steps_timed=0, steps_missing=4, rounds_missing=[1, 2])]  # fmt: skip
    assert set(doc["summary"]["mini"]) == {"baseline", "sfa"}
    assert all(w["partial"] is True for w in writes)
    # the table: sfa's cost measured, fp16_baseline's "not measured" (never a guess)
    table, md = _table(tmp_path, out)
    assert table["sfa"]["cost"]["mini"] is not None and table["fp16_baseline"]["cost"]["mini"] is None
    assert next(line for line in md.splitlines() if line.startswith("| fp16_baseline |")).count("not measured") == 1

    # a budget nothing fits in (on the real clock: at most a first build, started within 1 ms): nothing timed,
    # every variant missing, still a file the table reads
    monkeypatch.setattr(bench, "clock", time.perf_counter)
    doc = bench.main(_args(tmp_path / "none.json", "--max-seconds", "0.001"))
    assert doc["partial"] is True and doc["stopped"] == "max_seconds" and doc["summary"] == {}
    assert all(r["steps_timed"] == 0 and r["warmup_s"] is None for r in doc["rows"])
    # the first build's estimate is 0 s, so it starts when reached within the 1 ms (a fast machine does): set up
    # or not, nothing is timed and every round of every variant is missing
    missing = [(m["variant"], m["rounds_missing"]) for m in doc["missing"]]
    assert missing == [("baseline", [1, 2]), ("fp16_baseline", [1, 2]), ("sfa", [1, 2])]
    assert [m["set_up"] for m in doc["missing"]][1:] == [False, False]
    table, _ = _table(tmp_path, tmp_path / "none.json")
    assert all(c is None for r in table.values() for c in r["cost"].values())
    with pytest.raises(SystemExit):
        bench.main(_args(tmp_path / "x.json", "--max-seconds", "0"))


def test_skip_emulator_leaves_the_emulator_kind_out_and_says_so(tmp_path):
    doc = bench.main(_args(tmp_path / "s.json", "--rounds", "1", "--steps", "1", "--emulator-steps", "1",
                           "--skip-emulator"))  # fmt: skip
    assert doc["partial"] is False and doc["missing"] == [] and doc["order"] == {"mini": ["baseline", "sfa"]}
    assert [(s["variant"], s["route_kind"], s["why"]) for s in doc["skipped"]] == [
        ("fp16_baseline", "emulator", "--skip-emulator")]  # fmt: skip


def test_a_sigterm_keeps_what_was_measured_and_the_log_is_written_as_it_goes(tmp_path):
    """stdout a file, PYTHONUNBUFFERED unset: the progress lines are there while the run is; `timeout`'s SIGTERM
    ends it with the JSON saying so."""
    out, log = tmp_path / "stab.json", tmp_path / "stab.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "stabilizers.py"),
                              *_args(out, "--rounds", "100000", "--steps", "1", "--emulator-steps", "1")],
                             stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not log.read_text():
            assert p.poll() is None and time.time() < deadline, f"nothing in the log: {log.read_text()!r}"
            time.sleep(0.02)
        first = log.read_text()  # block-buffered, the first of the log would come as 8 KiB of rounds at once
        assert first.startswith("stabilizers: cpu, shapes mini") and "round 1/" not in first, first
        while "round 1/100000 fp16_baseline" not in log.read_text():
            assert p.poll() is None, log.read_text()
            assert time.time() < deadline, f"no progress line in the log after 120 s: {log.read_text()!r}"
            time.sleep(0.2)
        assert "setup baseline (triton): built" in log.read_text()
        assert json.loads(out.read_text())["partial"] is True  # written before the run ends
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and doc["stopped"] == "SIGTERM", log.read_text()
    assert all(r["steps_timed"] >= 1 for r in doc["rows"]) and len(doc["rows"]) == 3
    assert {m["variant"] for m in doc["missing"]} == set(VARIANTS.split(","))  # 100000 rounds were asked
    assert "stopped by SIGTERM" in log.read_text() and f"wrote {out} (partial" in log.read_text()
