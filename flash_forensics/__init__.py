"""flash-forensics for your own training code: the public API (names users' scripts call; internals move freely).

- `attention(q, k, v, ...)`: a drop-in for `torch.nn.functional.scaled_dot_product_attention` with an explicit
  precision recipe; `patch_sdpa(...)` routes unchanged SDPA code through it.
- `import flash_forensics` registers `attn_implementation="forensics"` with transformers (when installed; not
  "flash_forensics": transformers takes every name containing "flash" for a flash-attn kernel to load);
  `use(model, recipe=..., overrides=...)` sets the recipe and knobs per layer and head.
- `Monitor` (your own loop) and `TrainerCallback` (transformers' Trainer): repeated maxima, max logit, entropy,
  W_Q's spectral norm per head.
- `capture(...)`: one attention call's q, k, v, o, lse and dO as a self-describing safetensors file;
  `analyze(path)`: the offline report (ties, delta error, attribution per rounding point, the kernel's fingerprint).

The project's own packages stand at the repository's top level (kernels/, models/, orchestrator/), where a reader
finds them, and are imported as `flash_forensics.kernels`, `flash_forensics.models`, `flash_forensics.orchestrator`:
top-level names such as `kernels` (the package `transformers[kernels]` installs) and `models` belong to others. In a
checkout flash_forensics/kernels etc. are symbolic links to those folders, so the import name is a path that Python,
an editor's go-to-definition and an import-graph tool all follow (tests/unit/test_packaging.py asks jedi); an
installed wheel has the folders inside it (pyproject's package-dir).
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys

# public name -> the module that defines it; imported on first use so `import flash_forensics` stays light
_EXPORTS = {
    "attention": "flash_forensics.sdpa",
    "patch_sdpa": "flash_forensics.sdpa",
    "use": "flash_forensics.hf_backend",
    "Monitor": "flash_forensics.monitor",
    "TrainerCallback": "flash_forensics.trainer_callback",
    "capture": "flash_forensics.capture",
    "analyze": "flash_forensics.capture",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flash_forensics' has no attribute {name!r}")


# ------------------------------------------------------------------------------ transformers registration
# `attn_implementation="forensics"` is registered with transformers' AttentionInterface (in
# transformers.modeling_utils) and AttentionMaskInterface (transformers.masking_utils). Importing those costs seconds
# (`import transformers` alone ~1 s on this project's CPU machine), which internal imports (`flash_forensics.kernels`)
# must not pay: each table is registered right away when its module is loaded already, else right after it loads
# (a sys.meta_path finder that wraps that one module's loader and removes itself when done).
_HF_TABLES = {"transformers.modeling_utils": "register_attention", "transformers.masking_utils": "register_mask"}


def _register(module_name: str, module) -> None:
    from flash_forensics import hf_backend  # lazy: it builds on transformers, an optional import (see above)

    getattr(hf_backend, _HF_TABLES[module_name])(module)


class _AfterLoad(importlib.abc.Loader):
    """A module's own loader, then the registration that needs the module."""

    def __init__(self, inner, name: str):
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _register(self._name, module)

    def __getattr__(self, attr):  # get_source, is_package, ...: the real loader's
        return getattr(self._inner, attr)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.pending = set(names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterLoad(spec.loader, fullname)
                return spec
        return None


def _install_registration() -> None:
    waiting = []
    for name in _HF_TABLES:
        if name in sys.modules:
            _register(name, sys.modules[name])
        else:
            waiting.append(name)
    if waiting and not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport(waiting))


try:
    import importlib.util as _util
    _HAS_TRANSFORMERS = _util.find_spec("transformers") is not None
except (ImportError, ValueError):
    _HAS_TRANSFORMERS = False
if _HAS_TRANSFORMERS:
    _install_registration()
