"""Validation before anything runs: every bad value is reported with its key, the value and what is allowed.

Types are enforced by the structured config (orchestrator/config/schema.py) at compose time; this module checks ranges,
cross-field rules (layer/head indices against the model, knobs that cannot hold together, an intervention against
explicit user overrides, two interventions against each other), the resume / fork checkpoint and the tracking store.
It also builds the job's effective attention config (conf attention + the intervention's knobs).
Over 400 lines because it is the one place that says, section by section, what a job may be given; the knob rules
themselves stay in kernels/knobs.py.
"""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from flash_forensics.kernels import knobs as knob_table
from flash_forensics.kernels.checks import bad, int_range, is_int, is_num
from flash_forensics.kernels.config import AttentionConfig, AttentionKnobs, LayerOverride
from flash_forensics.kernels.recipes import for_knobs
from flash_forensics.models.hf import check_attention, check_job
from flash_forensics.orchestrator.config.budget import check_budget
from flash_forensics.orchestrator.config.schema import (
    COMPILE_CASTS,
    COMPILES,
    DETERMINISTIC,
    DEVICES,
    EXPECTS,
    OPTIMIZERS,
    PRECISIONS,
    Config,
)
from flash_forensics.orchestrator.data.config import DataError
from flash_forensics.orchestrator.data.corpora import check_text, open_corpus
from flash_forensics.orchestrator.data.prepare import dataset_dir
from flash_forensics.orchestrator.data.replay import OrderReader, read_header
from flash_forensics.orchestrator.errors import ConfigError  # noqa: F401  (re-exported)
from flash_forensics.orchestrator.interventions import build_hooks, effective_model, load
from flash_forensics.orchestrator.interventions import spec as iv_spec
from flash_forensics.orchestrator.job.fork import check_fork, check_model, check_resume_hooks, source_header
from flash_forensics.orchestrator.tracking.tracker import check_tracking

KNOBS = tuple(f.name for f in fields(AttentionKnobs))


def _bad(key: str, value, allowed: str) -> ConfigError:
    return bad(key, value, allowed, ConfigError)


def _int(key: str, value, low: int, high: Optional[int] = None) -> None:
    if not is_int(value, low, high):
        raise _bad(key, value, int_range(low, high))


def _num(key: str, value, low: float, strict: bool = True) -> None:
    if not is_num(value, low, strict):
        raise _bad(key, value, f"a number {'>' if strict else '>='} {low}")


# ------------------------------------------------------------------------------------------------ to objects
def to_object(cfg):
    """DictConfig (composed by Hydra, maybe with the hydra node) -> schema.Config dataclass instance."""

    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, DictConfig):
        node = cfg.copy()
        with _open(node):
            node.pop("hydra", None)
        try:
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), node))
        except Exception as e:  # OmegaConf names the full key and the offending value
            msg = str(e).strip().splitlines()[0]
            ref = re.match(r"While dereferencing interpolation '\$\{([\w.]+)\}': (.*)", msg)
            if ref:  # the key the user set, not the internal one that interpolates it
                into = getattr(e, "full_key", None)
                raise ConfigError(f"{ref.group(1)}: {ref.group(2)}" + (f" (it is used in {into})" if into else "")) \
                    from None
            raise ConfigError(msg + _where(e)) from None
    raise TypeError(f"cannot validate a {type(cfg).__name__}")


class _open:
    def __init__(self, node):
        self.node = node

    def __enter__(self):
        self._flag = self.node._get_flag("struct")
        OmegaConf.set_struct(self.node, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.node, self._flag)


def _where(e) -> str:
    key = getattr(e, "full_key", None)
    return f" (key: {key})" if key else ""


# ------------------------------------------------------------------------------------------- interventions
def intervention_knobs(iv) -> Dict[str, object]:
    """The attention knobs an intervention sets (None = not set)."""
    return {k: getattr(iv, k) for k in KNOBS if getattr(iv, k, None) is not None}


