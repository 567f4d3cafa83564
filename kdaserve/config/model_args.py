"""The architecture fields of an HF `kimi_linear` or `kimi_k3` config.json, parsed once into a
dataclass.

One set of fields covers both families (one model definition): a Kimi K3 checkpoint
(`KimiK3ForConditionalGeneration`, model_type `kimi_k3`) keeps its text model in `text_config`
(a Kimi-Linear config with the K3 fields set), and a Kimi-Linear config may carry any K3 field.
The K3 pieces: the KDA full-rank output gate and gate lower bound, MLA q-LoRA and output gate,
AttnRes (attention over depth instead of the residual stream), SiTU activations, the latent MoE,
MXFP4 routed experts (compressed-tensors `mxfp4-pack-quantized`), MTP layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KimiLinearArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    """Per layer (0-based): "linear_attention" (KDA) or "full_attention" (MLA)."""
    mlp_layer_types: list[str]
    """Per layer: "dense" or "sparse" (MoE)."""
    # KDA
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    gate_lower_bound: float | None = None
    """g = lb * sigmoid(A * (raw + dt_bias)) when set (in [-5, 0)); else -A * softplus(...)."""
    kda_full_rank_gate: bool = False
    """linear_attn_config.use_full_rank_gate: the output gate is one H -> P projection (g_proj,
    fused into the input projection) instead of the low-rank g_a_proj / g_b_proj pair."""
    # MLA
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    """The attention output is multiplied by sigmoid(g_proj(x)) ([H * v_head_dim]) before
    o_proj."""
    rope_theta: float = 10000.0
    # MLP / MoE
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 2.446
    num_expert_group: int = 1
    topk_group: int = 1
    hidden_act: str = "silu"
    """silu or situ (gated activation of the dense MLP, the shared and the routed experts)."""
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    routed_expert_hidden_size: int | None = None
    """Latent MoE when set: routed experts run in this width between routed_expert_down_proj
    and routed_expert_up_proj (the router and the shared experts read the hidden state)."""
    latent_moe_use_norm: bool = False
    """RMSNorm of the latent (routed_expert_norm) before the up projection."""
    expert_quantization: str | None = None
    """None (experts in the model dtype) or "mxfp4" (routed experts as E2M1 values with E8M0
    scales per 32 along K; everything else stays in the model dtype)."""
    # Depth and extra layers
    attn_res_block_size: int | None = None
    """AttnRes when set: each sublayer reads a softmax mixture over the finished blocks of
    this many layers (block 0 = the embedding) and the running sum of the current block."""
    num_nextn_predict_layers: int = 0
    """MTP layers after the last layer in the checkpoint (model.layers.{num_hidden_layers + i})."""
    has_vision: bool = False
    """The checkpoint has a vision tower (kimi_k3): only its text model is served."""
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    model_type: str = "kimi_linear"

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def kda_proj_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_input_size(self) -> int:
        """Width the routed experts read and write (the latent, or the hidden size)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        """Blocks of the AttnRes depth memory: cdiv(num_hidden_layers, attn_res_block_size)."""
        b = self.attn_res_block_size
        return -(-self.num_hidden_layers // b) if b else 0

    @property
    def kv_cache_dim(self) -> int:
        """Values per token per MLA layer in the latent cache: [c | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "KimiLinearArgs":
        """Parse a config.json: `kimi_linear`, or `kimi_k3` whose text model is its
        `text_config` (the top level supplies what the text config lacks: token ids,
        quantization_config)."""
        model_type = cfg.get("model_type")
        if model_type not in ("kimi_linear", "kimi_k3"):
            raise ValueError(f"unsupported model_type {model_type!r} (expected 'kimi_linear' "
                             "or 'kimi_k3')")
        has_vision = bool(cfg.get("vision_config"))
        if "text_config" in cfg:
            text = dict(cfg["text_config"] or {})
            for key, value in cfg.items():
                if key not in ("text_config", "vision_config", "architectures", "model_type",
                               "auto_map") and text.get(key) is None:
                    text[key] = value
            cfg = text
        n = int(cfg["num_hidden_layers"])
        lac = cfg.get("linear_attn_config") or {}
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            if "kda_layers" in lac and "full_attn_layers" in lac:
                layer_types = [None] * n
                for i in lac["full_attn_layers"]:  # 1-based in the checkpoint
                    layer_types[i - 1] = "full_attention"
                for i in lac["kda_layers"]:
                    layer_types[i - 1] = "linear_attention"
                if None in layer_types:
                    raise ValueError(
                        f"linear_attn_config leaves layer {layer_types.index(None) + 1} "
                        "(1-based) neither KDA nor full attention")
            else:
                layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                               for i in range(n)]
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
        mlp_layer_types = cfg.get("mlp_layer_types")
        if mlp_layer_types is None:
            k = int(cfg.get("first_k_dense_replace", 1))
            freq = int(cfg.get("moe_layer_freq", 1) or 1)
            mlp_layer_types = ["dense" if i < k or (i - k) % freq else "sparse" for i in range(n)]
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

        def get(*names, default=None):
            for name in names:
                if name in cfg and cfg[name] is not None:
                    return cfg[name]
            return default

        def opt(name, cast):
            return None if cfg.get(name) is None else cast(cfg[name])

        args = cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n,
            layer_types=list(layer_types),
            mlp_layer_types=list(mlp_layer_types),
            linear_num_heads=int(lac.get("num_heads", get("linear_num_heads", default=32))),
            linear_head_dim=int(lac.get("head_dim", get("linear_head_dim", default=128))),
            linear_conv_kernel_dim=int(
                lac.get("short_conv_kernel_size", get("linear_conv_kernel_dim", default=4))),
            gate_lower_bound=lac.get("gate_lower_bound", cfg.get("gate_lower_bound")),
            kda_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            num_attention_heads=int(cfg.get("num_attention_heads", 32)),
            q_lora_rank=opt("q_lora_rank", int),
            kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
            v_head_dim=int(get("v_head_dim", default=128)),
            mla_use_nope=bool(cfg.get("mla_use_nope", True)),
            mla_use_output_gate=bool(cfg.get("mla_use_output_gate", False)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            intermediate_size=int(cfg.get("intermediate_size", 9216)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1024)),
            num_experts=int(get("num_experts", "num_local_experts", "n_routed_experts",
                                default=256)),
            num_experts_per_token=int(get("num_experts_per_token", "num_experts_per_tok",
                                          default=8)),
            num_shared_experts=int(get("num_shared_experts", "n_shared_experts", default=1)),
            moe_renormalize=bool(get("moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_expert_group=int(get("num_expert_group", "n_group", default=1)),
            topk_group=int(get("topk_group", default=1)),
            hidden_act=cfg.get("hidden_act", "silu"),
            activation_situ_beta=opt("activation_situ_beta", float),
            activation_situ_linear_beta=opt("activation_situ_linear_beta", float),
            routed_expert_hidden_size=opt("routed_expert_hidden_size", int),
            latent_moe_use_norm=bool(cfg.get("latent_moe_use_norm", False)),
            expert_quantization=expert_quantization(cfg.get("quantization_config")),
            attn_res_block_size=opt("attn_res_block_size", int),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            has_vision=has_vision,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("model_max_length", "max_position_embeddings",
                                            default=1048576)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
            pad_token_id=cfg.get("pad_token_id"),
            model_type=model_type,
        )
        if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError(f"moe_router_activation_func="
                             f"{cfg['moe_router_activation_func']!r}: only sigmoid is supported")
        if cfg.get("topk_method", "noaux_tc") not in ("noaux_tc", None):
            raise ValueError(f"topk_method={cfg['topk_method']!r}: only noaux_tc is supported")
        args.validate()
        return args

    def validate(self) -> None:
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope=false (RoPE in MLA) is not supported")
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act={self.hidden_act!r}: only silu and situ are supported")
        if self.hidden_act == "situ" and self.activation_situ_beta is None:
            raise ValueError("hidden_act=situ needs activation_situ_beta")
        if self.gate_lower_bound is not None and not -5.0 <= self.gate_lower_bound < 0.0:
            raise ValueError(f"gate_lower_bound={self.gate_lower_bound} outside [-5, 0)")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(f"attn_res_block_size={self.attn_res_block_size} must be >= 1")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ValueError(
                f"grouped top-k with num_expert_group={self.num_expert_group}, "
                f"topk_group={self.topk_group} is not supported (only 1/1)")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"num_experts_per_token={self.num_experts_per_token} > "
                f"num_experts={self.num_experts}")
        if self.expert_quantization == "mxfp4":
            for name, k in (("the experts' input width", self.expert_input_size),
                            ("moe_intermediate_size", self.moe_intermediate_size)):
                if k % MXFP4_BLOCK:
                    raise ValueError(f"MXFP4 experts need {name} ({k}) to be a multiple of "
                                     f"{MXFP4_BLOCK} (one E8M0 scale per {MXFP4_BLOCK} values)")


MXFP4_BLOCK = 32
"""Values per E8M0 scale along K in MXFP4 (OCP MX)."""
MXFP4_FORMAT = "mxfp4-pack-quantized"
"""compressed-tensors' format name of packed MXFP4 weights (`weight_packed`, `weight_scale`)."""


def expert_quantization(qc: dict[str, Any] | None) -> str | None:
    """config.json `quantization_config` -> None or "mxfp4". Accepts vLLM's `quant_method:
    mxfp4` and compressed-tensors with format `mxfp4-pack-quantized` (at the top or in a
    config group); anything else is refused, since only routed experts in MXFP4 are served."""
    if not qc:
        return None
    method = qc.get("quant_method")
    formats = {qc.get("format")} | {g.get("format") for g in
                                    (qc.get("config_groups") or {}).values()
                                    if isinstance(g, dict)}
    if method == "mxfp4" or (method == "compressed-tensors" and MXFP4_FORMAT in formats):
        return "mxfp4"
    raise ValueError(f"unsupported quantization_config (quant_method={method!r}, formats "
                     f"{sorted(f for f in formats if f)}): only MXFP4 routed experts "
                     f"(compressed-tensors {MXFP4_FORMAT!r}) are supported")
