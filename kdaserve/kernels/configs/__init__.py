"""Measured kernel configs as data, one JSON file per kernel and device (as vLLM's
fused_moe/configs/).

`{kernel}_device_name={name}.json` (name: torch.cuda.get_device_name() with spaces as
underscores) maps a shape key such as "M=1,N=2304,K=4096,dtype=bfloat16" (shape_key) to the
fields of the kernel's config: the fastest of a benchmark sweep at that shape on that device
(benchmarks/PERF_NOTES.md has the sweeps and their figures). A device without a file of its own
reads `{kernel}_sms={count}.json`, the configs for its SM count (the tiles set the grid's waves
per SM); CPU tensors (the Triton interpreter) count as kdaserve.kernels.utils.num_sms says. No
file: {} (the kernel's own guess applies). Files are read once per process.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent


def shape_key(**dims) -> str:
    """"M=1,N=2304,K=4096,dtype=bfloat16" from M=1, N=2304, K=4096, dtype=torch.bfloat16 (the
    order given; dtypes without the "torch." prefix)."""
    def text(v) -> str:
        return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v)
    return ",".join(f"{k}={text(v)}" for k, v in dims.items())


def config_file_name(kernel: str, device_name: str) -> str:
    return f"{kernel}_device_name={device_name.replace(' ', '_')}.json"


@functools.cache
def _read(file_name: str) -> dict[str, dict]:
    path = CONFIG_DIR / file_name
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def load_configs(kernel: str, device_name: str | None, sms: int) -> dict[str, dict]:
    """shape key -> config fields for `kernel` on the device named `device_name` (None: not a
    CUDA device) with `sms` SMs: its own file, else the file for its SM count, else {}."""
    if device_name is not None:
        own = _read(config_file_name(kernel, device_name))
        if own:
            return own
    return _read(f"{kernel}_sms={sms}.json")


@functools.cache
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | None) -> str | None:
    """torch.cuda.get_device_name of a CUDA device (cached); None for anything else."""
    if device is None or device.type != "cuda":
        return None
    return _cuda_device_name(device.index if device.index is not None
                             else torch.cuda.current_device())
