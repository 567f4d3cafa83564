"""Weight loading: safetensors walk, checkpoint-name mapping, dummy init.

The model's `named_parameters()` + persistent buffers use transformers' (>= 5.17) names and shapes.
Checkpoints come in two naming schemes and both load:

- transformers >= 5.17 ("fused"): the model's own names, copied as they are.
- Moonshot's original names (also what transformers' `save_pretrained` writes back out):
  `self_attn.{q,k,v}_conv1d.weight` are the three row blocks of `self_attn.conv1d.weight`,
  `self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}` live under `self_attn.forget_gate.`,
  `block_sparse_moe.` is `mlp.`, and per-expert `experts.{e}.w1/w3/w2.weight` are rows
  [0:I] / [I:2I] of `experts.gate_up_proj[e]` and `experts.down_proj[e]`.
- Kimi K3 (`KimiK3ForConditionalGeneration`): Moonshot's names under `language_model.`, with
  compressed-tensors MXFP4 routed experts `experts.{e}.w1/w3/w2.weight_packed` (uint8 [N, K/2])
  and `.weight_scale` (uint8 E8M0 [N, K/32]), rows of `experts.gate_up_proj_packed[e]` /
  `_scale[e]` and `experts.down_proj_packed[e]` / `_scale[e]`. The vision tower and projector
  (`vision_tower.`, `mm_projector.`) are skipped (only the text model is served), and so are
  the MTP layers (`model.layers.{n >= num_hidden_layers}`): they are not part of the target;
  the MTP drafter (models/mtp.py, speculative method "mtp") loads them itself.

Model-dtype expert tensors (either scheme) loading into MXFP4 experts (`--quantization mxfp4`
on a bf16 checkpoint) are quantised on the way in (kernels/mxfp4/format.py quantize_mxfp4).

Every checkpoint tensor is copied straight into its slice of the destination parameter, on the
parameter's device and in its dtype; no stacked temporaries are built.

Tensor parallelism (a model built with a TP group of size > 1): each split tensor (the
modules' `tp_shards()`, layers/parallel.py) receives this rank's slice of the full tensor, for
checkpoints (each checkpoint tensor, or piece, is cut before it is copied) and dummy weights
alike (the full tensor is drawn as at TP=1, then cut), so the ranks together hold exactly the
TP=1 weights.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from kdaserve.config import LoadConfig
from kdaserve.config.model_args import MXFP4_BLOCK, KimiLinearArgs
from kdaserve.kernels.mxfp4.format import quantize_mxfp4
from kdaserve.layers.parallel import ShardSpec, full_shape, model_shard_specs, shard

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# Tensors kept in fp32 whatever the model dtype (as transformers' _keep_in_fp32_modules_strict).
FP32_SUFFIXES = (".dt_bias", ".A_log", ".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3
SPREAD_ROUTER_STD = 0.02


# ----------------------------------------------------------------------------------------------
# The expected tensors of a config
# ----------------------------------------------------------------------------------------------

def expected_tensors(args: KimiLinearArgs, dtype: torch.dtype = torch.bfloat16,
                     include_mtp: bool = False
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every parameter and persistent buffer of KimiLinearForCausalLM
    for `args`, in transformers >= 5.17 naming (= the checkpoint layout make-model writes for
    Kimi Linear). MXFP4 experts are uint8 (`*_packed`, `*_scale`). include_mtp adds the MTP
    layers of a checkpoint (model.layers.{num_hidden_layers + i}; not model tensors)."""
    d = args.hidden_size
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def add(name: str, *shape: int, dt: torch.dtype | None = None) -> None:
        fp32 = name.endswith(FP32_SUFFIXES)
        out[name] = (tuple(shape), dt or (torch.float32 if fp32 else dtype))

    add("model.embed_tokens.weight", args.vocab_size, d)
    for i in range(args.num_hidden_layers):
        _layer_tensors(add, args, f"model.layers.{i}.",
                       args.layer_types[i] == "linear_attention",
                       args.mlp_layer_types[i] == "sparse", bool(args.attn_res_block_size))
    if args.attn_res_block_size:
        add("model.output_attn_res_norm.weight", d)
        add("model.output_attn_res_proj.weight", 1, d)
    add("model.norm.weight", d)
    if not args.tie_word_embeddings:
        add("lm_head.weight", args.vocab_size, d)
    for j in range(args.num_nextn_predict_layers if include_mtp else 0):
        p = f"model.layers.{args.num_hidden_layers + j}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            add(p + norm + ".weight", d)
        add(p + "eh_proj.weight", d, 2 * d)
        add(p + "shared_head.head.weight", args.vocab_size, d)
        _layer_tensors(add, args, p, False, True, False)   # MLA + MoE, plain residual
    return out


