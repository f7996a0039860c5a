"""The tools' answers to inputs a user gets wrong: refused naming the argument, never an empty table with exit 0,
never a store created or a host waited on by a tool that only reads."""
import json
import shutil
from pathlib import Path

import pytest

from flash_forensics.orchestrator.analysis import early_warning, stabilizers
from flash_forensics.orchestrator.analysis.localize import main as localize_main
from flash_forensics.orchestrator.job import fork
from flash_forensics.orchestrator.report import readback
from flash_forensics.orchestrator.report.sweep import main as report_main
from flash_forensics.orchestrator.tracking.store import TrackingUnreachable, check_tracking

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "results" / "paper_1gpu" / "lease-2026-12-04" / "baseline"  # job.json names a store elsewhere


def test_early_warning_with_no_run_to_judge_fails_saying_why(tmp_path, capsys):
    (tmp_path / "verdicts.json").write_text(json.dumps({"runs": []}))
    assert early_warning.main([str(tmp_path / "verdicts.json"), "--out", str(tmp_path / "ew")]) == 1
    assert "no run to judge" in capsys.readouterr().err and not (tmp_path / "ew").exists()
    for bad in ("rmax_rate=nan", "rmax_rate=abc", "rmax_rate=1,inf"):
        with pytest.raises(SystemExit, match=rf"--thresholds '{bad}' is not allowed: expected finite numbers"):
            early_warning._extra([bad])
    assert early_warning._extra(["rmax_rate=1,2.5"]) == {"rmax_rate": [1.0, 2.5]}


def test_stabilizers_refuses_empty_reports_foreign_benches_and_paths_as_names(tmp_path, capsys):
    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / "verdicts.json").write_text(json.dumps({"runs": []}))
    assert stabilizers.main(["--reports", str(rep), "--results", str(tmp_path / "out")]) == 1
    assert "holds no runs" in capsys.readouterr().err
    (rep / "verdicts.json").write_text('{"runs": [')
    assert stabilizers.main(["--reports", str(rep), "--results", str(tmp_path / "out")]) == 1
    assert "is not valid JSON" in capsys.readouterr().err
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"rows": [{"shape": "mini"}]}))
    with pytest.raises(ValueError, match="expected a benchmarks/stabilizers.py JSON"):
        stabilizers.load_bench(bench)
    bench.write_text(json.dumps({"rows": [{"variant": "baseline", "tokens_per_s": 1.0}]}))  # no shape
    with pytest.raises(ValueError, match="each row with its shape and variant"):
        stabilizers.load_bench([bench, bench.with_name("other.json")])
    bench.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="holds no rows"):
        stabilizers.load_bench(bench)
    # a budget that fitted nothing: no rows, but what it missed is said, so it is read ("not measured", not refused)
    bench.write_text(json.dumps({"rows": [], "partial": True, "missing": [
        {"shape": "mini", "variant": "sfa", "rounds_missing": [1, 2]}]}))
    assert stabilizers.load_bench(bench)["sources"][0]["shapes"] == ["mini"]
    with pytest.raises(ValueError, match="is given twice"):
        stabilizers.load_bench([bench, tmp_path / "." / "b.json"])
    with pytest.raises(SystemExit):
        stabilizers.main(["--reports", str(rep), "--name", "../escape", "--results", str(tmp_path / "out")])
    assert "plain folder name" in capsys.readouterr().err and not (tmp_path / "escape").exists()


def test_fork_pick_refuses_a_negative_margin_and_a_step_before_one(tmp_path, capsys):
    for args, needle in ((["--before", "100", "--margin", "-10"], "--margin=-10 is not allowed"),
                         (["--before", "0"], "--before=0 is not allowed"),
                         (["--before", "50", "--at-min"], "--at-min with --before is not allowed")):
        assert fork.main(["pick", str(tmp_path), *args]) == 1
        assert needle in capsys.readouterr().err


def test_localize_refuses_a_window_that_ends_before_step_one(tmp_path, capsys):
    with pytest.raises(SystemExit):
        localize_main([str(tmp_path), "--divergence-step", "-10"])
    assert "--divergence-step=-10 is not allowed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        localize_main([str(tmp_path), "--rate-threshold", "nan"])
    assert "--rate-threshold=nan is not allowed" in capsys.readouterr().err


