"""The byte floor of a decode step, tracked by the engine for the /metrics floor-ratio gauge.

floor = (non-expert weights + expert weights the batch touches + MLA latent KV of every request
+ every KDA state read and written) / copy bandwidth. The engine does not read the routing back
(that would cost a host sync per layer), so the experts touched are the expectation under
uniform routing, E * (1 - (1 - k/E)^B), per MoE layer; `kdaserve bench roofline` counts the
experts actually touched.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from kdaserve.config.model_args import KimiLinearArgs


def measure_copy_bandwidth(device, nbytes: int | None = None) -> float:
    """Device-to-device copy of `nbytes` (default 1 GiB on CUDA: smaller copies read low),
    counting bytes read + written; median of 10."""
    import torch

    n = nbytes or (2**30 if device.type == "cuda" else 2**26)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for i in range(13):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 2 * n / statistics.median(times)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


EXPERT_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_packed",
                   "experts.gate_up_proj_scale", "experts.down_proj_packed",
                   "experts.down_proj_scale")
"""The routed experts' tensors: model dtype, or MXFP4 values + E8M0 scales (uint8 buffers:
4.25 bits per weight, what the MXFP4 MoE reads)."""


def weight_bytes(model) -> tuple[int, int, int]:
    """(non-expert weight bytes read per step, routed-expert bytes per expert per MoE layer,
    number of MoE layers). The embedding is excluded (one row per token is read); MXFP4
    experts count their packed values and scales."""
    dense, experts, moe_layers, num_experts = 0, 0, 0, 0
    seen = set()
    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith(EXPERT_SUFFIXES)]
    for name, p in tensors:
        key = (p.data_ptr(), p.numel())
        if "embed_tokens" in name or key in seen:
            continue
        seen.add(key)
        size = p.numel() * p.element_size()
        if name.endswith(EXPERT_SUFFIXES):
            if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_packed")):
                moe_layers += 1
                num_experts = p.shape[0]
            experts += size
        else:
            dense += size
    per_expert = experts // max(1, moe_layers * num_experts)
    return dense, per_expert, moe_layers


@dataclass
class StepFloor:
    dense_bytes: int
    per_expert_bytes: int
    moe_layers: int
    kv_bytes_per_token: int
    state_bytes_per_slot: int
    num_experts: int
    top_k: int
    bandwidth: float

    @classmethod
    def for_model(cls, model, args: KimiLinearArgs, kv_elt: int, state_bytes_per_slot: int,
                  bandwidth: float) -> "StepFloor":
        dense, per_expert, moe_layers = weight_bytes(model)
        return cls(dense, per_expert, moe_layers,
                   args.kv_cache_dim * kv_elt * len(args.mla_layer_ids), state_bytes_per_slot,
                   args.num_experts, args.num_experts_per_token, bandwidth)

    def seconds(self, batch: int, context_tokens: int) -> float:
        """Floor of a decode step of `batch` requests holding `context_tokens` in total."""
        touched = self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** batch)
        total = (self.dense_bytes + touched * self.per_expert_bytes * self.moe_layers
                 + context_tokens * self.kv_bytes_per_token
                 + 2 * batch * self.state_bytes_per_slot)
        return total / self.bandwidth
