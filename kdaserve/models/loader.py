"""Weight loading: safetensors walk, checkpoint-name mapping, dummy init.

The model's `named_parameters()` + persistent buffers use transformers' (>= 5.17) names and shapes.
Checkpoints come in two naming schemes and both load:

- transformers >= 5.17 ("fused"): the model's own names, copied as they are.
- Moonshot's original names (also what transformers' `save_pretrained` writes back out):
  `self_attn.{q,k,v}_conv1d.weight` are the three row blocks of `self_attn.conv1d.weight`,
  `self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}` live under `self_attn.forget_gate.`,
  `block_sparse_moe.` is `mlp.`, and per-expert `experts.{e}.w1/w3/w2.weight` are rows
  [0:I] / [I:2I] of `experts.gate_up_proj[e]` and `experts.down_proj[e]`.

Every checkpoint tensor is copied straight into its slice of the destination parameter, on the
parameter's device and in its dtype; no stacked temporaries are built.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from kdaserve.config import LoadConfig
from kdaserve.config.model_args import KimiLinearArgs

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# Tensors kept in fp32 whatever the model dtype (as transformers' _keep_in_fp32_modules_strict).
FP32_SUFFIXES = (".dt_bias", ".A_log", ".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3
SPREAD_ROUTER_STD = 0.02


# ----------------------------------------------------------------------------------------------
# The expected tensors of a config
# ----------------------------------------------------------------------------------------------

def expected_tensors(args: KimiLinearArgs, dtype: torch.dtype = torch.bfloat16
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every parameter and persistent buffer of KimiLinearForCausalLM
    for `args`, in transformers >= 5.17 naming (= the checkpoint layout make-model writes)."""
    d = args.hidden_size
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def add(name: str, *shape: int) -> None:
        fp32 = name.endswith(FP32_SUFFIXES)
        out[name] = (tuple(shape), torch.float32 if fp32 else dtype)

    add("model.embed_tokens.weight", args.vocab_size, d)
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        if args.layer_types[i] == "linear_attention":
            hk, k, h = args.kda_proj_dim, args.linear_head_dim, args.linear_num_heads
            for proj in ("q_proj", "k_proj", "v_proj"):
                add(p + f"self_attn.{proj}.weight", hk, d)
            add(p + "self_attn.conv1d.weight", 3 * hk, 1, args.linear_conv_kernel_dim)
            add(p + "self_attn.forget_gate.f_a_proj.weight", k, d)
            add(p + "self_attn.forget_gate.f_b_proj.weight", hk, k)
            add(p + "self_attn.forget_gate.dt_bias", hk)
            add(p + "self_attn.forget_gate.A_log", 1, 1, h, 1)
            add(p + "self_attn.b_proj.weight", h, d)
            add(p + "self_attn.g_a_proj.weight", k, d)
            add(p + "self_attn.g_b_proj.weight", hk, k)
            add(p + "self_attn.o_norm.weight", k)
            add(p + "self_attn.o_proj.weight", d, hk)
        else:
            h = args.num_attention_heads
            add(p + "self_attn.q_proj.weight", h * args.qk_head_dim, d)
            add(p + "self_attn.kv_a_proj_with_mqa.weight", args.kv_cache_dim, d)
            add(p + "self_attn.kv_a_layernorm.weight", args.kv_lora_rank)
            add(p + "self_attn.kv_b_proj.weight",
                h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank)
            add(p + "self_attn.o_proj.weight", d, h * args.v_head_dim)
        if args.mlp_layer_types[i] == "sparse":
            e, inter = args.num_experts, args.moe_intermediate_size
            add(p + "mlp.experts.gate_up_proj", e, 2 * inter, d)
            add(p + "mlp.experts.down_proj", e, d, inter)
            add(p + "mlp.gate.weight", e, d)
            add(p + "mlp.gate.e_score_correction_bias", e)
            shared = inter * args.num_shared_experts
            add(p + "mlp.shared_experts.gate_proj.weight", shared, d)
            add(p + "mlp.shared_experts.up_proj.weight", shared, d)
            add(p + "mlp.shared_experts.down_proj.weight", d, shared)
        else:
            add(p + "mlp.gate_proj.weight", args.intermediate_size, d)
            add(p + "mlp.up_proj.weight", args.intermediate_size, d)
            add(p + "mlp.down_proj.weight", d, args.intermediate_size)
        add(p + "input_layernorm.weight", d)
        add(p + "post_attention_layernorm.weight", d)
    add("model.norm.weight", d)
    if not args.tie_word_embeddings:
        add("lm_head.weight", args.vocab_size, d)
    return out


