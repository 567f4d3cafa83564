"""Programmatic dependent launch (pdl=True) on the decode-path kernels: router, fused MoE, MLA
decode, causal conv, gated RMSNorm (gemv and add_rms_norm: test_gemv.py, test_norm_kernels.py).

CPU: each kernel compiled for sm_90 (Triton's bundled ptxas, no GPU) with USE_PDL on: before the
single griddepcontrol.wait only loads of immutable inputs (weights, biases) and no store;
launch_dependents right after the wait; with USE_PDL off no griddepcontrol and the same global
memory traffic (instruction, tensor) as with it on. A memory op's tensor is found by following
its address registers back to the kernel parameters in the PTX (loaded values break the chain,
so a gathered address names the tensor it reads, not the index tensor). (Once, not a standing
test: with USE_PDL off, the PTX of these specs and of every interpreter launch that
test_compile_sm90.py records was identical, .loc lines aside, to the code before the flag.)
Interpreter (CPU, subprocess): the eager checks below at small fp32 shapes (pdl is ignored on
CPU tensors, so this checks the test code and the wrappers' pdl keyword, not PDL itself).
GPU (marked gpu): every wrapper bit-identical with pdl on and off at the Kimi-Linear-48B decode
shapes (batch 1 and 4), eagerly and in a captured CUDA graph chain of PDL launches.

Run as a script (TRITON_INTERPRET=1) for the interpreter part.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kernel_checks as kc  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32


def gpu(test):
    """Mark a test gpu and skip it without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return pytest.mark.gpu(skip(test))


# ---------------------------------------------------------------------------------------------
# sm_90 PTX: which tensor each global memory op touches, in program order
# ---------------------------------------------------------------------------------------------

_REG = re.compile(r"%[a-z]+\d+")
_SPACES = {"global", "shared", "param", "local", "const"}


def _kind(op: str) -> str | None:
    """'global' for a global load / store / atomic / cp.async, 'sync' for griddepcontrol, None
    for anything else; fails on memory ops the analysis does not follow (generic addresses,
    bulk / TMA copies)."""
    parts = op.split(".")
    if parts[0] == "griddepcontrol":
        return "sync"
    assert not op.startswith(("cp.async.bulk", "cp.reduce")), f"{op}: not analysed"
    if op.startswith("cp.async.") and "global" in parts:
        return "global"
    if parts[0] in ("ld", "st", "atom", "red"):
        assert _SPACES & set(parts), f"{op}: generic address, not analysed"
        return "global" if "global" in parts else None
    return None


@dataclass(frozen=True)
class KernelSpec:
    """One kernel at one decode-shape specialisation. ptrs: pointer parameter -> dtype; floats:
    fp32 scalars (other non-constexpr parameters are i32); early: the pointer parameters
    (immutable weights / biases) that USE_PDL reads before griddepcontrol.wait."""
    name: str
    module: str
    kernel: str
    ptrs: dict
    consts: dict
    num_warps: int = 4
    num_stages: int = 3
    floats: tuple = ()
    early: tuple = ()


def _ptxas():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")


def _signature(fn, spec: KernelSpec) -> dict:
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        else:
            sig[p.name] = spec.ptrs.get(p.name, "fp32" if p.name in spec.floats else "i32")
    return sig


