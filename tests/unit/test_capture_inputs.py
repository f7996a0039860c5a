"""`analyze` refuses a bad FILE, --out or --mlflow before the analysis (one line naming the argument, exit 2, no
report written); a capture whose meta names heads the model lacks is refused; a file naming another recipe than its
fingerprint finds is said so."""
import socket

import pytest

from flash_forensics.capture import analysis as A
from flash_forensics.capture import cli
from flash_forensics.capture.recorder import write_call
from flash_forensics.capture.snapshot import SnapshotError
from flash_forensics.capture.synthetic import tied_inputs
from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import reference_attention


def _capture(tmp_path, computed="fa2", named="fa2", name="c", **kw):
    q, k, v, do = tied_inputs(1, 2, 32, 16, seed=0)
    o, lse, *_ = reference_attention(q, k, v, AttentionKnobs(recipe=computed))
    return write_call(tmp_path / f"{name}.safetensors", q, k, v, o, do, lse, recipe=named,
                      knobs=AttentionKnobs(recipe=named).knob_values(), family="test", layer=0, **kw)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cap(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "garbage.db").write_text("not a database\n")
    return _capture(tmp_path)


@pytest.mark.parametrize("args, says", [
    (["{t}"], "FILE='{t}' is a folder (it holds c.safetensors); expected one .safetensors capture file"),
    (["{t}/none.safetensors"], "FILE='{t}/none.safetensors': no such file"),
    (["{c}", "--out", "{t}/afile"], "--out='{t}/afile' is a file; expected a folder"),
    (["{c}", "--out", "{t}/afile/sub"], "lies under {t}/afile, which is a file"),
    (["{c}", "--out", "/proc/ff/out"], "--out='/proc/ff/out': /proc is not writable"),
    (["{c}", "--mlflow", "http://127.0.0.1:{port}"], "--mlflow='http://127.0.0.1:{port}': MLflow server unreachable"),
    (["{c}", "--mlflow", "sqlite:///{t}/garbage.db"], "garbage.db is not an SQLite database"),
    (["{c}", "--mlflow", "sqlite:///{t}"], "is a folder; expected the path of an sqlite file"),
    (["{c}", "--mlflow", "{t}/store"], "MLflow 3.17 refuses the file store"),
])
def test_bad_arguments_are_refused_before_the_analysis(cap, capsys, monkeypatch, args, says):
    ran = []
    monkeypatch.setattr(cli, "analyze", lambda *a, **k: ran.append(a))  # the refusal comes before any work
    fill = {"t": cap.parent, "c": cap, "port": _dead_port()}
    rc = cli.main([a.format(**fill) for a in args] + ["--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not ran and len(err) == 1 and says.format(**fill) in err[0], err
    assert not list(cap.parent.glob("*.md"))


def test_a_new_sqlite_store_keeps_its_artifacts_beside_it(cap, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/new/m.db"
    assert cli.main([str(cap), "--quiet", "--no-fingerprint", "--no-attribution", "--mlflow", uri]) == 0
    assert not (tmp_path / "mlruns").exists()
    exp = MlflowClient(uri).get_experiment_by_name("flash-forensics-capture")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # not MLflow's GenAI pages
    assert sorted(p.name for p in (tmp_path / "new" / "mlartifacts").rglob("c.*")) == ["c.html", "c.json", "c.md"]


@pytest.mark.parametrize("heads, says", [([0, 5], "names head 5, but meta n_head=2"),
                                         ([1, 1], "expected distinct head numbers")])
def test_meta_heads_the_tensors_lack_are_refused(tmp_path, heads, says):
    with pytest.raises(SnapshotError, match=says):
        _capture(tmp_path, heads=heads)


def test_a_named_recipe_the_fingerprint_contradicts_is_said(tmp_path, capsys):
    honest = A.analyze(_capture(tmp_path, name="honest"), attribute=False, progress=False)
    assert "conflict" not in honest
    path = _capture(tmp_path, computed="paper_bf16", named="fa2", name="liar")
    res = A.analyze(path, attribute=False, progress=False)
    assert res["fingerprint"]["best"].startswith("paper_bf16") and res["recipe"] == "fa2"
    assert "the file names fa2" in res["conflict"] and res["conflict"] in res["notes"]
    assert cli.main([str(path), "--quiet", "--no-attribution"]) == 0
    assert "warning: the file names fa2" in capsys.readouterr().err