# ----------------------------------------------------------------------------------------------
# Name mapping
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter name, and a piece of that parameter."""
    param_name: str
    piece: tuple = ()
    """() = the whole parameter; ("rows", k, n) = row block k of n (dim 0);
    ("expert", e) = slice e of dim 0; ("expert_rows", e, k, n) = row block k of n of slice e."""

    def view(self, param: torch.Tensor) -> torch.Tensor:
        if not self.piece:
            return param
        kind = self.piece[0]
        if kind == "rows":
            _, k, n = self.piece
            rows = param.shape[0] // n
            return param.narrow(0, k * rows, rows)
        if kind == "expert":
            return param[self.piece[1]]
        if kind == "expert_rows":
            _, e, k, n = self.piece
            rows = param.shape[1] // n
            return param[e].narrow(0, k * rows, rows)
        raise AssertionError(self.piece)


_CONV_RE = re.compile(r"^(.*\.self_attn\.)([qkv])_conv1d\.weight$")
_GATE_RE = re.compile(r"^(.*\.self_attn\.)(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(w[123])\.weight$")


def map_checkpoint_name(name: str) -> WeightTarget:
    """Checkpoint tensor name (either scheme) -> the model parameter (piece) it fills."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if m := _CONV_RE.match(name):
        return WeightTarget(m[1] + "conv1d.weight", ("rows", "qkv".index(m[2]), 3))
    if m := _GATE_RE.match(name):
        return WeightTarget(m[1] + "forget_gate." + m[2])
    if m := _EXPERT_RE.match(name):
        e = int(m[2])
        if m[3] == "w2":
            return WeightTarget(m[1] + "down_proj", ("expert", e))
        return WeightTarget(m[1] + "gate_up_proj", ("expert_rows", e, 0 if m[3] == "w1" else 1, 2))
    return WeightTarget(name)


def _squeeze_shape(shape) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


# ----------------------------------------------------------------------------------------------
# Safetensors walk
# ----------------------------------------------------------------------------------------------

def checkpoint_files(model_path: str) -> list[str]:
    """The safetensors files of a checkpoint folder (sharded via the index json, or single)."""
    if not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} is not a directory")
    index_path = os.path.join(model_path, SAFETENSORS_INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: no 'weight_map' in the index")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(model_path, f))]
        if missing:
            raise ValueError(
                f"{index_path} names shard file(s) that do not exist in {model_path}: {missing}")
        return [os.path.join(model_path, f) for f in files]
    single = os.path.join(model_path, SAFETENSORS_FILE)
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if found:
        return [os.path.join(model_path, f) for f in found]
    raise ValueError(
        f"no {SAFETENSORS_FILE}, {SAFETENSORS_INDEX_FILE} or *.safetensors in {model_path!r} "
        "(use load_format='dummy' for random weights)")


def iterate_checkpoint(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) one tensor at a time."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _loadable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters + persistent buffers by name (tied aliases included)."""
    return dict(model.state_dict(keep_vars=True))


def _resolve_param_name(name: str, tensors: dict[str, torch.Tensor]) -> str | None:
    if name in tensors:
        return name
    for alt in ("model." + name, name.removeprefix("model.")):
        if alt in tensors:
            return alt
    return None


def load_safetensors_weights(model: nn.Module, model_path: str) -> None:
    files = checkpoint_files(model_path)
    tensors = _loadable_tensors(model)
    # Aliases (tied weights) share one storage: loading any name covers all of them.
    alias_key = {n: (t.data_ptr(), t.dtype, tuple(t.shape)) if t.device.type != "meta" else n
                 for n, t in tensors.items()}
    filled: dict[object, int] = {}  # alias key -> elements loaded
    pieces_seen: set[tuple[str, tuple]] = set()

    with torch.no_grad():
        for ckpt_name, loaded in iterate_checkpoint(files):
            target = map_checkpoint_name(ckpt_name)
            param_name = _resolve_param_name(target.param_name, tensors)
            if param_name is None:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} (-> {target.param_name!r}) matches no "
                    "parameter of the model")
            key = (param_name, target.piece)
            if key in pieces_seen:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} fills {param_name!r} "
                                 f"{target.piece or ''} a second time")
            pieces_seen.add(key)
            param = tensors[param_name]
            dest = target.view(param.data)
            if tuple(loaded.shape) != tuple(dest.shape):
                if (loaded.numel() == dest.numel()
                        and _squeeze_shape(loaded.shape) == _squeeze_shape(dest.shape)):
                    loaded = loaded.reshape(dest.shape)
                else:
                    raise ValueError(
                        f"shape mismatch for checkpoint tensor {ckpt_name!r}: checkpoint "
                        f"{tuple(loaded.shape)}, model {param_name!r} expects {tuple(dest.shape)}")
            dest.copy_(loaded)
            filled[alias_key[param_name]] = filled.get(alias_key[param_name], 0) + dest.numel()

    missing = [n for n, t in tensors.items() if filled.get(alias_key[n], 0) < t.numel()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {model_path!r} leaves {len(missing)} model tensor(s) "
                         f"unloaded: {shown}")