def effective_attention(cfg) -> AttentionConfig:
    """conf attention with the intervention's knobs applied and its per-layer overrides appended."""
    att, iv = cfg.attention, cfg.intervention
    base = {k: getattr(att, k) for k in KNOBS}
    base.update(intervention_knobs(iv))
    base["o_fp32_heads"] = list(base["o_fp32_heads"])
    overrides = [LayerOverride(**{f.name: getattr(o, f.name) for f in fields(LayerOverride)})
                 for o in list(att.overrides) + list(iv.overrides)]
    for o in overrides:
        o.layers = list(o.layers)
        if o.o_fp32_heads is not None:
            o.o_fp32_heads = list(o.o_fp32_heads)
    return AttentionConfig(**base, overrides=overrides)


def _parse(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(list(overrides))


def selected_interventions(overrides: Sequence[str]) -> List[str]:
    """Intervention names chosen on the command line (`intervention=[a,b]` selects several)."""
    for o in _parse(overrides):
        if o.key_or_group == "intervention" and not o.is_delete():
            value = o.value()
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return []


def _knob_sites(iv) -> Dict[Tuple[str, Optional[int]], object]:
    """(dotted key, layer or None for all layers) -> value, for the combination check: the attention knobs
    (attention.<knob>, per layer for overrides) and the model patch (model.<field>)."""
    sites = {(f"attention.{k}", None): v for k, v in intervention_knobs(iv).items()}
    for o in iv.overrides:
        for layer in o.layers:
            for k, v in o.set_knobs().items():
                sites[(f"attention.{k}", layer)] = v
    sites.update({(f"model.{k}", None): v for k, v in iv.model.set_fields().items()})
    return sites


def check_combination(names: Sequence[str], base) -> None:
    """Two interventions that set one knob (at one layer) to different values contradict each other."""

    owners: Dict[Tuple[str, Optional[int]], Tuple[str, object]] = {}
    with_hooks = []
    for name in names:
        iv = load(name, base.layer, list(base.heads))
        if iv.hooks:
            with_hooks.append(name)
        for site, value in _knob_sites(iv).items():
            if site in owners and owners[site][1] != value:
                other, ov = owners[site]
                where = site[0] + (f" in layer {site[1]}" if site[1] is not None else "")
                raise ConfigError(
                    f"intervention={list(names)}: {other} sets {where}={ov!r} but {name} sets it to {value!r}; "
                    f"allowed: interventions that set different knobs (or the same values)")
            owners[site] = (name, value)
    if len(with_hooks) > 1:  # Hydra merges lists by replacing them: one file's hooks would be dropped silently
        raise ConfigError(f"intervention={list(names)}: {' and '.join(with_hooks)} each bring train hooks; "
                          f"allowed: at most one intervention with hooks per job")


def check_user_overrides(iv, overrides: Sequence[str], label: Optional[str] = None) -> None:
    """An explicit `attention.<knob>=v` or `model.<field>=v` on the command line that the intervention sets otherwise
    is a contradiction."""
    owned = {f"attention.{k}": v for k, v in intervention_knobs(iv).items()}
    owned.update({f"model.{k}": v for k, v in iv.model.set_fields().items()})
    label = label or iv.name
    for o in _parse(overrides):
        key = o.key_or_group
        if key not in owned or o.is_sweep_override():
            continue
        knob = key.split(".", 1)[1]
        value = o.value()
        if value != owned[key] and not (isinstance(value, (int, float)) and value == owned[key]):
            raise ConfigError(
                f"{key}={value!r} contradicts intervention={label}, which sets {key}={owned[key]!r}; "
                f"allowed: drop the override or pick an intervention that leaves {knob} alone")


def ignored_scope(name: str, overrides: Sequence[str]) -> List[str]:
    """The scope keys typed in `overrides` (intervention.layer, intervention.heads) that intervention `name`'s file
    does not take: it acts on every layer and head, so the typed value would change nothing."""
    typed = [o.key_or_group for o in _parse(overrides)
             if o.key_or_group in ("intervention.layer", "intervention.heads") and not o.is_delete()]
    if not typed or not iv_spec.path(name).is_file():
        return []
    takes = iv_spec.scope(name)
    return [k for k in typed if k.split(".", 1)[1] not in takes]


def scope_refusal(key: str, overrides: Sequence[str], names: Sequence[str]) -> ConfigError:
    """The error for a typed scope key that no selected intervention takes."""
    value = next(o.value() for o in _parse(overrides) if o.key_or_group == key)
    kind = key.split(".", 1)[1]
    word = "a layer" if kind == "layer" else "heads"
    whose = f"its file takes no {kind}" if len(names) == 1 else f"none of their files takes {word}"
    return ConfigError(f"{key}={value!r} is not allowed with intervention={','.join(names)}: {whose} (each "
                       f"acts on every layer and head, so the value would change nothing); expected: drop it, or an "
                       f"intervention that takes {word}: {', '.join(iv_spec.scoped(kind))}")


def check_typed_scope(name: str, overrides: Sequence[str], fork: bool = False) -> None:
    """A single run: a typed intervention.layer / intervention.heads its intervention ignores is refused; a fork
    (from_checkpoint) is told instead: `isolate` passes its localization to every fork of a localized sweep."""
    unused = ignored_scope(name, overrides)
    if unused and not fork:
        raise scope_refusal(unused[0], overrides, [name])
    for key in unused:
        print(f"[validate] note: {key} changes nothing for intervention={name} (its file takes no "
              f"{key.split('.', 1)[1]}: it acts on every layer and head)", flush=True)


def check_triton_device(att: AttentionConfig, n_layer: int, device: str, key: str = "attention") -> None:
    """An explicit backend=triton needs a CUDA device (or Triton's CPU interpreter, TRITON_INTERPRET=1)."""
    import os

    import torch
    if device != "cpu" and (device != "auto" or torch.cuda.is_available()):
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    for layer in range(n_layer):
        k = att.for_layer(layer)
        if k.impl == "flash" and k.backend == "triton":
            where = att.where_set(layer, key)["backend"]
            raise ConfigError(f"{where}.backend='triton' (layer {layer}) is not allowed with train.device={device!r} "
                              f"on this machine (no CUDA GPU): the Triton kernels need one (TRITON_INTERPRET=1 runs "
                              f"them on the CPU interpreter, slowly); expected backend=auto or emulator")


def _route_words(k, src: Dict[str, str]) -> str:
    """The key and value that chose a layer's implementation, e.g. "attention.overrides[0].impl='sdpa'"."""
    if k.impl != "flash":
        return f"{src['impl']}.impl={k.impl!r}"
    auto = " (it can always fall back to the emulator)" if k.backend == "auto" else ""
    return f"{src['backend']}.backend={k.backend!r}{auto}"


def check_knob_combos(att: AttentionConfig, n_layer: int, key: str = "attention") -> None:
    """Per layer: every set knob must be computed where the layer runs (the knob table's computed_by).

    The implementation is the one the user chose (impl, or backend for flash); backend=auto is checked against the
    emulator, which computes the layer whenever Triton cannot (models/attention.py routes it there).
    """
    for layer in range(n_layer):
        k = att.for_layer(layer)
        impl = knob_table.implementation(k)
        for row in knob_table.unsupported(k, impl):
            src = att.where_set(layer, key)
            value = getattr(k, row.name)
            raise ConfigError(
                f"{src[row.name]} (layer {layer}): {row.name}={value!r} is not computed by {_route_words(k, src)}; "
                f"computed by: {knob_table.computed_by_words(row, value)}; allowed: {row.name}={row.off!r} in that "
                f"layer, or an impl/backend that computes it")
        _check_stochastic_round(k, att.where_set(layer, key), layer)


def _check_stochastic_round(k, src: Dict[str, str], layer: int) -> None:
    """stochastic_round rounds BF16 stores of P̄V and the O accumulator: refused where the layer has none, so it is
    never set and silently a no-op (fa2 / fp32 keep both in FP32; pv_fp32 / o_fp32 lift them for every head)."""
    if not k.stochastic_round:
        return
    import torch
    rc = for_knobs(k)  # the recipe with the knobs that lift or lower its points
    why = (f"pv_fp32=True (set at {src['pv_fp32']}) keeps them in FP32" if k.pv_fp32 else
           f"o_fp32=True (set at {src['o_fp32']}) keeps them in FP32" if k.o_fp32 else
           f"recipe={k.recipe!r} (set at {src['recipe']}) keeps P̄V and the O accumulator in FP32"
           if torch.bfloat16 not in (rc.pv_out, rc.acc) else None)
    if why:
        raise ConfigError(f"{src['stochastic_round']} (layer {layer}): stochastic_round=True is not allowed: "
                          f"{why}, nothing to round; allowed: recipe=paper_bf16 without pv_fp32/o_fp32, or "
                          f"stochastic_round=false")


# ----------------------------------------------------------------------------------------------- the sections
def check_optimizer(o) -> None:

    if o.name not in OPTIMIZERS:
        raise _bad("optimizer.name", o.name, "one of " + ", ".join(OPTIMIZERS))
    _num("optimizer.lr", o.lr, 0)
    _num("optimizer.min_lr", o.min_lr, 0, strict=False)
    if o.min_lr > o.lr:
        raise _bad("optimizer.min_lr", o.min_lr, f"a number <= optimizer.lr={o.lr}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise _bad("optimizer.betas", list(o.betas), "two numbers in [0, 1)")
    _num("optimizer.weight_decay", o.weight_decay, 0, strict=False)
    _num("optimizer.eps", o.eps, 0)
    _num("optimizer.muon_lr", o.muon_lr, 0)
    if not 0 <= o.muon_momentum < 1:
        raise _bad("optimizer.muon_momentum", o.muon_momentum, "a number in [0, 1)")
    _int("optimizer.ns_steps", o.ns_steps, 1)
    if o.decay_steps is not None:
        _int("optimizer.decay_steps", o.decay_steps, 1)


def check_train(t) -> None:

    for name in ("batch_size", "grad_accum", "max_steps", "eval_batches"):
        _int(f"train.{name}", getattr(t, name), 1)
    for name in ("eval_every", "ckpt_every", "ckpt_start", "seed", "keep_checkpoints"):
        _int(f"train.{name}", getattr(t, name), 0)
    if not is_int(t.warmup_steps, 0, t.max_steps):  # the message names both keys
        raise _bad("train.warmup_steps", t.warmup_steps, f"an integer >= 0 and <= train.max_steps={t.max_steps}")
    _num("train.grad_clip", t.grad_clip, 0, strict=False)
    if t.max_hours is not None:
        _num("train.max_hours", t.max_hours, 0)
    if t.precision not in PRECISIONS:
        raise _bad("train.precision", t.precision, "one of " + ", ".join(PRECISIONS))
    if t.device not in DEVICES:
        raise _bad("train.device", t.device, "one of " + ", ".join(DEVICES))
    if str(t.compile).lower() not in COMPILES:  # Hydra reads `train.compile=true` as a bool: "True" here
        raise _bad("train.compile", t.compile, "one of " + ", ".join(COMPILES))
    if str(t.compile_casts).lower() not in COMPILE_CASTS:  # as train.compile: Hydra's bool reads "True"
        raise _bad("train.compile_casts", t.compile_casts, "one of " + ", ".join(COMPILE_CASTS))
    if str(t.deterministic).lower() not in DETERMINISTIC:  # as train.compile: Hydra's bool reads "True"
        raise _bad("train.deterministic", t.deterministic, "one of " + ", ".join(DETERMINISTIC))
    if str(t.compile).lower() == "cudagraphs" and t.device == "cpu":
        raise _bad("train.compile", t.compile, "auto, true or false with train.device=cpu (CUDA graphs need a CUDA "
                                               "device)")
    if t.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise _bad("train.device", t.device, "auto or cpu on a machine without a CUDA GPU")


def check_intervention(iv, model) -> None:

    if iv.expect not in EXPECTS:
        raise _bad("intervention.expect", iv.expect, "one of " + ", ".join(EXPECTS))
    if iv.layer is not None:
        _int("intervention.layer", iv.layer, 0, model.n_layer - 1)
    for h in iv.heads:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < model.n_head:
            raise _bad("intervention.heads", list(iv.heads), f"head indices in 0..{model.n_head - 1} "
                                                            f"(model.n_head={model.n_head})")
    if len(set(iv.heads)) != len(iv.heads):
        raise _bad("intervention.heads", list(iv.heads), "distinct head indices (each head once)")
    if not iv.heads and iv_spec.path(iv.name).is_file() and "heads" in iv_spec.scope(iv.name):
        raise _bad("intervention.heads", list(iv.heads), f"at least one head index in 0..{model.n_head - 1}: "
                   f"intervention={iv.name} acts on its heads, and with none it would run the baseline under "
                   "another name")
    if iv.beta is not None and not iv.beta > 1:
        raise _bad("intervention.beta", iv.beta, "a number > 1 (beta = 1 is the safe softmax)")
    # the knobs the intervention sets, checked under the key the user typed (intervention.eps, not attention.eps)
    patch = {n: getattr(iv, n) for n in KNOBS if getattr(iv, n, None) is not None}
    if patch:
        try:
            AttentionKnobs(**patch).validate(model.n_head, key="intervention")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_text_files(d) -> None:
    """corpus=text_files: every file holds text, before any job starts (orchestrator/data/corpora.py)."""
    try:
        check_text(d)
    except DataError as e:
        raise ConfigError(str(e)) from None


def check_data_fits(obj) -> None:
    """Before launch: data.replay is a batch order that fits the run, and block_size fits the prepared corpus (when
    it is prepared already; otherwise preparing checks it, before step 0)."""
    d, T = obj.data, obj.model.block_size
    tokens, max_id = None, None
    try:
        import json
        manifest = dataset_dir(d, open_corpus(d)) / "manifest.json"
        if manifest.is_file():
            doc = json.loads(manifest.read_text())
            tokens = doc.get("tokens")
            max_id = doc.get("max_id")  # the largest token id of both splits
    except Exception:  # not prepared / not fetched yet: the job prepares and checks it
        tokens = None
    if isinstance(max_id, int) and obj.model.vocab_size <= max_id:
        raise _bad("model.vocab_size", obj.model.vocab_size,
                   f"an integer > {max_id}: the prepared corpus {d.corpus} holds token id {max_id} (50304 is GPT-2's "
                   "padded size)")
    if tokens:
        small = min(tokens.get("train", 0), tokens.get("val", 0))
        if T + 1 > small:
            raise _bad("model.block_size", T, f"at most {small - 1}: the prepared corpus {d.corpus} holds "
                                              f"{tokens.get('train')} train / {tokens.get('val')} val tokens and a "
                                              f"block needs block_size + 1 of them")
    if d.replay is not None and obj.from_checkpoint is None:
        path = Path(d.replay)
        if not path.is_file():
            raise _bad("data.replay", d.replay, "an existing batch-order file (a run's batch_order.bin)")
        try:
            h = read_header(path)
        except ValueError as e:
            raise ConfigError(f"data.replay={d.replay!r} is not allowed: {e}; expected a run's batch_order.bin") \
                from None
        t = obj.train
        diff = [f"{n}: file {a} vs run {b}" for n, a, b in (("block_size", h.block_size, T),
                                                             ("batch_size", h.batch_size, t.batch_size),
                                                             ("grad_accum", h.grad_accum, t.grad_accum)) if a != b]
        if tokens and h.n_tokens != tokens.get("train"):
            diff.append(f"corpus tokens: file {h.n_tokens} vs run {tokens.get('train')}")
        if diff:
            raise ConfigError(f"data.replay={d.replay!r} is not allowed: it was recorded for another run shape "
                              f"({'; '.join(diff)})")
        if tokens and h.n_tokens == tokens.get("train"):
            try:
                # checksum, offsets inside the corpus, length (or the seeded order past the end, checked)
                OrderReader(path, h, d.replay_past_end).check_covers(t.max_steps)
            except ValueError as e:
                raise ConfigError(str(e)) from None


KILL_WHERE = ("step_start", "step", "after_checkpoint", "checkpoint_write")


def apply_model_patch(obj) -> None:
    """The intervention's model patch, checked as intervention.model and applied: obj.model is then the model the
    job builds (and the one a fork or resume is checked against)."""

    patch = obj.intervention.model.set_fields()
    if not patch:
        return
    try:
        obj.model = effective_model(obj.model, obj.intervention).validate(key="model")
    except ValueError as e:
        raise ConfigError(f"{e} (set by intervention={obj.intervention.name}: intervention.model={patch})") from None


def check_hooks(iv, model) -> None:
    """Each train hook builds (its _target_ imports, its arguments fit) and accepts the model. No side effects:
    building a hook only stores its arguments; it touches a model only in attach()."""

    build_hooks(iv.hooks).check(model)


def check_debug(d, t) -> None:
    if d.kill_where not in KILL_WHERE:
        raise _bad("debug.kill_where", d.kill_where, "one of " + ", ".join(KILL_WHERE))
    for name in ("nan_at_step", "raise_at_step", "kill_at_step"):
        v = getattr(d, name)
        if v is not None:
            _int(f"debug.{name}", v, 0, t.max_steps - 1)


def check_capture_steps(c, t) -> None:
    """Every capture step is one the run trains (0-based, < train.max_steps): a later one would capture nothing."""
    late = [s for s in (c.steps or []) if isinstance(s, int) and s >= t.max_steps]
    if late:
        raise _bad("monitor.capture.steps", list(c.steps),
                   f"0-based steps the run trains, < train.max_steps={t.max_steps} (step {late[0]} is never run)")


def check_alarm_inputs(alarm, t) -> None:
    """A val_rise alarm reads the validation loss: with train.eval_every=0 it is computed only at the end."""
    if alarm.enabled and alarm.signal == "val_rise" and not t.eval_every:
        raise _bad("monitor.alarm.signal", alarm.signal,
                   f"a signal logged during training: val_rise needs train.eval_every > 0 (it is {t.eval_every}: the "
                   f"validation loss only at the end, so the alarm could never fire in time)")


def _validate(cfg, overrides: Sequence[str] = (), check_resume: bool = True, check_store: bool = True):
    """validate_config without the memo."""
    obj = to_object(cfg)
    for _section, fn in (("model", lambda: obj.model.validate(key="model")),
                        ("data", lambda: obj.data.validate(key="data")),
                        ("monitor", lambda: obj.monitor.validate(key="monitor", n_layer=obj.model.n_layer,
                                                                  n_head=obj.model.n_head,
                                                                  forking=obj.from_checkpoint is not None)),
                        ("verdict", lambda: obj.verdict.validate(key="verdict")),
                        ("tracking", lambda: obj.tracking.validate(key="tracking")),
                        ("optimizer", lambda: check_optimizer(obj.optimizer)),
                        ("train", lambda: check_train(obj.train)),
                        ("debug", lambda: check_debug(obj.debug, obj.train)),
                        ("monitor.capture", lambda: check_capture_steps(obj.monitor.capture, obj.train)),
                        ("monitor.alarm", lambda: check_alarm_inputs(obj.monitor.alarm, obj.train)),
                        ("intervention.model", lambda: apply_model_patch(obj)),
                        ("intervention", lambda: check_intervention(obj.intervention, obj.model)),
                        ("intervention.hooks", lambda: check_hooks(obj.intervention, obj.model)),
                        ("data", lambda: check_data_fits(obj)),
                        ("data.files", lambda: check_text_files(obj.data)),
                        ("train.max_steps", lambda: check_budget(obj))):
        try:
            fn()
        except ConfigError:
            raise
        except ValueError as e:  # the other modules' validate(): same message shape
            raise ConfigError(str(e)) from None
    names = selected_interventions(overrides)
    if len(names) > 1:
        check_combination(names, obj.intervention)
    check_user_overrides(obj.intervention, overrides, label="[" + ",".join(names) + "]" if len(names) > 1 else None)
    att = effective_attention(obj)
    try:
        att.validate(obj.model.n_head, key="attention", n_layer=obj.model.n_layer)
    except ValueError as e:
        raise ConfigError(f"{e} (attention with intervention={obj.intervention.name})") from None
    check_knob_combos(att, obj.model.n_layer)
    check_triton_device(att, obj.model.n_layer, obj.train.device)
    if obj.model.family != "gpt":  # a transformers family: every layer on the emulator (models/hf.py)
        try:
            check_attention(att, obj.model)
            check_job(obj)
        except ValueError as e:
            raise ConfigError(f"{e} (intervention={obj.intervention.name})") from None
    if check_resume and (obj.from_checkpoint is not None or obj.resume is not None):
        try:
            if obj.from_checkpoint is not None:
                check_fork(obj)  # resume + from_checkpoint, model, optimizer, step < max_steps, batch order
            else:  # the checkpoint's header (read once per process): the model and the train hooks against it
                header = source_header(obj.resume, key="resume")
                check_model(header, obj, key="resume", path=obj.resume)
                check_resume_hooks(header, obj, obj.resume)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if check_store:
        _check_store(obj.tracking)
    return obj, att


def _check_store(tracking) -> None:
    """The tracking store is reachable (once per URI and process)."""
    if tracking.uri in _STORES_CHECKED:
        return
    try:
        check_tracking(tracking.uri, timeout_s=tracking.check_timeout_s)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _STORES_CHECKED.add(tracking.uri)


# Validation runs once per job: the sweep callback checks every job before launch, and the job (in the same process
# with the basic launcher, or in a fresh one under submitit) asks again; the second ask gets the first answer.
_VALIDATED: Dict[tuple, tuple] = {}
_STORES_CHECKED: set = set()  # tracking stores reached in this process


def _memo_key(cfg, overrides: Sequence[str], check_resume: bool) -> Optional[tuple]:
    if not isinstance(cfg, DictConfig):
        return None
    node = cfg.copy()
    with _open(node):
        node.pop("hydra", None)
    return OmegaConf.to_yaml(node), tuple(overrides), check_resume


def validate_config(cfg, overrides: Sequence[str] = (), check_resume: bool = True,
                    check_store: bool = True):
    """Check a composed job config; return (Config object, effective AttentionConfig) or raise ConfigError.

    overrides: the job's task overrides (for contradictions with the intervention and for `intervention=[a,b]`).
    A config validated before in this process is not checked again (the answer is a fresh copy); a rejected one is
    checked every time. The tracking store is reached once per URI and process.
    """
    import copy

    key = _memo_key(cfg, overrides, check_resume)
    if key is not None and key in _VALIDATED:
        obj, att = copy.deepcopy(_VALIDATED[key])
        if check_store:
            _check_store(obj.tracking)
        return obj, att
    obj, att = _validate(cfg, overrides, check_resume, check_store)
    if key is not None:
        _VALIDATED[key] = copy.deepcopy((obj, att))
    return obj, att


__all__ = ["ConfigError", "validate_config", "effective_attention", "to_object", "selected_interventions",
           "check_combination", "check_user_overrides", "check_knob_combos"]
