"""What a benchmark's JSON says of where it ran: its command, the GPU and the versions (one module, imported by
every benchmark, so that none imports another for it)."""
from __future__ import annotations

import json
import os
import platform
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment(argv, script: str) -> dict:
    """script: the benchmark's file (its command is `python <script relative to the root> <argv>`)."""
    import triton
    return dict(command="python " + " ".join([os.path.relpath(os.path.abspath(script), ROOT)] + list(argv)),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
                time=time.strftime("%Y-%m-%dT%H:%M:%S"))


def write_json(out: dict, path: str, indent: int = 1) -> None:
    """The benchmark's JSON at path (its folder made), and a line saying where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=indent)
    print(f"wrote {path}")