def _layer_tensors(add, args: KimiLinearArgs, p: str, is_kda: bool, is_moe: bool,
                   attn_res: bool) -> None:
    """The tensors of one decoder layer under prefix p."""
    d = args.hidden_size
    if is_kda:
        hk, k, h = args.kda_proj_dim, args.linear_head_dim, args.linear_num_heads
        for proj in ("q_proj", "k_proj", "v_proj"):
            add(p + f"self_attn.{proj}.weight", hk, d)
        add(p + "self_attn.conv1d.weight", 3 * hk, 1, args.linear_conv_kernel_dim)
        add(p + "self_attn.forget_gate.f_a_proj.weight", k, d)
        add(p + "self_attn.forget_gate.f_b_proj.weight", hk, k)
        add(p + "self_attn.forget_gate.dt_bias", hk)
        add(p + "self_attn.forget_gate.A_log", 1, 1, h, 1)
        add(p + "self_attn.b_proj.weight", h, d)
        if args.kda_full_rank_gate:
            add(p + "self_attn.g_proj.weight", hk, d)
        else:
            add(p + "self_attn.g_a_proj.weight", k, d)
            add(p + "self_attn.g_b_proj.weight", hk, k)
        add(p + "self_attn.o_norm.weight", k)
        add(p + "self_attn.o_proj.weight", d, hk)
    else:
        h = args.num_attention_heads
        if args.q_lora_rank is None:
            add(p + "self_attn.q_proj.weight", h * args.qk_head_dim, d)
        else:
            add(p + "self_attn.q_a_proj.weight", args.q_lora_rank, d)
            add(p + "self_attn.q_a_layernorm.weight", args.q_lora_rank)
            add(p + "self_attn.q_b_proj.weight", h * args.qk_head_dim, args.q_lora_rank)
        add(p + "self_attn.kv_a_proj_with_mqa.weight", args.kv_cache_dim, d)
        add(p + "self_attn.kv_a_layernorm.weight", args.kv_lora_rank)
        add(p + "self_attn.kv_b_proj.weight",
            h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank)
        if args.mla_use_output_gate:
            add(p + "self_attn.g_proj.weight", h * args.v_head_dim, d)
        add(p + "self_attn.o_proj.weight", d, h * args.v_head_dim)
    if is_moe:
        e, inter, x = args.num_experts, args.moe_intermediate_size, args.expert_input_size
        if args.expert_quantization == "mxfp4":
            u8 = torch.uint8
            add(p + "mlp.experts.gate_up_proj_packed", e, 2 * inter, x // 2, dt=u8)
            add(p + "mlp.experts.gate_up_proj_scale", e, 2 * inter, x // MXFP4_BLOCK, dt=u8)
            add(p + "mlp.experts.down_proj_packed", e, x, inter // 2, dt=u8)
            add(p + "mlp.experts.down_proj_scale", e, x, inter // MXFP4_BLOCK, dt=u8)
        else:
            add(p + "mlp.experts.gate_up_proj", e, 2 * inter, x)
            add(p + "mlp.experts.down_proj", e, x, inter)
        add(p + "mlp.gate.weight", e, d)
        add(p + "mlp.gate.e_score_correction_bias", e)
        if args.is_latent_moe:
            add(p + "mlp.routed_expert_down_proj.weight", x, d)
            if args.latent_moe_use_norm:
                add(p + "mlp.routed_expert_norm.weight", x)
            add(p + "mlp.routed_expert_up_proj.weight", d, x)
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
    if attn_res:
        for read in ("self_attention_res", "mlp_res"):
            add(p + f"{read}_norm.weight", d)
            add(p + f"{read}_proj.weight", 1, d)


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
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(w[123])\.weight(_packed|_scale)?$")
_LAYER_RE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
"""Kimi K3's vision tower and projector: not served."""
TEXT_PREFIX = "language_model."


def skip_reason(name: str, args: KimiLinearArgs | None) -> str | None:
    """Why a checkpoint tensor is not loaded (None: it is)."""
    bare = name.removeprefix(TEXT_PREFIX)
    if bare.startswith(SKIPPED_PREFIXES):
        return "vision"
    m = _LAYER_RE.match(name)
    if args is not None and m and int(m[1]) >= args.num_hidden_layers:
        return "mtp"
    return None


def map_checkpoint_name(name: str) -> WeightTarget:
    """Checkpoint tensor name (any scheme) -> the model parameter (piece) it fills."""
    name = name.removeprefix(TEXT_PREFIX).replace(".block_sparse_moe.", ".mlp.")
    if m := _CONV_RE.match(name):
        return WeightTarget(m[1] + "conv1d.weight", ("rows", "qkv".index(m[2]), 3))
    if m := _GATE_RE.match(name):
        return WeightTarget(m[1] + "forget_gate." + m[2])
    if m := _EXPERT_RE.match(name):
        e, suffix = int(m[2]), m[4] or ""
        if m[3] == "w2":
            return WeightTarget(m[1] + "down_proj" + suffix, ("expert", e))
        return WeightTarget(m[1] + "gate_up_proj" + suffix,
                            ("expert_rows", e, 0 if m[3] == "w1" else 1, 2))
    return WeightTarget(name)


def _squeeze_shape(shape) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def piece_spec(spec: ShardSpec, piece: tuple) -> ShardSpec:
    """How a checkpoint tensor that fills `piece` (WeightTarget.piece) of a parameter split
    by `spec` is split, in the checkpoint tensor's own coordinates. A piece that is one of the
    spec's blocks (q_conv1d of conv1d, w1 of gate_up) is split whole; otherwise the split dim
    moves to the piece's coordinates (an expert's slice drops dim 0)."""
    if not piece:
        return spec
    kind = piece[0]
    drops = 1 if kind in ("expert", "expert_rows") else 0     # the expert index dim
    if kind == "expert" and spec.dim == 0:
        raise ValueError("experts are not split by expert")
    piece_dim = 1 if kind == "expert_rows" else 0
    if kind != "expert" and spec.dim == piece_dim:
        if spec.blocks != piece[-1]:
            raise ValueError(f"a {piece[-1]}-block piece of a tensor split in {spec.blocks} "
                             "block(s) along the same dim")
        return ShardSpec(piece_dim - drops)
    return ShardSpec(spec.dim - drops, spec.blocks)


def _tp(model: nn.Module) -> tuple[dict[str, ShardSpec], int, int]:
    """(shard specs, rank, size) of a model's TP split; ({}, 0, 1) when it is not split."""
    tp = getattr(model, "tp", None)
    if tp is None or tp.size == 1:
        return {}, 0, 1
    return model_shard_specs(model), tp.rank, tp.size


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


def fastsafetensors_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) through the fastsafetensors library (the reference's launch line uses
    it); where the library is not installed, one log line and the safetensors walk."""
    try:
        from fastsafetensors import fastsafe_open
    except ImportError:
        logger.info("load_format fastsafetensors: the fastsafetensors library is not "
                    "installed; loading with safetensors")
        yield from iterate_checkpoint(files)
        return
    # nogds: reads through host memory (GPU Direct Storage needs its own set-up); the tensors
    # are copied into the model's on their way (load_safetensors_weights).
    with fastsafe_open(filenames=list(files), framework="pt", device="cpu", nogds=True) as f:
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


def load_safetensors_weights(model: nn.Module, model_path: str,
                             tensors_iter: Iterator[tuple[str, torch.Tensor]] | None = None
                             ) -> None:
    """Copy every checkpoint tensor into its model tensor (or piece); every model tensor must
    be filled. tensors_iter: (name, CPU tensor) pairs (default: iterate_checkpoint)."""
    files = checkpoint_files(model_path)
    args = getattr(model, "args", None)
    tensors = _loadable_tensors(model)
    specs, tp_rank, tp_size = _tp(model)
    # Aliases (tied weights) share one storage: loading any name covers all of them.
    alias_key = {n: (t.data_ptr(), t.dtype, tuple(t.shape)) if t.device.type != "meta" else n
                 for n, t in tensors.items()}
    filled: dict[object, int] = {}  # alias key -> elements loaded
    pieces_seen: set[tuple[str, tuple]] = set()
    skipped: dict[str, int] = {}

    def cut(param_name: str, target: WeightTarget, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (the tensor itself when not split)."""
        spec = specs.get(param_name)
        if spec is None:
            return loaded
        split = piece_spec(spec, target.piece)
        want = full_shape(target.view(tensors[param_name].data).shape, split, tp_size)
        if tuple(loaded.shape) != want and _squeeze_shape(loaded.shape) == _squeeze_shape(want):
            loaded = loaded.reshape(want)   # e.g. K3's flat A_log [H] for [1, 1, H, 1]
        return shard(loaded, split, tp_rank, tp_size)

    def fill(ckpt_name: str, param_name: str, target: WeightTarget,
             loaded: torch.Tensor) -> None:
        key = (param_name, target.piece)
        if key in pieces_seen:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} fills {param_name!r} "
                             f"{target.piece or ''} a second time")
        pieces_seen.add(key)
        dest = target.view(tensors[param_name].data)
        if tuple(loaded.shape) != tuple(dest.shape):
            if (loaded.numel() == dest.numel()
                    and _squeeze_shape(loaded.shape) == _squeeze_shape(dest.shape)):
                loaded = loaded.reshape(dest.shape)
            else:
                raise ValueError(
                    f"shape mismatch for checkpoint tensor {ckpt_name!r}: checkpoint "
                    f"{tuple(loaded.shape)}, model {param_name!r} expects {tuple(dest.shape)}")
        if dest.dtype == torch.uint8 and loaded.is_floating_point():
            raise ValueError(f"checkpoint tensor {ckpt_name!r} is {loaded.dtype}, model "
                             f"{param_name!r} holds MXFP4 bytes")
        dest.copy_(loaded)
        filled[alias_key[param_name]] = filled.get(alias_key[param_name], 0) + dest.numel()

    with torch.no_grad():
        for ckpt_name, loaded in (tensors_iter or iterate_checkpoint(files)):
            reason = skip_reason(ckpt_name, args)
            if reason is not None:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            target = map_checkpoint_name(ckpt_name)
            param_name = _resolve_param_name(target.param_name, tensors)
            packed_name = _resolve_param_name(target.param_name + "_packed", tensors)
            if param_name is None and packed_name is not None and loaded.is_floating_point():
                # a model-dtype expert weight into MXFP4 experts: quantise it on the way in
                # (this rank's columns: MXFP4 splits on whole scale groups)
                packed, scale = quantize_mxfp4(cut(packed_name, target, loaded))
                scale_name = packed_name.removesuffix("_packed") + "_scale"
                fill(ckpt_name, packed_name, target, packed)
                fill(ckpt_name, scale_name, target, scale)
                continue
            if param_name is None:
                hint = (" (MXFP4 experts in the checkpoint: the model's experts are not "
                        "MXFP4)" if ckpt_name.endswith(("_packed", "_scale")) else "")
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} (-> {target.param_name!r}) matches no "
                    f"parameter of the model{hint}")
            fill(ckpt_name, param_name, target, cut(param_name, target, loaded))

    for reason, count in sorted(skipped.items()):
        logger.info("skipped %d checkpoint tensor(s) of the %s %s", count,
                    {"vision": "vision tower /", "mtp": "MTP"}[reason],
                    {"vision": "projector (text model only)",
                     "mtp": "layers (not part of the target; the mtp drafter loads "
                            "them)"}[reason])
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
    MXFP4 experts (`*_packed` + `*_scale`) hold the MXFP4 packing of exactly the values the
    same model with model-dtype experts gets (same seed, same draw), so `--quantization mxfp4`
    on dummy weights is the quantised twin of the dummy bf16 model.
    Under TP a split tensor is drawn whole (the TP=1 values), then this rank's slice is kept.
    """
    if dummy_routing not in ("vllm", "spread"):
        raise ValueError(f"dummy_routing must be vllm or spread, got {dummy_routing!r}")
    seen: set[int] = set()
    specs, tp_rank, tp_size = _tp(model)
    with torch.no_grad():
        tensors = _loadable_tensors(model)
        float_dtype = next((t.dtype for n, t in tensors.items() if t.is_floating_point()
                            and not n.endswith(FP32_SUFFIXES)), torch.float32)
        for name, t in tensors.items():
            data = t.data
            if name.endswith("_packed") and data.device.type != "meta":
                base = name.removesuffix("_packed")
                _fill_mxfp4_dummy(data, tensors[base + "_scale"].data, tensor_seed(seed, base),
                                  float_dtype, specs.get(name), tp_rank, tp_size)
                continue
            if not data.is_floating_point() or data.device.type == "meta":
                continue
            if data.data_ptr() in seen and data.numel() > 0:  # tied alias: filled once
                continue
            seen.add(data.data_ptr())
            s = tensor_seed(seed, name)
            spec = specs.get(name)
            whole = data if spec is None else torch.empty(
                full_shape(data.shape, spec, tp_size), dtype=data.dtype, device=data.device)
            if dummy_routing == "spread" and name.endswith(".mlp.gate.e_score_correction_bias"):
                whole.zero_()
            elif dummy_routing == "spread" and name.endswith(".mlp.gate.weight"):
                _fill(whole, s, lambda x, g: x.normal_(0.0, SPREAD_ROUTER_STD, generator=g))
            else:
                _fill(whole, s, lambda x, g: x.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=g))
            if spec is not None:
                data.copy_(shard(whole, spec, tp_rank, tp_size))


def _fill_mxfp4_dummy(packed: torch.Tensor, scale: torch.Tensor, seed: int,
                      dtype: torch.dtype, spec: ShardSpec | None = None, tp_rank: int = 0,
                      tp_size: int = 1) -> None:
    """packed [E, N, K/2], scale [E, N, K/32] <- quantize_mxfp4 of the [E, N, K] tensor in
    dtype that the model-dtype experts' dummy fill draws with this seed (quantised one expert
    at a time); with spec, packed / scale are this rank's part and the whole tensor is drawn,
    then cut on 32-element groups before quantising."""
    shape = tuple(packed.shape) if spec is None else full_shape(packed.shape, spec, tp_size)
    n, k = shape[-2], shape[-1] * 2
    w = torch.empty(shape[0], n, k, dtype=dtype, device=packed.device)
    _fill(w, seed, lambda x, g: x.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=g))
    if spec is not None:
        w = shard(w, spec, tp_rank, tp_size)
    for e in range(packed.shape[0]):
        p, s = quantize_mxfp4(w[e])
        packed[e].copy_(p)
        scale[e].copy_(s)


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
    elif fmt == "fastsafetensors":
        load_safetensors_weights(model, model_path,
                                 fastsafetensors_iterator(checkpoint_files(model_path)))
    else:
        raise ValueError(f"unsupported load_format {fmt!r}")
    post = getattr(model, "process_weights_after_loading", None)
    if callable(post):
        post()
