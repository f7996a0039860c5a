"""flash-forensics for your own training code: the public API (names users' scripts call; internals move freely).

- `attention(q, k, v, ...)`: a drop-in for `torch.nn.functional.scaled_dot_product_attention` with an explicit
  precision recipe; `patch_sdpa(...)` routes unchanged SDPA code through it.
- `import flash_forensics` registers `attn_implementation="flash_forensics"` with transformers (when installed);
  `use(model, recipe=..., overrides=...)` sets the recipe and knobs per layer and head.
- `Monitor` (your own loop) and `TrainerCallback` (transformers' Trainer): repeated maxima, max logit, entropy,
  W_Q's spectral norm per head.
- `capture(...)`: one attention call's q, k, v, o, lse and dO as a self-describing safetensors file;
  `analyze(path)`: the offline report (ties, delta error, attribution per rounding point, the kernel's fingerprint).

The project's own packages stand at the repository's top level (kernels/, models/, orchestrator/), where a reader
finds them, and are imported as `flash_forensics.kernels`, `flash_forensics.models`, `flash_forensics.orchestrator`:
top-level names such as `kernels` (the package `transformers[kernels]` installs) and `models` belong to others.
"""
from __future__ import annotations

import importlib
from pathlib import Path

# From a checkout (editable install, or the repo root on sys.path) the three packages are folders beside this one;
# an installed wheel has them inside it (pyproject's package-dir). Only a checkout of this project is added.
_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "orchestrator").is_dir() and (_ROOT / "kernels").is_dir() and (_ROOT / "run.py").is_file():
    __path__.append(str(_ROOT))  # noqa: F821  (a package's __path__)

# public name -> the module that defines it; imported on first use so `import flash_forensics` stays light
_EXPORTS = {
    "attention": "flash_forensics.sdpa",
    "patch_sdpa": "flash_forensics.sdpa",
    "use": "flash_forensics.hf_backend",
    "Monitor": "flash_forensics.monitor",
    "TrainerCallback": "flash_forensics.monitor",
    "capture": "flash_forensics.capture",
    "analyze": "flash_forensics.capture",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flash_forensics' has no attribute {name!r}")
