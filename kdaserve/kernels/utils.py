"""Small helpers shared by the Triton kernel wrappers (no triton import at module level)."""

from __future__ import annotations

import functools
import os

import torch


def triton_interpret() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1): kernels take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def require_triton() -> None:
    """Raise a clear error when a Triton kernel is called where triton is not installed."""
    if not has_triton():
        raise ImportError("this kernel needs the 'triton' package (pip install triton); "
                          "use kdaserve.kernels.reference for the CPU path")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device; 132 (the Hopper SXM parts the kernels are tuned on)
    for CPU tensors (interpreter)."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_kernel_device(t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and triton_interpret():
        return
    raise ValueError(f"Triton kernels need CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 "
                     "to run them on CPU tensors through the interpreter")


def pdl_options(pdl: bool, t: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a `USE_PDL` constexpr: programmatic dependent launch
    on when asked for and `t` is a CUDA tensor (the interpreter cannot run the PTX)."""
    if pdl and t.is_cuda:
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