def compile_sm90(spec: KernelSpec, use_pdl: bool | None):
    """The kernel compiled for sm_90 with USE_PDL=use_pdl (None: left to its default), with the
    16-byte divisibility hint the JIT gives aligned pointers and ints."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    sig = _signature(fn, spec)
    consts = dict(spec.consts)
    if use_pdl is not None:
        consts["USE_PDL"] = use_pdl
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    consts = {**defaults, **consts}                     # the JIT's binder fills defaults
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or sig[n] == "i32"}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                                   "launch_pdl": bool(use_pdl)})


def _operands(text: str) -> list[str]:
    """Top-level comma-separated operands ({...} and [...] kept whole)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "{[") - (ch in "}]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def _unbrace(stmt: str) -> str:
    """Drop the unmatched scope braces of an inline-asm block around a statement."""
    while stmt.startswith("{") and stmt.count("{") > stmt.count("}"):
        stmt = stmt[1:].strip()
    while stmt.endswith("}") and stmt.count("}") > stmt.count("{"):
        stmt = stmt[:-1].strip()
    return stmt


def _instructions(ptx: str) -> list[tuple[str, list[str]]]:
    """(opcode, operands) of every instruction of the kernel body (guards dropped)."""
    body = ptx[ptx.index(".entry"):ptx.index("// -- End function")]
    insts = []
    for line in body.splitlines():
        for stmt in re.sub(r"//.*", "", line).split(";"):
            stmt = _unbrace(stmt.strip())
            stmt = re.sub(r"^@!?%p\d+\s+", "", stmt)
            if not stmt or stmt[0] in ".$" or stmt.endswith(":"):
                continue
            parts = stmt.split(None, 1)
            insts.append((parts[0], _operands(parts[1]) if len(parts) > 1 else []))
    return insts


def _param_taint(insts) -> dict[str, frozenset]:
    """Register -> the kernel parameters its value derives from (fixed point over loops).
    ld.param seeds a parameter; a value loaded from global memory derives from none; shared
    memory is one pool (pointer tensors change register layout through it)."""
    taint: dict[str, frozenset] = {}
    shared = frozenset()
    changed = True
    while changed:
        changed = False
        for op, ops in insts:
            if op.startswith("st.shared"):
                new = frozenset().union(*(taint.get(r, frozenset()) for r in _REG.findall(ops[1])))
                changed |= not new <= shared
                shared |= new
                continue
            if not ops or op.startswith(("st.", "red.", "cp.async", "griddepcontrol", "bar.",
                                         "bra", "ret", "fence", "mbarrier")):
                continue
            dsts = _REG.findall(ops[0])
            if op.startswith("ld.param"):
                new = frozenset({int(re.search(r"_param_(\d+)", ops[1]).group(1))})
            elif op.startswith(("ld.shared", "ldmatrix")):
                new = shared
            elif op.startswith(("ld.", "atom.")):
                new = frozenset()
            else:
                new = frozenset().union(*(taint.get(r, frozenset())
                                          for o in ops[1:] for r in _REG.findall(o)))
            for d in dsts:
                if not new <= taint.get(d, frozenset()):
                    taint[d] = taint.get(d, frozenset()) | new
                    changed = True
    return taint


def memory_ops(ptx: str, spec: KernelSpec) -> list[tuple[str, str]]:
    """(opcode, tensor parameter name) of every global load / store / atomic / cp.async, and
    ('griddepcontrol.*', '') markers, in program order. Asserts each op's address derives from
    exactly one pointer parameter (else the analysis, not the kernel, is wrong)."""
    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    names = [p.name for p in fn.params if not p.is_constexpr]
    pointers = {i for i, n in enumerate(names) if n in spec.ptrs}
    insts = _instructions(ptx)
    taint = _param_taint(insts)
    ops = []
    for op, operands in insts:
        kind = _kind(op)
        if kind is None:
            continue
        if kind == "sync":
            ops.append((op, ""))
            continue
        addrs = [o for o in operands if o.startswith("[")]
        addr = addrs[1] if op.startswith("cp.async") else addrs[0]   # cp.async: [smem], [gmem]
        params = set().union(*(taint.get(r, frozenset()) for r in _REG.findall(addr)))
        params &= pointers
        assert len(params) == 1, f"{spec.name}: {op} {addr} -> params {params}"
        ops.append((op, names[params.pop()]))
    return ops


def split_at_wait(ops):
    """(ops before the single griddepcontrol.wait, ops after it)."""
    waits = [i for i, (op, _) in enumerate(ops) if op.startswith("griddepcontrol.wait")]
    assert len(waits) == 1, f"expected one griddepcontrol.wait, got {len(waits)}"
    return ops[:waits[0]], ops[waits[0] + 1:]


# ---------------------------------------------------------------------------------------------
# The decode-path kernels at the 48B decode specialisations (bf16 activations)
# ---------------------------------------------------------------------------------------------

_MOE = "kdaserve.kernels.moe.triton_moe"
_MLA = "kdaserve.kernels.mla.triton_decode"
_CONV = "kdaserve.kernels.conv.triton_conv"


def _ids(*names):
    return {n: "*i32" for n in names}


def _bf16(*names):
    return {n: "*bf16" for n in names}


_TOPK_PTRS = dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32")
_TOPK = dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=256, BLOCK_K=16, EXTRA_ID=256)
_ALIGN_IDS = _ids("counts_ptr", "expert_start_ptr", "expert_ids_ptr", "num_rows_ptr")
_GEMM_IDS = _ids("sorted_ids_ptr", "expert_ids_ptr", "expert_start_ptr", "counts_ptr",
                 "num_rows_ptr")
