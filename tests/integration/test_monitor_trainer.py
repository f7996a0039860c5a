"""flash_forensics.Monitor in a user's loop (dicts and an MLflow run) and TrainerCallback in a real tiny Trainer run."""
import warnings

import pytest
import torch

import flash_forensics
from flash_forensics import families
from flash_forensics.hf_backend import NAME

transformers = pytest.importorskip("transformers")
V = 128
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)


@pytest.mark.parametrize("device", DEVICES)
def test_monitor_logs_every_signal_once_per_interval_and_resets(tmp_path, device):
    model = _llama().to(device)
    flash_forensics.use(model, recipe="paper_bf16", overrides={1: {"pv_fp32": True}})
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with flash_forensics.Monitor(model, log_every=3, wq_every=3, mlflow=True, tracking_uri=uri,
                                 experiment="t") as mon:
        outs = []
        for _ in range(6):
            ids = torch.randint(0, V, (2, 32), device=device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            outs.append(mon.step(loss))
    assert [o is not None for o in outs] == [False, False, True, False, False, True]
    last = outs[-1]
    assert {f"train/loss@{s}" for s in (3, 4, 5)} <= set(last)
    for layer in (0, 1):
        assert last[f"max_logit/L{layer}"] > 0
        for h in range(4):
            # 3 steps of 2 sequences x 32 rows since the last flush; 64-key tiles: one tile per row
            assert last[f"rows_seen/L{layer}.H{h}"] == 3 * 2 * 32
            assert 0 <= last[f"rmax_rows/L{layer}.H{h}"] <= 3 * 2 * 32
            assert 0 < last[f"attn_entropy/L{layer}.H{h}"] < torch.log(torch.tensor(32.0)).item()
            assert last[f"wq_sigma/L{layer}.H{h}"] > 0
    sigma = families.wq_spectral_norms(model)
    assert sigma.shape == (2, 4)
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(mon.run_id)
    assert run.info.status == "FINISHED" and run.data.params["family"] == "llama"
    assert len(client.get_metric_history(mon.run_id, "train/loss")) == 6


def _trainer(tmp_path, device, report_to, cb, max_steps=4, logging_steps=2):
    model = _llama()
    flash_forensics.use(model, recipe="paper_bf16")
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, V, (16, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=max_steps,
                                          per_device_train_batch_size=4, logging_steps=logging_steps,
                                          report_to=report_to,
                                          use_cpu=device == "cpu", save_strategy="no", disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_callback_in_a_tiny_trainer_run(tmp_path, device):
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (pyproject's [trainer] extra)
    cb = flash_forensics.TrainerCallback(wq_every=2)
    trainer = _trainer(tmp_path, device, [], cb, max_steps=5)
    trainer.train()
    assert [h["step"] for h in cb.history] == [1, 3, 4]  # the last, partial interval before the summary log
    assert all(h["rows_seen/L1.H3"] == 2 * 4 * 16 for h in cb.history[:2])  # 2 steps of 4 x 16 rows per flush
    assert cb.history[2]["rows_seen/L1.H3"] == 4 * 16
    assert "trainer/loss" in cb.history[1] and "wq_sigma/L0.H0" in cb.history[-1]
    logged = [e for e in trainer.state.log_history if "rows_seen/L0.H0" in e]  # in the Trainer's own logs
    assert [e["step"] for e in logged] == [2, 4, 5] and all("loss" in e for e in logged[:2])
    assert logged[0]["rows_seen/L0.H0"] == 2 * 4 * 16 and "trainer/loss" not in logged[0]


def test_trainer_callback_flushes_at_the_trainers_logging_steps_given_as_a_ratio(tmp_path):
    pytest.importorskip("accelerate")
    cb = flash_forensics.TrainerCallback()
    trainer = _trainer(tmp_path, "cpu", [], cb, max_steps=4, logging_steps=0.5)  # the Trainer logs at 2 and 4
    trainer.train()
    assert cb.monitor.log_every == 2  # was 10: step 2's log had none of its values
    assert [e["step"] for e in trainer.state.log_history if "rows_seen/L0.H0" in e] == [2, 4]


def test_trainer_callback_values_in_report_tos_mlflow_run_only(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    with pytest.raises(ValueError, match=r"TrainerCallback\(mlflow=True\) with TrainingArguments.report_to="
                       r"\['mlflow'\] is not allowed"):
        _trainer(tmp_path, "cpu", ["mlflow"], flash_forensics.TrainerCallback(mlflow=True, tracking_uri=uri))
    _trainer(tmp_path, "cpu", ["mlflow"], flash_forensics.TrainerCallback(wq_every=2)).train()
    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1  # one training, one run: the Trainer's
    hist = client.get_metric_history(runs[0].info.run_id, "rmax_rows/L1.H2")
    assert [m.step for m in hist] == [2, 4]
    assert client.get_metric_history(runs[0].info.run_id, "loss")  # the Trainer's own metrics beside them


@pytest.mark.parametrize("device", DEVICES)
def test_capture_through_the_backend_and_analyze(tmp_path, device):
    """A transformers model's attention call captured through the backend's hooks (with dO), then analyzed."""
    model = _llama().to(device, torch.bfloat16)
    flash_forensics.use(model, recipe="paper_bf16")
    ids = torch.randint(0, V, (2, 32), device=device)
    with flash_forensics.capture(tmp_path, layers=[1], heads=[0, 3], say=None) as rec:
        model(input_ids=ids, labels=ids).loss.backward()
    (path,) = rec.paths
    from flash_forensics.capture import analyze, read
    snap = read(path)
    assert snap.meta["family"] == "llama" and snap.meta["recipe"] == "paper_bf16" and "do" in snap.tensors
    assert snap.tensors["q"].shape == (2, 2, 32, 16)
    report = analyze(path)
    best = report["fingerprint"]["candidates"][0]
    assert best["recipe"] == "paper_bf16" and best["o_identical"] == 1.0, best


def test_monitor_refuses_what_it_could_never_count():
    cfg = _llama().config
    sdpa = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"Monitor: model.config._attn_implementation='sdpa' is not allowed: "
                                         r"expected 'forensics'.*model.layers.0.self_attn"):
        flash_forensics.Monitor(sdpa)  # refused here, not at the first flush
    with pytest.raises(ValueError, match="Monitor: model=NoneType is not allowed"):
        flash_forensics.Monitor(None)
    with pytest.raises(ValueError, match=r"use\(\): model=NoneType is not allowed"):
        flash_forensics.use(None)
    with pytest.raises(ValueError, match="the model itself"):  # a module computing attention itself, by name
        flash_forensics.use(torch.nn.MultiheadAttention(16, 2))
    with pytest.raises(ValueError, match=r"TrainerCallback.log_every=0 is not allowed"):
        flash_forensics.TrainerCallback(log_every=0)
    with pytest.raises(ValueError, match=r"TrainerCallback.wq_every=-1 is not allowed"):
        flash_forensics.TrainerCallback(wq_every=-1)


def test_a_monitor_made_before_a_second_use_counts_under_the_new_recipe():
    model = _llama()
    flash_forensics.use(model, recipe="fp32")
    mon = flash_forensics.Monitor(model, log_every=1, wq_every=50)
    flash_forensics.use(model, recipe="paper_bf16")  # replaced its layers' states: the Monitor read zeros
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and said "no attention call reached the backend"
        model(input_ids=torch.randint(0, V, (2, 8)))
        out = mon.step()
    assert out["rows_seen/L0.H0"] == 2 * 8 and "max_logit/L1" in out
    assert [st.knobs.recipe for st in mon.states] == ["paper_bf16", "paper_bf16"]


def test_the_first_interval_counts_from_the_monitor_on():
    model = _llama()
    flash_forensics.use(model, recipe="fp32")
    ids = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        model(input_ids=ids)  # a warm-up or eval forward before the Monitor
    mon = flash_forensics.Monitor(model, log_every=1, wq_every=50)
    model(input_ids=ids)
    assert mon.step()["rows_seen/L0.H0"] == 2 * 8  # was 2 forwards' rows, as every count


def test_what_was_not_measured_is_not_logged_as_zero():
    model = _llama()
    flash_forensics.use(model, recipe="fp32", overrides={1: {"counters": False}})
    mon = flash_forensics.Monitor(model, log_every=4, wq_every=50)
    ids = torch.randint(0, V, (1, 8))
    with pytest.warns(UserWarning, match=r"counters=False in 1 of 2 attention modules \(L1\).*not logged"):
        for _ in range(6):
            mon.step(model(input_ids=ids, labels=ids).loss)
    mon.close()  # steps 4-5: no logging step, so no entropy pass
    first, last = mon.history
    assert first["attn_entropy/L0.H0"] > 0 and not any(k.startswith("attn_entropy/") for k in last)
    assert last["rows_seen/L0.H0"] == 2 * 8 and not any("/L1." in k for k in last if not k.startswith("wq_"))


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_counts_each_forward_once(reentrant):
    model = _llama()
    flash_forensics.use(model, recipe="fp32")
    # recomputes each layer in the backward (transformers 5.17 and older: gradient_checkpointing_enable)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": reentrant})
    model.train()
    mon = flash_forensics.Monitor(model, log_every=1, wq_every=50)
    ids = torch.randint(0, V, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    out = mon.step(loss)
    assert out["rows_seen/L0.H0"] == out["rows_seen/L1.H3"] == 2 * 8  # were twice that, as every count
    assert out["attn_entropy/L1.H0"] > 0


def test_monitor_step_arguments_and_a_non_finite_loss():
    model = _llama()
    flash_forensics.use(model, recipe="fp32")
    mon = flash_forensics.Monitor(model, log_every=2, wq_every=50)
    ids = torch.randint(0, V, (1, 8))
    loss = model(input_ids=ids, labels=ids).loss
    mon.step(loss, step=3)
    for bad, match in ((dict(step=3), r"step=3\) is not allowed: expected an integer >= 4 .*last one was 3"),
                       (dict(step=-5), r"step=-5\) is not allowed"), (dict(step="x"), r"step='x'\) is not allowed")):
        with pytest.raises(ValueError, match=match):
            mon.step(loss, **bad)
    with pytest.raises(ValueError, match=r"loss=tensor of shape \(2,\)\) is not allowed: expected a scalar"):
        mon.step(torch.ones(2))
    with pytest.warns(RuntimeWarning, match=r"loss is not finite at 1 step\(s\).*step 5: nan"):
        out = mon.step(torch.tensor(float("nan")), step=5)  # flushes (log_every=2): logged as it is, and said
    assert out["train/loss@5"] != out["train/loss@5"]
    mon.close()
    with pytest.raises(RuntimeError, match=r"after close\(\)"):
        mon.step(loss)


def test_monitor_names_a_bad_tracking_uri_before_mlflow_does():
    model = _llama()
    flash_forensics.use(model, recipe="fp32")
    for uri, needle in (("nonsense://x", "tracking.uri='nonsense://x' is not allowed"),
                        ("http://127.0.0.1:9", "MLflow server unreachable")):
        with pytest.raises(ValueError, match=rf"Monitor\(mlflow=True\): .*{needle}"):
            flash_forensics.Monitor(model, mlflow=True, tracking_uri=uri)