def test_readers_never_create_a_store_nor_wait_on_a_dead_server(tmp_path):
    db = tmp_path / "none" / "mlflow.db"
    with pytest.raises(ValueError, match=r"no MLflow store at .*mlflow.db .*--tracking-uri.*--histories"):
        readback.client_for(f"sqlite:///{db}")
    assert not db.parent.exists()
    with pytest.raises(TrackingUnreachable, match="unreachable"):  # refused at once, not a hang
        readback.client_for("http://127.0.0.1:9")
    with pytest.raises(TrackingUnreachable, match=r"tracking.uri='nonsense://x' is not allowed"):
        check_tracking("nonsense://x", timeout_s=1)


def test_report_reads_the_jobs_own_store_and_creates_none(tmp_path, capsys):
    job = tmp_path / "baseline"
    shutil.copytree(BASELINE, job)
    recorded = json.loads((job / "job.json").read_text())["tracking_uri"]
    assert report_main([str(job), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert f"[report] MLflow store: {recorded} (where 1 of the jobs logged" in out
    assert "no MLflow store at" in out  # said, not created
    assert not Path(readback.sqlite_path(recorded)).exists()
    assert (tmp_path / "rep" / "verdicts.md").is_file()


def test_fork_baseline_source_without_histories_says_it_was_not_applied(tmp_path, capsys):
    shutil.copytree(BASELINE.parent / "forks", tmp_path / "forks")
    shutil.copytree(BASELINE, tmp_path / "baseline")
    assert report_main([str(tmp_path / "baseline"), str(tmp_path / "forks"), "--out", str(tmp_path / "rep"),
                        "--fork-baseline", "source"]) == 0
    assert "--fork-baseline source: 18 of 18 fork(s) keep their own verdict" in capsys.readouterr().out
    md = (tmp_path / "rep" / "verdicts.md").read_text()
    assert "NOT applied to 18 of 18 fork(s)" in md and md.count("not re-judged: fresh (no source history") == 18


def test_fork_baseline_source_without_forks_says_it_did_nothing(tmp_path, capsys):
    """Over a baseline alone, --fork-baseline source re-judged nothing, and the report's meta said 'each fork judged
    from its source's detector' as if it had."""
    shutil.copytree(BASELINE, tmp_path / "baseline")
    assert report_main([str(tmp_path / "baseline"), "--out", str(tmp_path / "rep"), "--fork-baseline", "source",
                        "--histories", str(BASELINE.parent / "mlflow-seed1337.json.gz")]) == 0
    assert "--fork-baseline source: no fork among the runs (no fork_step); nothing was re-judged" in \
        capsys.readouterr().out
    md = (tmp_path / "rep" / "verdicts.md").read_text()
    assert "fork_rule: source: no fork among the runs, nothing re-judged" in md and "each fork judged" not in md


def test_truncated_and_foreign_inputs_are_named(tmp_path, capsys):
    bad = tmp_path / "verdicts.json"
    bad.write_text('{"runs": [')
    assert early_warning.main([str(bad), "--out", str(tmp_path / "ew")]) == 1
    assert f"{bad}: not valid JSON" in capsys.readouterr().err
    gz = tmp_path / "h.json.gz"
    gz.write_bytes((BASELINE.parent / "mlflow-seed1337.json.gz").read_bytes()[:100])
    with pytest.raises(ValueError, match=r"--histories .*h.json.gz.*not an export .*EOFError"):
        readback.histories_from_export(gz)
    from flash_forensics.orchestrator.report.rows import job_row
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "result.json").write_text("[1, 2]")  # JSON, not a record: a failed row, not a lost table
    row = job_row(tmp_path / "job", "job")
    assert row["observed"] == "failed" and "unreadable" in row["error"]


def test_an_export_whose_runs_are_not_run_objects_is_named(tmp_path):
    """{"runs": 5}, runs without run_id, or points that are not [step, value] gave a bare TypeError/KeyError
    ('int' object is not iterable), naming neither --histories nor the file."""
    import gzip
    for i, doc in enumerate(({"runs": 5}, {"runs": [{"metrics": {}}]},
                             {"runs": [{"run_id": "a", "metrics": {"train/loss": [5]}}]})):
        gz = tmp_path / f"e{i}.json.gz"
        gz.write_bytes(gzip.compress(json.dumps(doc).encode()))
        with pytest.raises(ValueError, match=rf"--histories '{gz}': not an export of scripts/mlflow_export.py "
                                             r"\(its runs: .*expected a list of objects with run_id and metrics"):
            readback.histories_from_export(gz)


def test_fork_pick_and_list_pass_over_damaged_checkpoints(tmp_path, capsys):
    from flash_forensics.orchestrator.job import checkpoint
    d = tmp_path / "checkpoints"
    d.mkdir()
    checkpoint.save(d / "step_10.pt", {"step": 10, "model": {}})
    checkpoint.save(d / "step_20.pt", {"step": 20, "model": {}})
    raw = (d / "step_20.pt").read_bytes()
    (d / "step_20.pt").write_bytes(raw[: len(raw) // 2])  # truncated
    (d / "step_30.pt").write_bytes(b"not a checkpoint")
    assert fork.pick_step(tmp_path, before=40) == (10, d / "step_10.pt")
    err = capsys.readouterr().err
    assert "passing over" in err and "step_30.pt" in err and "step_20.pt" in err
    assert fork.main(["list", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [("DAMAGED" in line) for line in listed] == [False, True, True]
    (d / "step_10.pt").write_bytes(b"x")
    with pytest.raises(fork.ForkError, match="every checkpoint at step <= 40 is damaged"):
        fork.pick_step(tmp_path, before=40)
    for f in d.iterdir():
        f.unlink()
    assert fork.main(["list", str(tmp_path)]) == 1  # was exit 0, nothing printed
    assert "no checkpoint in its checkpoints/ folder" in capsys.readouterr().err


def test_fork_names_a_missing_job_folder_and_an_unreadable_result_json(tmp_path, capsys):
    """fork pick on a folder that does not exist said 'no divergence step in result.json (the run did not
    diverge...)'; a result.json that is not a record gave json's 'Expecting value: line 1 column 1' alone (or an
    AttributeError for JSON that is not an object). Each is named now; fork list still lists the checkpoints."""
    from flash_forensics.orchestrator.job import checkpoint
    for cmd in ("list", "pick"):
        assert fork.main([cmd, str(tmp_path / "missing")]) == 1
        assert f"JOB_DIR={str(tmp_path / 'missing')!r} is not allowed: no such folder" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()
    checkpoint.save(tmp_path / "checkpoints" / "step_10.pt", {"step": 10, "model": {}})
    for text, why in (("garbage", "JSONDecodeError"), ("[1, 2]", "AttributeError")):
        (tmp_path / "result.json").write_text(text)
        assert fork.main(["pick", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert f"{tmp_path / 'result.json'} is not a readable run record ({why}" in err, err
        assert fork.main(["list", str(tmp_path)]) == 0
        printed = capsys.readouterr()
        assert "step_10.pt" in printed.out and "listing without the divergence step" in printed.err
    assert fork.main(["pick", str(tmp_path), "--before", "20"]) == 0  # --before needs no record
    assert capsys.readouterr().out.strip() == str(tmp_path / "checkpoints" / "step_10.pt")


def test_early_warning_from_job_folders_leaves_out_jumped_forks_as_from_the_report():
    lease = BASELINE.parent
    export = {**readback.histories_from_export(lease / "mlflow-seed1337.json.gz")}
    from_dirs, skipped = early_warning.load([str(lease / "baseline"), str(lease / "forks")], histories=export)
    from_report, _ = early_warning.load([str(lease / "report" / "verdicts.json")], histories=export)
    assert sorted(r.name.split("/")[-1] for r in from_dirs) == sorted(r.name.split("/")[-1] for r in from_report)
    assert sum("fork_jump" in s for s in skipped) == 5  # the SFA forks whose first loss jumped 4.7-6.1 nats
    kept, _ = early_warning.load([str(lease / "baseline"), str(lease / "forks")], histories=export, keep_jumped=True)
    assert len(kept) == len(from_dirs) + 5


def test_report_arguments_that_would_be_ignored_are_refused(tmp_path, capsys):
    assert report_main([str(BASELINE), "--out", str(tmp_path / "r"), "--source-run", "abc"]) == 1
    assert "--source-run is not allowed without --from-mlflow" in capsys.readouterr().err
    assert report_main([str(BASELINE), "--out", str(tmp_path / "r"), "--meta", "foo"]) == 1
    assert "--meta 'foo' is not allowed: expected KEY=VALUE" in capsys.readouterr().err
    job = tmp_path / "baseline"
    shutil.copytree(BASELINE, job)
    assert report_main([str(job), str(job), "--out", str(tmp_path / "r")]) == 0
    assert "1 folder(s) given twice: read once" in capsys.readouterr().out
    doc = json.loads((tmp_path / "r" / "verdicts.json").read_text())
    assert len(doc["runs"]) == 1


def test_a_result_json_with_impossible_values_is_a_failed_row_saying_why(tmp_path):
    from flash_forensics.orchestrator.report.rows import job_row
    rec = json.loads((BASELINE / "result.json").read_text())
    for edit, needle in ((dict(divergence_step=-5), "divergence_step=-5 is not a step"),
                         (dict(observed="stable", divergence_step=None, final_loss=float("nan")),
                          "observed 'stable' with final_loss=nan")):
        job = tmp_path / needle[:8].replace(" ", "_")
        job.mkdir()
        (job / "result.json").write_text(json.dumps({**rec, **edit}))
        row = job_row(job, "j")
        assert row["observed"] == "failed" and needle in row["error"], row["error"]
    assert job_row(BASELINE, "b")["observed"] == "diverged"


def test_stabilizers_over_several_reports_names_each_rows_report(tmp_path):
    a, b = tmp_path / "seed1" / "report", tmp_path / "seed2" / "report"
    for d, div in ((a, 100), (b, 200)):
        d.mkdir(parents=True)
        (d / "verdicts.json").write_text(json.dumps({"runs": [
            {"intervention": "baseline", "observed": "diverged", "divergence_step": div, "final_loss": 5.0}]}))
    paths = stabilizers.write([a, b], None, "two", results=tmp_path / "out")
    md = paths["md"].read_text()
    assert "| report | intervention |" in md
    assert "| seed1/report | baseline |" in md and "| seed2/report | baseline |" in md
    one = stabilizers.write([a], None, "one", results=tmp_path / "out")["md"].read_text()
    assert "| report |" not in one  # one report: no column to tell rows apart


def test_small_cli_refusals(tmp_path, capsys):
    from flash_forensics.kernels import sfa_matrix
    with pytest.raises(SystemExit):
        sfa_matrix.main(["--out", str(tmp_path)])
    assert "it is a folder; expected a file path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        early_warning.main(["--experiment", "foo"])
    assert "--experiment needs the store that holds it" in capsys.readouterr().err
    assert [n for n, _ in fork.sweep_file_jobs(["beta_sweep.yaml"])] == [n for n, _ in fork.sweep_file_jobs(
        ["beta_sweep"])]  # a file name names the sweep too
    assert fork.main(["jobs", "beta_sweep", "beta_sweep.yaml"]) == 1  # jobs beta_sweep-0.. twice, same folders
    assert "sweep 'beta_sweep' is given twice" in capsys.readouterr().err


def test_localize_names_an_unreadable_result_json(tmp_path, capsys):
    """A job folder whose result.json is not a record: 'localize: Expecting value: line 1 column 1 (char 0)',
    naming no file; in a sweep folder, 'no job with result.json' though one was there, unreadable."""
    job = tmp_path / "sweep" / "0"
    job.mkdir(parents=True)
    (job / "result.json").write_text("garbage")
    assert localize_main([str(job)]) == 2
    assert f"localize: {job / 'result.json'} is not a readable run record (JSONDecodeError" in capsys.readouterr().err
    assert localize_main([str(tmp_path / "sweep")]) == 2
    assert "; unreadable result.json in 0" in capsys.readouterr().err


def test_a_sweep_file_that_is_no_sweep_is_named(tmp_path, capsys):
    """fork jobs (and isolate --sweeps) on a file that is not YAML gave yaml's 'ParserError: while parsing a flow
    node', on a YAML list an AttributeError, naming no file; an empty file gave one job with no overrides, exit 0."""
    (tmp_path / "broken.yaml").write_text("foo: [1,\n")
    (tmp_path / "alist.yaml").write_text("- a\n- b\n")
    (tmp_path / "empty.yaml").write_text("\n")
    (tmp_path / "badparam.yaml").write_text("hydra:\n  sweeper:\n    params:\n      intervention: 'a,(b'\n")
    for name, says in (("broken", "broken.yaml is not valid YAML (while parsing a flow node)"),
                       ("alist", "alist.yaml has no hydra.sweeper.params"),
                       ("empty", "empty.yaml has no hydra.sweeper.params"),
                       ("badparam", "badparam.yaml: hydra.sweeper.params: Error parsing override 'intervention=a,(b'")):
        assert fork.main(["jobs", str(tmp_path / name)]) == 1
        printed = capsys.readouterr()
        assert f"sweep {str(tmp_path / name)!r}: {tmp_path / says}" in printed.err and not printed.out, printed


def test_analyze_refuses_repeated_heads_and_a_blind_run_without_a_fingerprint(capsys):
    from flash_forensics.capture.cli import main as analyze_main
    cap = str(ROOT / "results" / "capture_default" / "gpt_step59_L3.safetensors")
    for args, needle in ((["--heads", "0,0"], "expected each head once"),
                         (["--blind", "--no-fingerprint"], "--blind with --no-fingerprint is not allowed"),
                         # flags that the run would not use: they were ignored
                         (["--heads", "1", "--top", "3"], "--top=3 with --heads is not allowed"),
                         (["--no-fingerprint", "--fingerprint-heads", "all"],
                          "--fingerprint-heads=all with --no-fingerprint is not allowed")):
        with pytest.raises(SystemExit):
            analyze_main([cap, *args])
        assert needle in capsys.readouterr().err


def test_data_tool_names_a_missing_tokenizer_file_and_a_root_that_is_a_file(tmp_path, capsys):
    from flash_forensics.orchestrator.data.__main__ import main as data_main
    assert data_main(["tokenizer", "--from", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert data_main(["prepare", f"data.root={tmp_path / 'afile'}"]) == 2
    assert "must be a writable folder" in capsys.readouterr().err


def test_data_prepare_checks_vocab_size_first_and_takes_overrides_after_options(tmp_path, capsys):
    """--vocab-size 10 was refused only after the whole corpus was tokenized, naming model.vocab_size; overrides
    after an option (`--force data=text_files ...`) were 'unrecognized arguments'."""
    from flash_forensics.orchestrator.data.__main__ import main as data_main
    with pytest.raises(SystemExit) as e:
        data_main(["prepare", f"data.root={tmp_path / 'd'}", "--vocab-size", "10"])
    assert e.value.code == 2 and "--vocab-size=10 is not allowed: expected an integer >= 50257" in \
        capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # nothing tokenized
    with pytest.raises(SystemExit):
        data_main(["prepare", "--force", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("some words to tokenize, enough for a train and a val split.\n" * 4)
    assert data_main(["prepare", "--force", f"data.root={tmp_path / 'd'}", "data=text_files",
                      f"data.files=[{tmp_path / 'a.txt'}]"]) == 0
    assert "text_files-" in capsys.readouterr().out


def test_localize_names_its_flags_and_refuses_job_with_a_job_folder(tmp_path, capsys):
    assert localize_main([str(BASELINE), "--window", "0"]) == 2
    assert "localize: --window=0 is not allowed" in capsys.readouterr().err  # the flag, not localize.window
    assert localize_main([str(BASELINE), "--job", "foo"]) == 2
    assert "--job 'foo' is not allowed with a job folder" in capsys.readouterr().err
    # a mistyped folder was taken for a run id: the default store's absence said, not the source
    assert localize_main(["baselin", "--tracking-uri", f"sqlite:///{tmp_path}/none.db"]) == 2
    assert "source 'baselin' is not allowed: no such folder, and not an MLflow run id" in capsys.readouterr().err


def test_a_run_missing_from_its_store_is_named_with_the_store(tmp_path, capsys):
    from flash_forensics.orchestrator.tracking.store import make_client
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    make_client(uri)  # an empty store
    with pytest.raises(ValueError, match=r"MLflow run 0123abcd is not in sqlite:///.*m.db: give the store"):
        readback.history(readback.client_for(uri), "0123abcd")
    # localize with a run id: was 'MlflowException: Run with id=... not found' (exit 1), naming no store
    rid = "0123456789abcdef0123456789abcdef"
    assert localize_main([rid, "--tracking-uri", uri]) == 2
    assert f"localize: MLflow run {rid} is not in {uri}: give the store" in capsys.readouterr().err


def test_stabilizers_refuses_a_report_twice_and_names_an_unreadable_bench(tmp_path, capsys):
    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / "verdicts.json").write_text(json.dumps({"runs": [
        {"intervention": "baseline", "observed": "diverged", "divergence_step": 100, "final_loss": 5.0}]}))
    # the second copy's rows would fold into the first's, each shown as a run repeated ("x2: one outcome")
    assert stabilizers.main(["--reports", str(rep), str(tmp_path / "." / "rep"), "--results", str(tmp_path)]) == 1
    assert "--reports" in capsys.readouterr().err and not (tmp_path / "stabilizers").exists()
    gz = tmp_path / "h.json.gz"
    gz.write_bytes((BASELINE.parent / "mlflow-seed1337.json.gz").read_bytes()[:100])
    for bench, why in ((tmp_path / "none.json", "No such file or directory"), (tmp_path, "Is a directory"),
                       (gz, "not a text file")):
        assert stabilizers.main(["--reports", str(rep), "--bench", str(bench), "--results", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert f"--bench={str(bench)!r} is not allowed: {why}; expected a benchmarks/stabilizers.py JSON" in err, err
    assert not (tmp_path / "stabilizers").exists()


def test_early_warning_refuses_a_tracking_uri_it_would_not_read(tmp_path, capsys):
    """--tracking-uri with --histories: the store was silently unread (every history came from the export)."""
    import gzip
    gz = tmp_path / "e.json.gz"
    gz.write_bytes(gzip.compress(json.dumps({"runs": []}).encode()))
    with pytest.raises(SystemExit) as e:
        early_warning.main([str(tmp_path), "--histories", str(gz), "--tracking-uri", f"sqlite:///{tmp_path}/m.db",
                            "--out", str(tmp_path / "ew")])
    assert e.value.code == 2 and "with --histories is not allowed: the histories come from the export alone" in \
        capsys.readouterr().err
    assert not (tmp_path / "ew").exists() and not (tmp_path / "m.db").exists()


def test_early_warning_refuses_a_run_given_twice(tmp_path, capsys):
    report = BASELINE.parent / "report"
    for twice in ([str(report / "verdicts.json"), str(report)], [str(report / "verdicts.json"), str(BASELINE)]):
        # read twice, each run would count twice (28 runs of 14, 8 false alarms of 4); refused before any store
        assert early_warning.main([*twice, "--out", str(tmp_path / "ew")]) == 1
        err = capsys.readouterr().err
        assert f"source {twice[1]!r} gives MLflow run " in err and "expected each run once" in err, err
    assert not (tmp_path / "ew").exists()


def test_report_reads_a_job_reached_through_its_sweep_and_itself_once(tmp_path, capsys):
    forks = tmp_path / "forks"
    for job in ("beta_sweep-0", "beta_sweep-1"):
        shutil.copytree(BASELINE.parent / "forks" / job, forks / job)
    assert report_main([str(forks), str(forks / "beta_sweep-0"), "--out", str(tmp_path / "r")]) == 0
    assert "1 run(s) reached twice" in capsys.readouterr().out
    jobs = [r["job"] for r in json.loads((tmp_path / "r" / "verdicts.json").read_text())["runs"]]
    assert jobs == ["forks/beta_sweep-0", "forks/beta_sweep-1"]  # not beta_sweep-0 twice


def test_report_refuses_a_tracking_uri_it_cannot_read(tmp_path, capsys):
    (tmp_path / "notadb.db").write_text("not a database\n")
    for uri, why in ((str(tmp_path / "m.db"), "MLflow 3.17 refuses the file store; use sqlite:///<path>.db"),
                     (f"sqlite:///{tmp_path}/notadb.db", "is not an SQLite database"),
                     (f"sqlite:///{tmp_path}/none.db", f"no MLflow store at {tmp_path}/none.db"),
                     ("nonsense://x", "expected sqlite:///<path>.db, http(s)://<server>")):
        # was exit 0: a report without histories nor run links, the store's failure a line among many
        assert report_main([str(BASELINE), "--out", str(tmp_path / "r"), "--tracking-uri", uri]) == 1
        err = capsys.readouterr().err
        assert f"--tracking-uri {uri!r} is not allowed: " in err and why in err, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "none.db").exists()


def test_an_output_folder_that_is_a_file_is_named_by_its_flag(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    report = BASELINE.parent / "report"
    # each failed at its mkdir, naming no flag (a traceback as python -m; early-warning after reading every run)
    with pytest.raises(SystemExit):
        early_warning.main([str(report / "verdicts.json"), "--out", str(afile / "ew")])
    assert f"--out={str(afile / 'ew')!r} is not allowed: {afile} is a file" in capsys.readouterr().err
    assert report_main([str(BASELINE), "--out", str(afile)]) == 1
    assert f"--out={str(afile)!r} is not allowed: {afile} is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        stabilizers.main(["--reports", str(report), "--results", str(afile)])
    assert f"--results={str(afile)!r} is not allowed: {afile} is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        stabilizers.main(["--reports", str(report), "--results", str(tmp_path), "--name", "afile"])
    assert f"--name='afile' is not allowed: {afile} is a file" in capsys.readouterr().err


def test_a_verdicts_json_with_no_runs_or_runs_that_are_not_objects_is_named(tmp_path, capsys):
    from flash_forensics.orchestrator.analysis.localize.rounding_io import main as rounding_main
    rep = tmp_path / "rep"
    rep.mkdir()
    f = rep / "verdicts.json"
    f.write_text(json.dumps({"runs": [1, "x"]}))  # was AttributeError: 'int' object has no attribute 'get'
    assert stabilizers.main(["--reports", str(rep), "--results", str(tmp_path / "out")]) == 1
    assert f"{f} is not a report's verdicts.json (its runs are not objects)" in capsys.readouterr().err
    assert early_warning.main([str(f), "--out", str(tmp_path / "ew")]) == 1
    assert f"{f}: not a report's verdicts.json" in capsys.readouterr().err
    for text, why in (('{"runs": [1]}', "holds no runs"), ('{"runs": [', "is not valid JSON"),
                      ('{"runs": []}', "holds no runs")):  # the last wrote an empty table with exit 0
        f.write_text(text)
        assert rounding_main([str(rep), "--out", str(tmp_path / "lr"), "--no-tags"]) == 2
        assert f"source {str(rep)!r}" in (err := capsys.readouterr().err) and why in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ew").exists() and not (tmp_path / "lr").exists()


def test_report_refuses_an_export_that_holds_none_of_its_runs(tmp_path, capsys):
    other = BASELINE.parents[1] / "seed1-2026-12-04" / "mlflow-seed1.json.gz"  # another seed's store
    # was exit 0: a report without any history, "1 run(s) not in" a line among many
    assert report_main([str(BASELINE), "--out", str(tmp_path / "r"), "--histories", str(other)]) == 1
    assert f"--histories {str(other)!r} is not allowed: it holds none of the 1 run(s) (baseline, ...)" in \
        capsys.readouterr().err
    assert not (tmp_path / "r").exists()
