"""Kernel backends per layer kind, chosen once at start-up from the kernel config and the device.

Each layer kind has a small registry: the names of its backends and what each runs. The worker
calls `select_backends` once; the model hands the result to its layers when it builds them, and
nothing changes it afterwards. How a given step runs (eager or inside a graph, with PDL or not,
decode-only or not) is the step plan's business (attention/forward_context.py), not a backend's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.config import KernelConfig

LINEAR_BACKENDS = {
    "torch": "F.linear (cuBLAS on CUDA)",
    "gemv": "the Triton GEMV for inputs of 1..GEMV_MAX_ROWS rows, F.linear beyond",
    "gemv_skinny": "the Triton GEMV for 1..GEMV_MAX_ROWS rows, the Triton skinny GEMM (tensor "
                   "cores, each weight read once) up to 64 rows of 16-bit weights, F.linear "
                   "beyond",
}
DENSE_MLP_BACKENDS = {
    "torch": "gate, up and down projections, silu and mul",
    "gemv_swiglu": "1..GEMV_MAX_ROWS rows: a gate|up GEMV, then the down GEMV reading "
                   "silu(gate) * up (or Kimi K3's SiTU) in its K loop",
}
KDA_BACKENDS = {
    "reference": "the plain-PyTorch twins (CPU)",
    "fla": "fla-core chunk_kda for prefill chunks, its fused recurrent kernel for decodes",
    "fla_fused_decode": "fla, and decode-only steps as one Triton launch per layer (conv, gates, "
                        "delta rule, gated norm)",
}
MLA_BACKENDS = {
    "reference": "the plain-PyTorch twins (CPU)",
    "triton": "the Triton paged decode kernel; W_UK / W_UV products by einsum (cuBLAS)",
    "triton_absorb_gemv": "the Triton decode kernel with its first cache tile read before the "
                          "PDL wait; W_UK / W_UV of 1..GEMV_MAX_ROWS rows as batched GEMVs",
}
MOE_BACKENDS = {
    "reference": "the plain-PyTorch twins (CPU)",
    "triton": "the fused Triton MoE (shared expert folded in as one more expert), the Triton "
              "sigmoid top-k",
}
LATENT_MOE_BACKENDS = {
    "reference": "the plain-PyTorch twins (CPU): experts, top-k sum, latent norm, up projection",
    "unfused": "the routed experts (the fused Triton MoE for model-dtype SwiGLU experts, else "
               "the twins), then the top-k sum, the latent norm and the up projection as "
               "separate ops (the baseline of fused_tail)",
    "fused_tail": "the Triton latent-MoE kernels (kernels/moe/mxfp4_moe.py): MXFP4 or bf16 "
                  "expert weights read directly, per-entry expert outputs, the top-k weighted "
                  "sum fused into the latent norm + up projection (one tail launch)",
}
ATTN_RES_BACKENDS = {
    "reference": "the plain-PyTorch twin (about 25 torch ops a read)",
    "triton": "one Triton launch a read (kernels/attn_res): prefix add, block write, depth "
              "softmax over the RMS-normed sources, weighted sum, the sublayer's input norm",
}
GATED_ACT_BACKENDS = {
    "reference": "SiTU MLPs as gate, up and down projections and the twin's torch ops",
    "triton": "SiTU MLPs as the merged gate|up projection, one SiTU launch "
              "(kernels/activation) and the down projection",
}
K3_GATES_BACKENDS = {
    "reference": "the plain-PyTorch twins",
    "triton": "one launch each (kernels/activation, kernels/kda/gate.py): MLA's sigmoid output "
              "gate in place, KDA's bounded decay gate together with beta",
}
SAMPLER_BACKENDS = {
    "sort": "top-k / top-p by a full sort of each row",
    "threshold": "top-k / top-p by the sort-free threshold search (CUDA)",
}


@dataclass(frozen=True)
class LayerBackends:
    """The backend name of each layer kind (keys of the registries above). The default is the
    CPU reference set."""

    linear: str = "torch"
    dense_mlp: str = "torch"
    kda: str = "reference"
    kda_state_prefetch: bool = False
    """fla_fused_decode under PDL: the kernel reads its states before its PDL wait."""
    mla: str = "reference"
    mla_verify_fold: bool = False
    """MLA's absorbed verify rows through the fold kernel where windows are uniform."""
    moe: str = "reference"
    moe_tma_weights: bool = False
    """The fused MoE's wgmma tiles read the expert weights by TMA (KernelConfig)."""
    latent_moe: str = "reference"
    attn_res: str = "reference"
    gated_act: str = "reference"
    k3_gates: str = "reference"
    sampler: str = "sort"
    router_partials: bool = False
    """The MoE router's fp32 logits of 3-64 rows as K-split partials on the CUDA cores summed
    by the top-k kernel (kernels/moe/router.py router_partials) instead of cuBLAS."""
    race_sampler: bool = False
    """The sampler's draw (and the synthetic rejection sampler's) as the fused exponential race
    (kernels/sample/race.py) instead of softmax, noise and argmax over the vocabulary."""

    def __post_init__(self) -> None:
        for kind, registry in (("linear", LINEAR_BACKENDS), ("dense_mlp", DENSE_MLP_BACKENDS),
                               ("kda", KDA_BACKENDS), ("mla", MLA_BACKENDS),
                               ("moe", MOE_BACKENDS), ("latent_moe", LATENT_MOE_BACKENDS),
                               ("attn_res", ATTN_RES_BACKENDS),
                               ("gated_act", GATED_ACT_BACKENDS),
                               ("k3_gates", K3_GATES_BACKENDS),
                               ("sampler", SAMPLER_BACKENDS)):
            if getattr(self, kind) not in registry:
                raise ValueError(f"unknown {kind} backend {getattr(self, kind)!r}; known: "
                                 f"{sorted(registry)}")
        if self.dense_mlp == "gemv_swiglu" and not self.gemv:
            raise ValueError("dense_mlp backend gemv_swiglu needs linear backend gemv or "
                             "gemv_skinny")

    @property
    def gemv(self) -> bool:
        return self.linear in ("gemv", "gemv_skinny")

    @property
    def skinny(self) -> bool:
        return self.linear == "gemv_skinny"


def select_backends(kc: KernelConfig, device: torch.device | str) -> LayerBackends:
    """The backends for `device` under kernel config `kc` (CPU: the reference set whatever kc
    says; the kernel switches apply to CUDA only)."""
    if torch.device(device).type != "cuda":
        return LayerBackends()
    linear = ("torch" if not kc.decode_gemv else "gemv_skinny" if kc.skinny_gemm
              else "gemv")
    return LayerBackends(
        linear=linear,
        dense_mlp="gemv_swiglu" if kc.decode_gemv and kc.dense_mlp_gemv else "torch",
        kda="fla_fused_decode" if kc.fused_kda_decode else "fla",
        kda_state_prefetch=kc.fused_kda_decode and kc.kda_state_prefetch,
        mla="triton_absorb_gemv" if kc.mla_absorb_gemv else "triton",
        mla_verify_fold=kc.mla_verify_fold,
        moe="triton",
        moe_tma_weights=kc.moe_tma_weights,
        latent_moe="fused_tail" if kc.latent_moe_fused_tail else "unfused",
        attn_res="triton" if kc.k3_fused_ops else "reference",
        gated_act="triton" if kc.k3_fused_ops else "reference",
        k3_gates="triton" if kc.k3_fused_ops else "reference",
        sampler="threshold" if kc.sampling_threshold_kernel else "sort",
        router_partials=kc.router_partials,
        race_sampler=kc.sampling_race_kernel)