# ----------------------------------------------------------------------------------------------
# Dummy weights
# ----------------------------------------------------------------------------------------------

def tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed: independent of parameter order, device and of the other tensors."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _fill(t: torch.Tensor, seed: int, fn: Callable[[torch.Tensor, torch.Generator], None]) -> None:
    gen = torch.Generator(device=t.device)
    gen.manual_seed(seed)
    if t.dtype.itemsize < 2:  # fp8: draw in fp16, then cast
        tmp = torch.empty(t.shape, dtype=torch.float16, device=t.device)
        fn(tmp, gen)
        t.copy_(tmp)
    else:
        fn(t, gen)


def init_dummy_weights(model: nn.Module, seed: int = 0, dummy_routing: str = "vllm") -> None:
    """Fill every floating-point parameter / persistent buffer in place on its device.

    vllm: everything uniform in [-1e-3, 1e-3] (vLLM's dummy loader convention; the router's
    selection bias then decides, so every token picks the same experts).
    spread: the same, except router weights `mlp.gate.weight` ~ N(0, 0.02) and
    `e_score_correction_bias` = 0, so the choice depends on the token.
    """
    if dummy_routing not in ("vllm", "spread"):
        raise ValueError(f"dummy_routing must be vllm or spread, got {dummy_routing!r}")
    seen: set[int] = set()
    with torch.no_grad():
        for name, t in _loadable_tensors(model).items():
            data = t.data
            if not data.is_floating_point() or data.device.type == "meta":
                continue
            if data.data_ptr() in seen and data.numel() > 0:  # tied alias: filled once
                continue
            seen.add(data.data_ptr())
            s = tensor_seed(seed, name)
            if dummy_routing == "spread" and name.endswith(".mlp.gate.e_score_correction_bias"):
                data.zero_()
            elif dummy_routing == "spread" and name.endswith(".mlp.gate.weight"):
                _fill(data, s, lambda x, g: x.normal_(0.0, SPREAD_ROUTER_STD, generator=g))
            else:
                _fill(data, s, lambda x, g: x.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=g))


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------

def load_weights(model: nn.Module, model_path: str, load_config: LoadConfig) -> None:
    """Fill `model` (already built on its device, in its dtype) from `model_path`, or with dummy
    weights; then call `model.process_weights_after_loading()` if the model has one."""
    fmt = load_config.load_format
    if fmt == "dummy":
        init_dummy_weights(model, load_config.seed, load_config.dummy_routing)
    elif fmt in ("auto", "safetensors"):
        load_safetensors_weights(model, model_path)
    else:
        raise ValueError(f"unsupported load_format {fmt!r}")
    post = getattr(model, "process_weights_after_loading", None)
    if callable(post):
        post()
