"""The few value checks every config section shares, so each message reads `key=value is not allowed: expected ...`.

Plain Python (no torch, omegaconf or hydra): kernels/, models/ and orchestrator/ all import it. `error` lets a caller
raise its own ValueError subclass (flash_forensics.orchestrator.config.validate.ConfigError).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Type


def bad(key: str, value, allowed: str, error: Type[ValueError] = ValueError) -> ValueError:
    """The error for `key=value` with what is allowed; the caller raises it."""
    return error(f"{key}={value!r} is not allowed: expected {allowed}")


def is_int(value, low: Optional[int] = None, high: Optional[int] = None) -> bool:
    """An int (never a bool: True is an int to Python, not to a config) within [low, high] where given."""
    return (not isinstance(value, bool) and isinstance(value, int)
            and (low is None or value >= low) and (high is None or value <= high))


def is_num(value, low: Optional[float] = None, strict: bool = True) -> bool:
    """An int or float (never a bool), > low (strict) or >= low where given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return low is None or (value > low if strict else value >= low)


def int_range(low: int, high: Optional[int] = None) -> str:
    """What `is_int(value, low, high)` allows, in words."""
    return f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")


def file_in_the_way(path) -> Optional[Path]:
    """The nearest existing parent of an output file's path when it is a file (mkdir would fail there, after the
    work), else None: the CLIs check their --out with it before any work."""
    under = next((q for q in Path(path).parents if q.exists()), None)
    return under if under is not None and not under.is_dir() else None


__all__ = ["bad", "is_int", "is_num", "int_range", "file_in_the_way"]
