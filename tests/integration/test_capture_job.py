"""monitor.capture in a training job: snapshots at the chosen step and after the alarm fires, from the job's own
forward/backward (dO, x, W_Q), named in result.json and MLflow; a fork captures the step before the source's
divergence; bad settings are refused before anything runs. Also the analysis logged as an MLflow run."""
import json
from pathlib import Path

import pytest

import flash_forensics.orchestrator.config.schema  # noqa: E402,F401
from flash_forensics.capture import snapshot as S  # noqa: E402
from flash_forensics.capture.analysis import analyze  # noqa: E402
from flash_forensics.orchestrator import record  # noqa: E402
from flash_forensics.orchestrator.config.validate import ConfigError, validate_config  # noqa: E402
from tests.helpers import jobs as _jobs

BASE = ["experiment=smoke", "hydra.mode=RUN", "train.max_steps=7", "train.ckpt_every=4", "train.keep_checkpoints=0",
        "train.early_stop=false", "train.eval_every=0"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("capjob")
    res = _jobs.run_in(BASE, tmp, "src", "monitor.capture.steps=[1]", "monitor.capture.layers=[1]",
                       "monitor.capture.heads=[0,2]", "monitor.capture.at_alarm=true", "monitor.alarm.enabled=true",
                       "monitor.alarm.signal=max_logit", "monitor.alarm.threshold=-1e9")
    return tmp, res


def test_captures_at_the_step_and_after_the_alarm(source):
    tmp, res = source
    assert res["observed"] != "failed", res.get("error")
    paths = [Path(p) for p in res["captures"]]
    assert [p.name for p in paths] == ["gpt_step1_L1.safetensors", f"alarm_gpt_step{res['alarm']['step'] + 1}_L1"
                                                                    ".safetensors"]
    snap = S.read(paths[0])
    m = snap.meta
    assert (m["step"], m["layer"], m["heads"], m["family"], m["at_alarm"]) == (1, 1, [0, 2], "gpt", False)
    assert m["has_do"] and snap.x is not None and snap.w_q.shape == (2, 16, 64)
    assert S.read(paths[1]).meta["at_alarm"] is True
    out = analyze(paths[0], progress=False, attribute=False)
    assert out["fingerprint"]["exact"] and out["fingerprint"]["best"] == "paper_bf16"
    assert all(r["wq_err_proj"] is not None for r in out["per_head"])
    from mlflow.tracking import MlflowClient
    arts = MlflowClient(f"sqlite:///{tmp}/mlflow.db").list_artifacts(res["mlflow_run_id"], "captures")
    assert sorted(Path(a.path).name for a in arts) == sorted(p.name for p in paths)


def test_fork_captures_the_step_before_the_divergence(source):
    tmp, res = source
    src = tmp / "src"
    rec = json.loads(record.result_path(src).read_text())
    rec["divergence_step"] = 6  # as if the source had diverged at step 6
    record.result_path(src).write_text(json.dumps(rec))
    out = _jobs.run_in(BASE, tmp, "fork", f"from_checkpoint={src / 'checkpoints' / 'step_4.pt'}",
                       "monitor.capture.before_divergence=true", "monitor.capture.layers=[0]",
                       "monitor.capture.worst=1")
    assert out["observed"] != "failed", out.get("error")
    assert out["capture_before_divergence"]["step"] == 5
    (p,) = out["captures"]
    snap = S.read(p)
    assert snap.meta["step"] == 5 and len(snap.meta["heads"]) == 1


@pytest.mark.parametrize("override,words", [
    ("monitor.capture.layers=[5]", "monitor.capture.layers=[5] is not allowed: expected 'all' or a non-empty "
                                   "list of integers >= 0 < 2"),
    ("monitor.capture.heads=[4]", "monitor.capture.heads=[4] is not allowed"),
    ("monitor.capture.at_alarm=true", "monitor.capture.at_alarm=True is not allowed: expected false while "
                                      "monitor.alarm.enabled=false"),
    ("monitor.capture.before_divergence=true", "it needs from_checkpoint"),
    ("monitor.capture.at_alarm=true monitor.alarm.enabled=true monitor.alarm.action=stop",
     "there is no next step to capture"),
    ("monitor.capture.max_mib=0", "monitor.capture.max_mib=0"),
    ("monitor.capture.steps=[-1]", "monitor.capture.steps=[-1] is not allowed"),
])
def test_bad_capture_settings_are_refused_before_launch(tmp_path, override, words):
    cfg, overrides = _jobs.compose_cfg(BASE, tmp_path, *override.split())
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, overrides)
    assert words in str(e.value)


def test_analysis_as_an_mlflow_run(source, tmp_path):
    tmp, res = source  # the job's store (created already: a new sqlite store costs seconds)
    path = Path(res["captures"][0])
    out = analyze(path, progress=False, attribute=False)
    from flash_forensics.capture.report import log_mlflow, write_all
    from flash_forensics.orchestrator.tracking.store import make_client
    uri = f"sqlite:///{tmp}/mlflow.db"
    run_id = log_mlflow(out, uri, make_client(uri), write_all(out, tmp_path, "x"))
    from mlflow.tracking import MlflowClient
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.params["fingerprint_best"] == "paper_bf16"
    assert run.data.metrics["fingerprint_o_identical"] == 1.0


def test_a_resumed_run_does_not_capture_its_alarm_again(tmp_path):
    """The alarm fired and its at_alarm capture was taken in the first process; the same job resumed for more steps
    restores the firing, so it takes no second alarm capture (it took one at its first step before)."""
    on = ["monitor.capture.at_alarm=true", "monitor.capture.layers=[1]", "monitor.alarm.enabled=true",
          "monitor.alarm.signal=max_logit", "monitor.alarm.threshold=-1e9"]
    first = _jobs.run_in(BASE, tmp_path, "job", *on)
    assert [Path(p).name for p in first["captures"]] == [f"alarm_gpt_step{first['alarm']['step'] + 1}_L1.safetensors"]
    again = _jobs.run_in(BASE, tmp_path, "job", *on, "train.max_steps=10")
    assert again["resumed_from"] and again["steps_done"] == 10 and again["alarm"]["step"] == first["alarm"]["step"]
    assert not [p for p in again.get("captures") or [] if Path(p).name.startswith("alarm_")], again.get("captures")
