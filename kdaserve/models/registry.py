"""HF "architectures" -> model class, and construction without a wasted init pass."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.config import KernelConfig
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.distributed.comm import GroupComm
from kdaserve.layers.backends import LayerBackends, select_backends
from kdaserve.models.kimi_linear import KimiLinearForCausalLM

_ARCHITECTURES = {
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    # Kimi K3: its text model is a KimiLinearForCausalLM with the K3 fields set (the vision
    # tower is not served; the loader skips its tensors).
    "KimiK3ForConditionalGeneration": KimiLinearForCausalLM,
}


def resolve_architecture(hf_config: dict) -> type[nn.Module]:
    archs = hf_config.get("architectures") or ["KimiLinearForCausalLM"]
    for name in archs:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(f"unsupported architectures {archs}; supported: {sorted(_ARCHITECTURES)}")


def build_model(args: KimiLinearArgs, dtype: torch.dtype, device: torch.device | str,
                cls: type[nn.Module] = KimiLinearForCausalLM,
                backends: LayerBackends | None = None, tp: GroupComm | None = None) -> nn.Module:
    """Build on the meta device, then allocate uninitialised storage on `device`: parameters
    declared fp32 (router, gate biases) stay fp32, the rest take `dtype`. The loader fills them.
    backends: the layers' kernel backends (default: the baseline set for `device`). tp: the
    tensor-parallel group the model is split over (None: not split; cls must take it)."""
    if backends is None:
        backends = select_backends(KernelConfig.baseline(), device)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(args, backends) if tp is None else cls(args, backends, tp)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    return model.eval().requires_grad_(False)
