"""Capture on the GPU, analyze on a laptop.

- `capture(out_dir, layers=..., heads=..., worst=..., sdpa=...)`: a context manager that writes each chosen attention
  call's q, k, v, o, lse and dO (with knobs, recipe, versions, commit) as one safetensors file (snapshot.py).
- `analyze(path)`: the offline analysis (analysis.py) as a dict; `flash-forensics analyze FILE` writes it as
  Markdown, HTML and JSON (cli.py, report.py).
"""
from __future__ import annotations

import importlib
import sys as _sys

_EXPORTS = {
    "capture": "flash_forensics.capture.recorder",
    "write_call": "flash_forensics.capture.recorder",
    "Recorder": "flash_forensics.capture.recorder",
    "wrapping_sdpa": "flash_forensics.capture.recorder",
    "analyze": "flash_forensics.capture.analysis",
    "read": "flash_forensics.capture.snapshot",
    "SnapshotError": "flash_forensics.capture.snapshot",
    "main": "flash_forensics.capture.cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flash_forensics.capture' has no attribute {name!r}")


class _CallableModule(type(importlib)):
    """`flash_forensics.capture(...)` is the context manager even after this package is imported (an import sets the
    parent's attribute `capture` to the package itself)."""

    def __call__(self, *args, **kwargs):
        return capture(*args, **kwargs)


from flash_forensics.capture.recorder import capture  # noqa: E402  (after the class: recorder needs nothing of it)

_sys.modules[__name__].__class__ = _CallableModule
