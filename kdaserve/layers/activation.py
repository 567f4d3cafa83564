"""The gated activation of MLPs and experts, chosen once from the config (hidden_act)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.kernels import reference as ref


@dataclass(frozen=True)
class GatedAct:
    """act(gate, up) -> [.., I]: silu(gate) * up (SwiGLU), or Kimi K3's SiTU with its two
    clipping constants (kernels/reference.py situ_and_mul)."""

    name: str = "silu"
    beta: float | None = None
    linear_beta: float | None = None

    def __post_init__(self) -> None:
        if self.name not in ("silu", "situ"):
            raise ValueError(f"unknown activation {self.name!r}; known: silu, situ")
        if self.name == "situ" and self.beta is None:
            raise ValueError("situ needs beta")

    @property
    def is_silu(self) -> bool:
        """The fused kernels (MoE, SwiGLU GEMV) implement silu only."""
        return self.name == "silu"

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return ref.silu_and_mul(gate, up)
        return ref.situ_and_mul(gate, up, self.beta, self.linear_beta)


SILU = GatedAct()


def gated_act(args: KimiLinearArgs) -> GatedAct:
    return GatedAct(args.hidden_act, args.activation_situ_beta, args.activation_situ_linear_beta)
