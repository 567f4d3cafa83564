"""The architecture fields of an HF `kimi_linear` config.json, parsed once into a dataclass."""

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
    # MLA
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
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
    def kv_cache_dim(self) -> int:
        """Values per token per MLA layer in the latent cache: [c | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "KimiLinearArgs":
        model_type = cfg.get("model_type")
        if model_type not in ("kimi_linear", "kimi_k3"):
            raise ValueError(f"unsupported model_type {model_type!r} (expected 'kimi_linear')")
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
            num_attention_heads=int(cfg.get("num_attention_heads", 32)),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
            v_head_dim=int(get("v_head_dim", default=128)),
            mla_use_nope=bool(cfg.get("mla_use_nope", True)),
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
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("model_max_length", "max_position_embeddings",
                                            default=1048576)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
            pad_token_id=cfg.get("pad_token_id"),
            model_type=model_type,
        )
        args.validate()
        return args

    def validate(self) -> None:
        if self.q_lora_rank is not None:
            raise ValueError(f"q_lora_rank={self.q_lora_rank}: only q_lora_rank=null is supported")
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope=false (RoPE in MLA) is not supported")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only silu is supported")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ValueError(
                f"grouped top-k with num_expert_group={self.num_expert_group}, "
                f"topk_group={self.topk_group} is not supported (only 1/1)")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"num_experts_per_token={self.num_experts_per_token} > "
                f"num_experts={self.num_experts}")
