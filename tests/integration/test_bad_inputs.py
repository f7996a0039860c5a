"""Bad inputs end with one clear line and a non-zero exit, before anything starts: the analysis tools on missing,
empty or garbage inputs, the isolation pipeline on a sweep or preset that does not exist; no lock file is left."""
import pytest

from flash_forensics import cli
from flash_forensics.orchestrator.tracking.store import make_client


@pytest.fixture
def bad(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notadb.db").write_text("garbage, not a database\n")
    return tmp_path


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


@pytest.mark.parametrize("argv, says", [
    (["report", "--out", "{t}/o", "{t}/empty"], "no job folders"),
    (["report", "--out", "{t}/o", "{t}/missing"], "not a directory"),
    (["report", "--out", "{t}/o", "--from-mlflow", "x", "--tracking-uri", "sqlite:///{t}/notadb.db"],
     "is not an SQLite database"),
    (["early-warning", "{t}/empty"], "no job folders"),
    (["early-warning", "{t}/notadb.db"], "not a directory"),
])
def test_analysis_tools_on_bad_inputs(bad, capsys, argv, says):
    rc, err = _run(capsys, *[a.format(t=bad) for a in argv])
    assert rc != 0 and len(err) == 1 and says in err[0], err
    assert not list(bad.rglob("*.lock"))


def test_isolate_checks_every_name_before_the_baseline(bad, capsys):
    for argv, says in ((["--sweeps", "paper_isolation", "no_such_sweep"], "sweep 'no_such_sweep'"),
                       (["--experiment", "no_such_preset"], "--experiment='no_such_preset' is not allowed"),
                       (["intervention=fp32"], "the pipeline chooses the interventions")):
        rc, err = _run(capsys, "isolate", "--root", str(bad / "iso"), "--uri", f"sqlite:///{bad}/m.db", *argv)
        assert rc == 1 and says in err[-1], err
        assert not (bad / "iso").exists() and not (bad / "m.db").exists()  # nothing trained, nothing logged


def test_isolate_checks_its_folders_store_and_keys_before_the_baseline(bad, capsys):
    """--root or --out a file, --uri a file that is not a database: the baseline's run.py refused them and isolate
    went on to read a result.json that could not exist (or trained the baseline, then met --out at the report); a
    typo'd key got Hydra's '+train.lr=1' hint, not run.py's closest field. All refused in the preflight now."""
    (bad / "afile").write_text("x")
    for argv, says in ((["--root", "{t}/afile"], "--root='{t}/afile' is not allowed: {t}/afile is a file"),
                       (["--out", "{t}/afile"], "--out='{t}/afile' is not allowed: {t}/afile is a file"),
                       (["--uri", "sqlite:///{t}/notadb.db"], "--uri: tracking.uri='sqlite:///{t}/notadb.db': "
                                                             "{t}/notadb.db is not an SQLite database"),
                       (["train.lr=1"], "train.lr is not a config key: train has no field 'lr'; did you mean "
                                        "optimizer.lr?"),
                       (["--fork-override", "train.lr=1"], "did you mean optimizer.lr?")):
        argv = [a.format(t=bad) for a in argv]
        base = [] if "--root" in argv else ["--root", str(bad / "iso")]
        base += [] if "--uri" in argv else ["--uri", f"sqlite:///{bad}/m.db"]
        rc, err = _run(capsys, "isolate", *base, *argv)
        assert rc == 1 and len(err) == 1 and says.format(t=bad) in err[0], err
        assert not (bad / "iso").exists() and not (bad / "m.db").exists()  # nothing trained, nothing logged


def test_a_sqlite_store_leaves_no_lock_file(tmp_path):
    make_client(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()
    assert (tmp_path / "mlflow.db").is_file() and not (tmp_path / "mlflow.db.lock").exists()