_GEMM = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, DOT_PRECISION="tf32")
_MLA_PTRS = {**_bf16("q_ptr", "qr_ptr", "kv_ptr"), **_ids("block_table_ptr", "seq_lens_ptr"),
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
_MLA_TILES = dict(KV_RANK=512, ROPE=64, BLOCK_C=512, BLOCK_R=64, PAGE_SIZE=64, BLOCK_H=32,
                  BLOCK_N=64, DOT_PRECISION="tf32")
_CONV_PTRS = {**_bf16("x_ptr", "w_ptr", "y_ptr", "states_ptr"), **_ids("state_idx_ptr")}

SPECS = [
    KernelSpec("topk_sigmoid logits", "kdaserve.kernels.moe.triton_router", "topk_sigmoid_kernel",
               _TOPK_PTRS, dict(_TOPK, HAS_BIAS=True), num_warps=2, floats=("scaling",),
               early=("bias_ptr",)),
    KernelSpec("topk_sigmoid no bias", "kdaserve.kernels.moe.triton_router",
               "topk_sigmoid_kernel", _TOPK_PTRS, dict(_TOPK, HAS_BIAS=False), num_warps=2,
               floats=("scaling",)),
    KernelSpec("router partials", "kdaserve.kernels.moe.triton_router", "router_partials_kernel",
               dict(x_ptr="*bf16", w_ptr="*fp32", part_ptr="*fp32"),
               dict(BLOCK_M=16, BLOCK_N=8, BLOCK_K=32, EVEN_K=True, STAGES=3)),
    KernelSpec("moe align small", _MOE, "moe_align_small_kernel",
               {**_ids("topk_ids_ptr", "sorted_ids_ptr"), **_ALIGN_IDS},
               dict(BLOCK_M=16, BLOCK_T=64, BLOCK_E=512)),
    KernelSpec("moe count", _MOE, "moe_count_kernel", _ids("topk_ids_ptr", "counts_ptr"),
               dict(BLOCK=256)),
    KernelSpec("moe offsets", _MOE, "moe_offsets_kernel",
               {**_ALIGN_IDS, **_ids("cursor_ptr")}, dict(BLOCK_M=16, BLOCK_E=512)),
    KernelSpec("moe scatter", _MOE, "moe_scatter_kernel",
               _ids("topk_ids_ptr", "cursor_ptr", "sorted_ids_ptr"), dict(BLOCK=256)),
    KernelSpec("moe gemm1 direct", _MOE, "moe_gemm1_kernel",
               {**_bf16("x_ptr", "w13_ptr", "inter_ptr"), **_GEMM_IDS},
               dict(_GEMM, DIRECT=True), num_stages=4),
    KernelSpec("moe gemm1", _MOE, "moe_gemm1_kernel",
               {**_bf16("x_ptr", "w13_ptr", "inter_ptr"), **_GEMM_IDS}, _GEMM, num_stages=4),
    KernelSpec("moe gemm2", _MOE, "moe_gemm2_kernel",
               {**_bf16("inter_ptr", "w2_ptr", "buf_ptr"), **_GEMM_IDS,
                "topk_weights_ptr": "*fp32"}, _GEMM, num_stages=4),
    KernelSpec("moe sum", _MOE, "moe_sum_kernel",
               {**_bf16("buf_ptr", "out_ptr"), **_ids("topk_ids_ptr")}, dict(BLOCK_D=1024)),
    KernelSpec("moe gemm2_sum", _MOE, "moe_gemm2_sum_kernel",
               {**_bf16("inter_ptr", "w2_ptr", "out_ptr"), "topk_weights_ptr": "*fp32",
                **_ids("topk_ids_ptr")}, dict(BLOCK_N=8, BLOCK_K=1024, NUM_STAGES=3)),
    KernelSpec("mla partial", _MLA, "mla_decode_partial_kernel", _MLA_PTRS, _MLA_TILES,
               num_warps=8, num_stages=2, floats=("sm_scale_log2",)),
    KernelSpec("mla partial prefetch", _MLA, "mla_decode_partial_kernel", _MLA_PTRS,
               dict(_MLA_TILES, PREFETCH_KV=True), num_warps=8, num_stages=2,
               floats=("sm_scale_log2",), early=("kv_ptr", "block_table_ptr", "seq_lens_ptr")),
    KernelSpec("mla partial_t", _MLA, "mla_decode_partial_t_kernel", _MLA_PTRS, _MLA_TILES,
               num_warps=8, num_stages=2, floats=("sm_scale_log2",)),
    KernelSpec("mla reduce", _MLA, "mla_decode_reduce_kernel",
               dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32"),
               dict(KV_RANK=512, BLOCK_C=32, BLOCK_S=128)),
    KernelSpec("mla reduce lse", _MLA, "mla_decode_reduce_kernel",
               dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32"),
               dict(KV_RANK=512, BLOCK_C=32, BLOCK_S=128, STORE_LSE=True)),
    KernelSpec("store_latent", _MLA, "store_latent_kernel",
               {**_bf16("kv_ptr", "src_ptr", "w_ptr"), "slot_ptr": "*i64"},
               dict(BLOCK_D=1024), floats=("eps",), early=("w_ptr",)),
    KernelSpec("store_kv", _MLA, "store_kv_kernel",
               {**_bf16("kv_ptr", "src_ptr"), "slot_ptr": "*i64"}, dict(BLOCK_D=1024)),
    KernelSpec("conv update", _CONV, "conv_update_kernel", _CONV_PTRS,
               dict(W=4, BLOCK_W=4, SILU=True, BLOCK_D=256, SPLIT=4096), early=("w_ptr",)),
    KernelSpec("conv varlen", _CONV, "conv_varlen_kernel",
               {**_CONV_PTRS, **_ids("cu_seqlens_ptr"), "has_init_ptr": "*u8"},
               dict(W=4, SEARCH_STEPS=2, SILU=True, BLOCK_T=8, BLOCK_D=512, SPLIT=4096)),
    KernelSpec("conv varlen state", _CONV, "conv_varlen_state_kernel",
               {**_bf16("x_ptr", "states_ptr"), **_ids("cu_seqlens_ptr", "state_idx_ptr"),
                "has_init_ptr": "*u8"}, dict(W=4, BLOCK_W=4, BLOCK_D=512)),
    KernelSpec("rms_norm_gated", "kdaserve.kernels.norm.triton_norm", "rms_norm_gated_kernel",
               _bf16("x_ptr", "g_ptr", "w_ptr", "out_ptr"), dict(BLOCK_N=1, BLOCK_D=128), num_warps=1,
               floats=("eps",), early=("w_ptr",)),
]


def order_problems(ops, early) -> list[str]:
    """What breaks the PDL contract in (op, tensor) list `ops` of a USE_PDL kernel: anything but
    a load of an `early` tensor before griddepcontrol.wait, an `early` tensor not read there
    (the prefetch is missing), launch_dependents not right after the wait."""
    before, after = split_at_wait(ops)
    bad = [f"{op} {t} before the wait" for op, t in before
           if not op.startswith("ld.global") or t not in early]
    bad += [f"{t} is not read before the wait" for t in set(early) - {t for _, t in before}]
    if not after or not after[0][0].startswith("griddepcontrol.launch_dependents"):
        bad.append(f"launch_dependents is not the first op after the wait: {after[:1]}")
    return bad


_PTX: dict = {}


def _ptx(spec: KernelSpec, use_pdl: bool | None) -> tuple[str, bool]:
    """(PTX, metadata.launch_pdl), compiled once per test session."""
    key = (spec.name, use_pdl)
    if key not in _PTX:
        k = compile_sm90(spec, use_pdl)
        _PTX[key] = (k.asm["ptx"], bool(k.metadata.launch_pdl))
    return _PTX[key]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_pdl_sm90_ptx_order(spec):
    """USE_PDL: only the immutable tensors' loads (all of them: the prefetch happens) before
    griddepcontrol.wait, no store / atomic / cp.async; launch_dependents right after it."""
    _ptxas()
    ptx, launch_pdl = _ptx(spec, True)
    assert launch_pdl
    assert order_problems(memory_ops(ptx, spec), spec.early) == []


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_no_pdl_ptx_same_traffic(spec):
    """USE_PDL off (the default): no griddepcontrol, no launch_pdl, and the same global memory
    instructions per tensor as with it on (nothing loaded twice, nothing dropped)."""
    _ptxas()
    off, launch_pdl = _ptx(spec, None)
    assert _ptx(spec, False)[0] == off, "USE_PDL=False differs from the default"
    assert not launch_pdl
    ops_off = memory_ops(off, spec)
    assert not any(op.startswith("griddepcontrol") for op, _ in ops_off)
    ops_on = [o for o in memory_ops(_ptx(spec, True)[0], spec)
              if not o[0].startswith("griddepcontrol")]
    assert Counter(ops_on) == Counter(ops_off), (Counter(ops_on) - Counter(ops_off),
                                                 Counter(ops_off) - Counter(ops_on))


def _bad_source() -> str:
    return '''
import triton
import triton.language as tl


@triton.jit
def bad_kernel(x_ptr, w_ptr, out_ptr, STORE_EARLY: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    x = tl.load(x_ptr + offs)                       # x is written by the previous kernel
    if STORE_EARLY:
        tl.store(out_ptr + offs, x)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + offs)
    tl.store(out_ptr + offs, x * w)
'''


def test_order_check_catches_early_reads_and_stores(tmp_path, monkeypatch):
    """The check fails a kernel that reads x and stores before the wait, and one whose weight
    load sits after it when it was meant to be prefetched."""
    _ptxas()
    (tmp_path / "pdl_bad_kernel.py").write_text(_bad_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    ptrs = _bf16("x_ptr", "w_ptr", "out_ptr")
    spec = KernelSpec("bad", "pdl_bad_kernel", "bad_kernel", ptrs, dict(STORE_EARLY=True))
    problems = order_problems(memory_ops(_ptx(spec, True)[0], spec), early=("w_ptr",))
    assert any("x_ptr before the wait" in p for p in problems), problems
    assert any(p.startswith("st.global") and "out_ptr" in p for p in problems), problems
    assert "w_ptr is not read before the wait" in problems, problems
    spec = replace(spec, name="bad no store", consts=dict(STORE_EARLY=False))
    ops = memory_ops(_ptx(spec, True)[0], spec)
    assert order_problems(ops, early=("x_ptr",)) == []   # as if x were a weight: fine


# ---------------------------------------------------------------------------------------------
# pdl on == pdl off, bit for bit (GPU at the 48B shapes; the interpreter at TINY)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shapes:
    hidden: int = 2304
    experts: int = 256        # routed experts; the shared expert is id `experts` (k + 1 columns)
    top_k: int = 8
    inter: int = 1024
    mla_heads: int = 32
    rank: int = 512           # kv_lora_rank
    rope: int = 64
    page: int = 64
    context: int = 4096       # tokens cached per sequence before the decode token
    kda_heads: int = 32
    head_dim: int = 128
    conv_width: int = 4
    dtype: torch.dtype = BF16


MODEL_48B = Shapes()
TINY = Shapes(hidden=64, experts=16, top_k=4, inter=32, mla_heads=16, rank=32, rope=16, page=16,
              context=40, kda_heads=4, head_dim=16, dtype=F32)


@dataclass
class Inputs:
    """One decode step's inputs and weights for M sequences (device tensors)."""
    sh: Shapes
    h: torch.Tensor            # [M, hidden]
    router_w: torch.Tensor     # [E, hidden] fp32
    bias: torch.Tensor         # [E] fp32
    w13: torch.Tensor          # [E + 1, 2I, hidden]
    w2: torch.Tensor           # [E + 1, hidden, I]
    kv: torch.Tensor           # [blocks, page, rank + rope]
    block_table: torch.Tensor  # [M, max_blocks] int32
    seq_lens: torch.Tensor     # [M] int32, the decode token included
    slots: torch.Tensor        # [M] int64, the decode token's cache slot
    kv_norm_w: torch.Tensor    # [rank]
    q: torch.Tensor            # [M, H, rank]
    q_pe: torch.Tensor         # [M, H, rope] (a strided view)
    gate: torch.Tensor         # [M * 3 * kda_heads, head_dim] (a strided view)
    o_norm_w: torch.Tensor     # [head_dim]
    conv_w: torch.Tensor       # [3P, W]
    states: torch.Tensor       # [2M + 1, 3P, W - 1]
    state_idx: torch.Tensor    # [M] int32 (-1: a padding row when M > 1)


def make_inputs(device, M: int, sh: Shapes, seed: int = 0) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0, dtype=sh.dtype):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    E, D, I, p = sh.experts, sh.hidden, sh.inter, 3 * sh.kda_heads * sh.head_dim
    kv, bt = kc.make_paged_kv(device, sh.dtype, [sh.context + 1] * M, sh.page, sh.rank + sh.rope,
                              seed=seed)
    pos = torch.full((M,), sh.context, dtype=torch.int64, device=device)
    slots = bt.long().gather(1, (pos // sh.page)[:, None])[:, 0] * sh.page + pos % sh.page
    idx = torch.randperm(2 * M + 1, generator=g, device=device)[:M].int()
    if M > 1:
        idx[-1] = -1
    return Inputs(
        sh=sh, h=rnd(M, D), router_w=rnd(E, D, scale=D ** -0.5, dtype=F32),
        bias=rnd(E, scale=0.1, dtype=F32), w13=rnd(E + 1, 2 * I, D, scale=D ** -0.5),
        w2=rnd(E + 1, D, I, scale=I ** -0.5), kv=kv, block_table=bt,
        seq_lens=torch.full((M,), sh.context + 1, dtype=torch.int32, device=device),
        slots=slots, kv_norm_w=rnd(sh.rank, scale=0.1) + 1, q=rnd(M, sh.mla_heads, sh.rank),
        q_pe=rnd(M, sh.mla_heads, sh.rope + 8)[..., 4:4 + sh.rope],
        gate=rnd(M * 3 * sh.kda_heads, sh.head_dim + 16)[:, :sh.head_dim],
        o_norm_w=rnd(sh.head_dim, scale=0.1) + 1, conv_w=rnd(p, sh.conv_width, scale=0.5),
        states=rnd(2 * M + 1, p, sh.conv_width - 1), state_idx=idx)


def assert_same(name: str, on, off) -> None:
    """Every tensor of `on` equals its twin in `off` bit for bit, and has no NaN."""
    on, off = (on, off) if isinstance(on, (tuple, list)) else ((on,), (off,))
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{name}[{i}]: {a.shape} vs {b.shape}"
        assert not (a.is_floating_point() and a.isnan().any()), f"{name}[{i}]: NaN"
        assert torch.equal(a, b), f"{name}[{i}]: pdl=True differs from pdl=False"


def check_router(inp: Inputs) -> None:
    """The decode router: the logits GEMV (fp32 out, the router's fp32 weight), the K-split
    partial logits of a few rows (bf16 rows only) and the top-k over both."""
    from kdaserve.kernels.linear.gemv import gemv
    from kdaserve.kernels.moe.router import moe_topk_sigmoid, router_partials

    sh = inp.sh
    runs = [gemv(inp.h, inp.router_w, out_dtype=F32, pdl=pdl) for pdl in (False, True)]
    assert_same("router logits gemv", runs[1], runs[0])
    if inp.h.dtype == BF16:
        parts = [router_partials(inp.h, inp.router_w, pdl=pdl) for pdl in (False, True)]
        assert_same("router partials", parts[1], parts[0])
        runs = [moe_topk_sigmoid(parts[0], inp.bias, sh.top_k, True, 2.446,
                                 extra_expert=sh.experts, pdl=pdl) for pdl in (False, True)]
        assert_same("moe_topk_sigmoid over partials", runs[1], runs[0])
    logits = inp.h.float() @ inp.router_w.T                                   # [M, E] fp32
    for bias in (inp.bias, None):
        runs = [moe_topk_sigmoid(logits, bias, sh.top_k, True, 2.446, extra_expert=sh.experts,
                                 pdl=pdl) for pdl in (False, True)]
        assert_same(f"moe_topk_sigmoid bias={bias is not None}", runs[1], runs[0])


def _routing(inp: Inputs):
    from kdaserve.kernels.moe.router import moe_topk_sigmoid

    logits = inp.h.float() @ inp.router_w.T                                   # [M, E] fp32
    return moe_topk_sigmoid(logits, inp.bias, inp.sh.top_k, True, 2.446,
                            extra_expert=inp.sh.experts)                       # [M, k + 1] each


def check_moe(inp: Inputs) -> None:
    """fused_moe with its default config (M = 1: GEMM 1 + gemm2_sum; M > 1: align, GEMM 1,
    GEMM 2, moe_sum) and with gemm2 + moe_sum at M = 1; moe_align_block_size's fields."""
    from kdaserve.kernels.moe.fused_moe import (default_config, fit_config, fused_moe,
                                                moe_align_block_size)

    sh = inp.sh
    w, ids = _routing(inp)
    M, E = inp.h.shape[0], sh.experts + 1
    cfg = fit_config(default_config(M, sh.top_k + 1, E, sh.dtype), sh.hidden, sh.inter)
    for c in (cfg, replace(cfg, gemm2_sum=None)):
        runs = [fused_moe(inp.h, inp.w13, inp.w2, w, ids, config=c, pdl=pdl)
                for pdl in (False, True)]
        assert_same(f"fused_moe M={M} gemm2_sum={c.gemm2_sum is not None}", runs[1], runs[0])
    off, on = (moe_align_block_size(ids, E, cfg.gemm1.block_m, pdl=pdl) for pdl in (False, True))
    rows = kc.align_reference(ids.reshape(-1), E, cfg.gemm1.block_m, off.max_blocks)[2]
    rows = rows.to(ids.device)
    assert_same("moe_align_block_size",
                (on.counts, on.expert_start, on.num_rows, on.expert_ids, on.sorted_ids[rows]),
                (off.counts, off.expert_start, off.num_rows, off.expert_ids, off.sorted_ids[rows]))


def _mla_configs(dtype):
    from kdaserve.kernels.mla.decode import MLADecodeConfig

    if dtype == F32:
        return (None, MLADecodeConfig(16, 16, 4, 1, transposed=True))
    return (None, MLADecodeConfig(32, 64, 8, 2, transposed=True))


def check_mla(inp: Inputs) -> None:
    """store_latent and store_kv (the cache after), mla_decode (default and transposed)."""
    from kdaserve.kernels.mla.decode import mla_decode, store_kv, store_latent

    sh = inp.sh
    ckv = inp.h[:, :sh.rank + sh.rope]                               # row-strided [M, rank+rope]
    caches = []
    for pdl in (False, True):
        kv = inp.kv.clone()
        store_latent(kv, inp.slots, ckv, inp.kv_norm_w, 1e-6, pdl=pdl)
        caches.append(kv)
    assert_same("store_latent", caches[1], caches[0])
    caches = []
    for pdl in (False, True):
        kv = inp.kv.clone()
        store_kv(kv, inp.slots, ckv, pdl=pdl)
        caches.append(kv)
    assert_same("store_kv", caches[1], caches[0])
    scale = (sh.rank // 4 + sh.rope) ** -0.5
    for cfg in _mla_configs(sh.dtype):
        runs = [mla_decode(inp.q, inp.kv, inp.block_table, inp.seq_lens, scale, sh.rank,
                           config=cfg, q_pe=inp.q_pe, pdl=pdl) for pdl in (False, True)]
        assert_same(f"mla_decode cfg={cfg}", runs[1], runs[0])
        if cfg is None or not cfg.transposed:   # the first cache tile read before the wait
            early = mla_decode(inp.q, inp.kv, inp.block_table, inp.seq_lens, scale, sh.rank,
                               config=cfg, q_pe=inp.q_pe, pdl=True, prefetch_kv=True)
            assert_same(f"mla_decode prefetch_kv cfg={cfg}", early, runs[0])


def check_conv(inp: Inputs) -> None:
    """causal_conv1d_update into split planes (as the KDA layer calls it) and a 2-token-per-
    sequence causal_conv1d_varlen; outputs and state slots."""
    from kdaserve.kernels.conv.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen

    M, p = inp.h.shape[0], inp.conv_w.shape[0]
    dev = inp.h.device
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(2 * M, p + 32, generator=g, device=dev).to(inp.sh.dtype)[:, :p]  # [2M, 3P]
    cu = torch.arange(0, 2 * M + 1, 2, dtype=torch.int32, device=dev)                  # [M + 1]
    has = torch.arange(M, device=dev) % 2 == 0
    for name in ("update", "varlen"):
        runs = []
        for pdl in (False, True):
            states = inp.states.clone()
            if name == "update":
                out = x.new_empty(3, M, p // 3)
                causal_conv1d_update(x[:M], inp.conv_w, states, inp.state_idx, out=out, pdl=pdl)
            else:
                out = causal_conv1d_varlen(x, inp.conv_w, cu, states, inp.state_idx, has,
                                           pdl=pdl)
            runs.append((out, states))
        assert_same(f"causal_conv1d_{name}", runs[1], runs[0])


def check_gated_norm(inp: Inputs) -> None:
    from kdaserve.kernels.norm.rms_norm import rms_norm_gated

    sh = inp.sh
    o = inp.q.reshape(-1)[:inp.gate.numel()].view(-1, sh.head_dim)   # like gate
    runs = [rms_norm_gated(o, inp.gate, inp.o_norm_w, 1e-6, pdl=pdl) for pdl in (False, True)]
    assert_same("rms_norm_gated", runs[1], runs[0])


def check_chain(inp: Inputs) -> None:
    """decode_chain eagerly: outputs and the mutated cache / conv states."""
    kv0, st0 = inp.kv.clone(), inp.states.clone()
    runs = []
    for pdl in (False, True):
        inp.kv.copy_(kv0)
        inp.states.copy_(st0)
        runs.append(decode_chain(inp, pdl) + [inp.kv.clone(), inp.states.clone()])
    assert_same("decode_chain", runs[1], runs[0])


CHECKS = (check_router, check_moe, check_mla, check_conv, check_gated_norm, check_chain)


def run_interpreter_suite() -> None:
    """The eager checks at TINY in fp32 on the CPU (pdl is ignored there: this runs the test
    code and the wrappers' pdl keyword, not PDL)."""
    kc.patch_triton_interpreter()
    for M in (1, 4):
        inp = make_inputs("cpu", M, TINY, seed=M)
        for check in CHECKS:
            check(inp)


def test_interpreter_suite():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("test_pdl_kernels.py", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pdl interpreter suite passed" in proc.stdout


@gpu
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("M", [1, 4])
def test_pdl_matches_gpu(check, M):
    """Each wrapper: pdl=True equals pdl=False bit for bit at the 48B decode shapes."""
    check(make_inputs("cuda", M, MODEL_48B, seed=M))


def decode_chain(inp: Inputs, pdl: bool, layers: int = 2) -> list[torch.Tensor]:
    """A decode step's kernel sequence, each kernel reading the previous one's output: router
    logits (cuBLAS in layer 0, the gemv after) -> top-k -> fused MoE -> store_latent of its
    first rank + rope columns -> MLA decode over the cache -> gated RMSNorm of the first
    3P / head_dim rows of the MLA output -> conv update of them as [M, 3P] -> its first plane's
    first `hidden` columns feed the next layer.
    Mutates inp.kv and inp.states. Returns every layer's outputs."""
    from kdaserve.kernels.conv.causal_conv1d import causal_conv1d_update
    from kdaserve.kernels.linear.gemv import gemv
    from kdaserve.kernels.mla.decode import mla_decode, store_latent
    from kdaserve.kernels.moe.fused_moe import fused_moe
    from kdaserve.kernels.moe.router import moe_topk_sigmoid
    from kdaserve.kernels.norm.rms_norm import rms_norm_gated

    sh, h, outs = inp.sh, inp.h, []
    M, p = h.shape[0], inp.conv_w.shape[0]
    route = (inp.bias, sh.top_k, True, 2.446)
    for layer in range(layers):
        if layer == 0:
            logits = torch.nn.functional.linear(h.float(), inp.router_w)          # [M, E]
        else:
            logits = gemv(h, inp.router_w, out_dtype=F32, pdl=pdl)               # [M, E]
        w, ids = moe_topk_sigmoid(logits, *route, extra_expert=sh.experts, pdl=pdl)
        y = fused_moe(h, inp.w13, inp.w2, w, ids, pdl=pdl)                        # [M, hidden]
        store_latent(inp.kv, inp.slots, y[:, :sh.rank + sh.rope], inp.kv_norm_w, 1e-6, pdl=pdl)
        o = mla_decode(inp.q, inp.kv, inp.block_table, inp.seq_lens, 0.07, sh.rank,
                       q_pe=inp.q_pe, pdl=pdl)                                    # [M, H, rank]
        normed = rms_norm_gated(o.view(-1, sh.head_dim)[:inp.gate.shape[0]], inp.gate,
                                inp.o_norm_w, 1e-6, pdl=pdl)       # [M * 3P / head_dim, head_dim]
        x = normed.view(M, p)                                                     # [M, 3P]
        planes = causal_conv1d_update(x, inp.conv_w, inp.states, inp.state_idx, pdl=pdl,
                                      out=torch.empty(3, M, p // 3, dtype=h.dtype,
                                                      device=h.device))
        h = planes[0][:, :sh.hidden]                                              # [M, hidden]
        outs += [w, ids, y, o, normed, planes]
    return outs


@gpu
@pytest.mark.parametrize("M", [1, 4])
def test_pdl_chain_in_cuda_graph_gpu(M):
    """decode_chain captured with PDL launches: every replay (from the same cache and conv
    states) equals the eager pdl=False chain bit for bit, and a replay after new inputs reads
    them."""
    inp = make_inputs("cuda", M, MODEL_48B, seed=10 + M)
    kv0, st0 = inp.kv.clone(), inp.states.clone()

    def reset():
        inp.kv.copy_(kv0)
        inp.states.copy_(st0)

    def eager_want():
        reset()
        want = decode_chain(inp, pdl=False) + [inp.kv.clone(), inp.states.clone()]
        reset()
        return want

    want = eager_want()
    graph, outs = kc.capture_graph(lambda: decode_chain(inp, pdl=True), before_capture=reset)
    for _ in range(3):
        reset()
        graph.replay()
        torch.cuda.synchronize()
        assert_same("graph replay", outs + [inp.kv, inp.states], want)
    g = torch.Generator(device="cuda").manual_seed(99)
    inp.h.copy_(torch.randn(inp.h.shape, generator=g, device="cuda").to(inp.h.dtype))
    inp.q.copy_(torch.randn(inp.q.shape, generator=g, device="cuda").to(inp.q.dtype))
    want = eager_want()
    graph.replay()
    torch.cuda.synchronize()
    assert_same("graph replay after new inputs", outs + [inp.kv, inp.states], want)


if __name__ == "__main__":
    run_interpreter_suite()
    print("pdl interpreter suite passed")
