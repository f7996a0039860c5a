"""Triton's interpreter (TRITON_INTERPRET=1), without its redundant re-patching of triton.language at every device
function call: the interpreter checks of tests/unit (test_triton, test_triton_stabilizers, test_ops,
test_rounding_points) run in child pytests where tests/conftest.py installs this.

A kernel launch (GridExecutor.__call__) patches the triton.language modules its kernel's globals name (tl, tl.core)
for the launch and restores them after. Each call of a @triton.jit helper inside the kernel
(InterpretedFunction.__call__) patches them again, and never restores: inspect.getmembers over tl, tl.tensor and
tl.math per call, a fifth of the interpreter's time on these kernels (their helpers are called per key tile). When
the launch already patched every language module the helper's globals name, the builtins are already replaced (a
patched member is no longer a builtin, so the helper's patch skips them) and the rest is set again to closures that
do the same; skipping that call's patch changes nothing the helper computes. A helper whose module names a language
module the launch did not patch is patched as before. Only the patching is skipped: the helper runs, and raises, as
the interpreter runs it.
"""
from __future__ import annotations

import inspect


def skip_nested_lang_patches() -> bool:
    """Install the skip (once); False, changing nothing, where this Triton's interpreter lacks what it wraps."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    grid, fn_cls = getattr(ti, "GridExecutor", None), getattr(ti, "InterpretedFunction", None)
    if grid is None or fn_cls is None or not hasattr(fn_cls, "rewrite") or not hasattr(ti, "InterpreterError"):
        return False
    if getattr(fn_cls.__call__, "_ff_skips_nested_patch", False):
        return True
    grid_call, fn_call = grid.__call__, fn_cls.__call__
    patched = []  # the language modules (ids) each running launch patched, innermost last
    langs_of = {}

    def langs(fn) -> frozenset:
        key = id(fn)
        if key not in langs_of:  # as _patch_lang picks them
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in [tl, tl.core])
        return langs_of[key]

    def launch(self, *args, **kwargs):
        patched.append(langs(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call(self, *args, **kwargs):
        if not patched or not langs(self.fn) <= patched[-1]:
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()  # fn_call's body, less its _patch_lang(self.fn)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    device_call._ff_skips_nested_patch = True
    grid.__call__, fn_cls.__call__ = launch, device_call
    return True
