"""Fused KDA decode (kdaserve.kernels.kda.decode_fused) vs its fp32 twin and vs the layer's
unfused path (KimiDeltaAttention.forward: conv update -> bmm -> kda_gate + kda_recurrent ->
rms_norm_gated; on CUDA: causal_conv1d_update, torch.bmm, fla's fused_recurrent_kda_fwd and the
Triton rms_norm_gated).

Run as a script with TRITON_INTERPRET=1 (test_interpreter_checks does): the fp32 interpreter
checks. On the CPU without the interpreter: the twin against the layer, input errors, and the
kernel compiled for sm_90 (register spills, PDL instruction order). GPU tests (marked gpu): the
Kimi-Linear-48B shapes in bf16, pdl on == off bit for bit, and inside a captured CUDA graph.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import kernel_checks as kc
from kdaserve.kernels.kda.decode_fused import (gate_projections, kda_decode_fused,
                                               kda_decode_fused_reference)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, F32 = torch.bfloat16, torch.float32
STATE_BOUND = 1e-4   # fp32 state from identical inputs (kernel vs twin)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _gate_params(H: int, d: int, g: torch.Generator, device) -> tuple:
    """The model's A_log / dt_bias init (make_model.py): A = U(1, 16), dt = logU(1e-3, 0.1)."""
    A_log = torch.empty(1, 1, H, 1).uniform_(1.0, 16.0, generator=g).log()
    dt = torch.empty(H * d).uniform_(-6.9, -2.3, generator=g).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return A_log.to(device), dt_bias.to(device)


def make_inputs(device, dtype, H, d, W, slots, num_slots, seed=0, idx_dtype=torch.int32,
                row_pad=7, layer_conv_view=True, k3=False) -> dict:
    """Keyword arguments of kda_decode_fused: random activations in a row-strided proj, the
    engine's cache layouts (conv cache in proj's dtype, fp32 states), fp32 A_log / dt_bias.
    k3: Kimi K3's full-rank output gate in proj, f_b alone, the decay bounded at -5."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    P, N = H * d, len(slots)
    width = 4 * P + d + H if k3 else 3 * P + 2 * d + H
    conv_w = rnd(3 * P, 1, W, scale=0.5)[:, 0] if layer_conv_view else rnd(3 * P, W, scale=0.5)
    A_log, dt_bias = _gate_params(H, d, g, device)
    return dict(proj=rnd(N, width + row_pad)[:, :width],          # [N, 3P + 2d + H], strided
                conv_weight=conv_w,                                # [3P, W]
                conv_cache=rnd(num_slots, 3 * P, W - 1),           # [slots, 3P, W-1]
                rec_cache=rnd(num_slots, H, d, d, scale=0.1, dt=F32),
                state_indices=torch.tensor(slots, dtype=idx_dtype, device=device),
                fg_b_weight=rnd(1 if k3 else 2, P, d, scale=d ** -0.5),
                A_log=A_log, dt_bias=dt_bias, o_norm_weight=rnd(d, scale=0.1) + 1,
                eps=1e-5, num_heads=H, head_dim=d,
                **(dict(lower_bound=-5.0, full_rank_gate=True) if k3 else {}))


def fresh_caches(inp: dict) -> dict:
    return dict(inp, conv_cache=inp["conv_cache"].clone(), rec_cache=inp["rec_cache"].clone())


def assert_untouched(name, after, before, slots):
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[[s for s in slots if s >= 0]] = False
    assert torch.equal(after[keep], before[keep]), f"{name}: a slot no row owns changed"


# ---------------------------------------------------------------------------------------------
# Checks (interpreter and GPU)
# ---------------------------------------------------------------------------------------------


def check_against_twin(device, dtype, H, d, W, slots, num_slots, seed=0, pdl=False,
                       v_block=None, prefetch_state=False, gates=False,
                       **kw):
    """Kernel vs kda_decode_fused_reference: output, conv windows (exact: they hold copied
    inputs), states; slots no row owns (and those of rows < 0) stay bit-identical; the
    per-head tickets end at zero (two launches in a row: the second must start from them).
    gates: the gate projections computed beforehand (gate_projections) and passed to both."""
    inp = make_inputs(device, dtype, H, d, W, slots, num_slots, seed=seed, **kw)
    if gates:
        inp["gates"] = gate_projections(inp["proj"], inp["fg_b_weight"], H, d,
                                        inp.get("full_rank_gate", False))
    got, want = fresh_caches(inp), fresh_caches(inp)
    tickets = torch.zeros(len(slots) * H + 3, dtype=torch.int32, device=device)
    out = kda_decode_fused(**got, pdl=pdl, v_block=v_block, tickets=tickets,
                           prefetch_state=prefetch_state)
    ref_out = kda_decode_fused_reference(**want)
    where = f"H={H} d={d} W={W} slots={slots} v_block={v_block} gates={gates} {dtype}"
    assert not tickets.any(), f"tickets not reset {where}: {tickets.tolist()}"
    assert out.shape == (len(slots), H * d) and out.dtype == dtype, where
    kc.assert_close(f"output {where}", out, ref_out, dtype)
    assert torch.equal(got["conv_cache"], want["conv_cache"]), f"conv windows differ {where}"
    live = [s for s in slots if s >= 0]
    if live:
        err = kc.rel_err(got["rec_cache"][live], want["rec_cache"][live])
        assert err <= STATE_BOUND, f"state {where}: relative error {err:.2e}"
    assert_untouched("conv_cache", got["conv_cache"], inp["conv_cache"], slots)
    assert_untouched("rec_cache", got["rec_cache"], inp["rec_cache"], slots)
    if live:
        assert not torch.equal(got["rec_cache"], inp["rec_cache"]), "no state was written"
    again, want2 = fresh_caches(got), fresh_caches(want)          # a second step, same tickets
    out2 = kda_decode_fused(**dict(again, proj=inp["proj"]), pdl=pdl, v_block=v_block,
                            tickets=tickets, prefetch_state=prefetch_state)
    ref2 = kda_decode_fused_reference(**dict(want2, proj=inp["proj"]))
    kc.assert_close(f"second step output {where}", out2, ref2, dtype)
    assert torch.equal(again["conv_cache"], want2["conv_cache"]), f"second step windows {where}"


def make_layer(H, d, W, hidden, device, dtype, seed=0, k3=False):
    """A KimiDeltaAttention with random weights (fp32 A_log / dt_bias, as the loader keeps);
    k3: Kimi K3's full-rank output gate and the decay bounded at -5."""
    from kdaserve.layers.kda import KimiDeltaAttention
    from kdaserve.config.model_args import KimiLinearArgs

    args = KimiLinearArgs(vocab_size=16, hidden_size=hidden, num_hidden_layers=1,
                          layer_types=["linear_attention"], mlp_layer_types=["dense"],
                          linear_num_heads=H, linear_head_dim=d, linear_conv_kernel_dim=W,
                          **(dict(kda_full_rank_gate=True, gate_lower_bound=-5.0) if k3
                             else {}))
    g = torch.Generator().manual_seed(seed)
    layer = KimiDeltaAttention(args, kda_index=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=g) * 0.5)
        layer.o_norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
    layer = layer.to(device=device, dtype=dtype)
    A_log, dt_bias = _gate_params(H, d, g, device)
    layer.forget_gate.A_log.data, layer.forget_gate.dt_bias.data = A_log, dt_bias
    layer.process_weights_after_loading()
    return layer


def fused_layer(layer, proj, conv_cache, rec_cache, state_indices, pdl=False):
    """The layer's decode from proj with the fused kernel: o [N, P]."""
    return kda_decode_fused(proj, layer.conv1d.weight[:, 0], conv_cache, rec_cache,
                            state_indices, layer.fg_b_weight, layer.forget_gate.A_log,
                            layer.forget_gate.dt_bias, layer.o_norm.weight, layer.o_norm.eps,
                            layer.num_heads, layer.head_dim,
                            lower_bound=layer.forget_gate.lower_bound, pdl=pdl,
                            full_rank_gate=layer.full_rank_gate)


def check_against_layer(device, dtype, H, d, W, hidden, slots, num_slots, seed=0,
                        state_bound=STATE_BOUND, k3=False):
    """KimiDeltaAttention.forward (the unfused path, decode rows) vs linear -> fused kernel ->
    o_proj on the same input and caches: layer output, conv windows (exact), states."""
    from kdaserve.attention.builder import build_metadata
    from kdaserve.attention.forward_context import ForwardContext
    from kdaserve.attention.metadata import ModelCaches
    from kdaserve.layers.linear import linear

    layer = make_layer(H, d, W, hidden, device, dtype, seed, k3)
    g = torch.Generator().manual_seed(seed + 1)
    N = len(slots)
    x = torch.randn(N, hidden, generator=g).to(device=device, dtype=dtype)
    conv = torch.randn(num_slots, 3 * H * d, W - 1, generator=g).to(device=device, dtype=dtype)
    rec = (torch.randn(num_slots, H, d, d, generator=g) * 0.1).to(device)
    md = build_metadata([1] * N, [5 + i for i in range(N)], [[0]] * N, slots, 16, device)
    assert md.num_decodes == N
    caches = ModelCaches(mla_kv=[], kda_recurrent=[rec.clone()], kda_conv=[conv.clone()])
    with torch.no_grad():
        want = layer(x, ForwardContext(md, caches))                       # [N, hidden]
        conv_f, rec_f = conv.clone(), rec.clone()
        o = fused_layer(layer, linear(x, layer.in_weight), conv_f, rec_f, md.state_indices)
        got = linear(o, layer.o_proj.weight)                              # [N, hidden]
    where = f"layer H={H} d={d} W={W} slots={slots} {dtype} k3={k3}"
    kc.assert_close(f"{where} output", got, want, dtype)
    assert torch.equal(conv_f, caches.kda_conv[0]), f"{where}: conv windows differ"
    err = kc.rel_err(rec_f[slots], caches.kda_recurrent[0][slots])    # the written slots
    assert err <= state_bound, f"{where}: state relative error {err:.2e} > {state_bound:.0e}"
    assert_untouched("rec_cache", rec_f, rec, slots)


def run_interpreter_checks() -> None:
    """fp32 through the CPU interpreter: strided proj rows, distinct slots, the scratch slot
    (the pool's last row, as CUDA-graph padding rows use), a row < 0, W = 2, odd H."""
    kc.patch_triton_interpreter()
    check_against_twin("cpu", F32, H=2, d=16, W=4, slots=[3, 0, 6, 7], num_slots=8)
    check_against_twin("cpu", F32, H=2, d=16, W=4, slots=[5, -1, 2], num_slots=8, seed=1)
    check_against_twin("cpu", F32, H=3, d=8, W=2, slots=[1, 4], num_slots=5, seed=2,
                       idx_dtype=torch.int64, row_pad=0, layer_conv_view=False)
    check_against_twin("cpu", F32, H=1, d=32, W=3, slots=[0], num_slots=2, seed=3)
    # several programs per head: the v split, the ticket election, the q / k window shift
    check_against_twin("cpu", F32, H=2, d=16, W=4, slots=[3, 0, 7], num_slots=8, v_block=4)
    check_against_twin("cpu", F32, H=3, d=32, W=4, slots=[5, -1], num_slots=8, seed=5,
                       v_block=8)
    check_against_twin("cpu", F32, H=2, d=16, W=2, slots=[1], num_slots=3, seed=6, v_block=8)
    check_against_twin("cpu", F32, H=2, d=16, W=4, slots=[3, -1, 7], num_slots=8, seed=7,
                       v_block=4, pdl=True, prefetch_state=True)
    check_against_layer("cpu", F32, H=2, d=16, W=4, hidden=40, slots=[3, 0, 6, 7], num_slots=8)
    check_against_layer("cpu", F32, H=3, d=8, W=2, hidden=24, slots=[2], num_slots=3, seed=4)
    # Kimi K3: the full-rank output gate read from proj, the bounded decay
    check_against_twin("cpu", F32, H=2, d=16, W=4, slots=[3, -1, 6], num_slots=8, seed=8,
                       k3=True)
    check_against_twin("cpu", F32, H=3, d=16, W=4, slots=[1, 4], num_slots=6, seed=9,
                       v_block=4, pdl=True, prefetch_state=True, k3=True)
    check_against_layer("cpu", F32, H=2, d=16, W=4, hidden=40, slots=[3, 0, 6], num_slots=8,
                        seed=10, k3=True)
    # the gate projections computed beforehand (many-row steps)
    check_against_twin("cpu", F32, H=2, d=16, W=4, slots=[3, -1, 6, 0], num_slots=8, seed=11,
                       v_block=8, gates=True)
    check_against_twin("cpu", F32, H=2, d=16, W=4, slots=[3, 5], num_slots=8, seed=12,
                       v_block=4, pdl=True, prefetch_state=True, gates=True, k3=True)
    # with gates the head is finished by a second launch (the norm, the q / k window shift)
    check_against_twin("cpu", F32, H=3, d=16, W=2, slots=[1, 4], num_slots=6, seed=14,
                       v_block=8, pdl=True, prefetch_state=True, gates=True)
    check_against_twin("cpu", F32, H=2, d=16, W=4, slots=[3, -1, 6], num_slots=8, seed=15,
                       v_block=4, gates=True, k3=True)


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


def test_interpreter_checks():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter(Path(__file__).name, timeout=120)
    assert proc.returncode == 0 and "passed" in proc.stdout, proc.stdout + proc.stderr


def test_reference_matches_the_layer_cpu():
    """The twin alone (no Triton): the layer's CPU path through linear -> twin -> o_proj."""
    from kdaserve.attention.builder import build_metadata
    from kdaserve.attention.forward_context import ForwardContext
    from kdaserve.attention.metadata import ModelCaches
    from kdaserve.layers.linear import linear

    H, d, W, hidden, slots = 2, 16, 4, 40, [3, 0, 6]
    layer = make_layer(H, d, W, hidden, "cpu", F32, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, hidden, generator=g)
    conv = torch.randn(7, 3 * H * d, W - 1, generator=g)
    rec = torch.randn(7, H, d, d, generator=g) * 0.1
    md = build_metadata([1] * 3, [4, 4, 4], [[0]] * 3, slots, 16, "cpu")
    caches = ModelCaches(mla_kv=[], kda_recurrent=[rec.clone()], kda_conv=[conv.clone()])
    with torch.no_grad():
        want = layer(x, ForwardContext(md, caches))
        o = kda_decode_fused_reference(linear(x, layer.in_weight), layer.conv1d.weight[:, 0],
                                       conv, rec, md.state_indices, layer.fg_b_weight,
                                       layer.forget_gate.A_log, layer.forget_gate.dt_bias,
                                       layer.o_norm.weight, layer.o_norm.eps, H, d)
        got = linear(o, layer.o_proj.weight)
    kc.assert_close("twin vs layer", got, want, F32)
    assert torch.equal(conv, caches.kda_conv[0])
    kc.assert_close("twin state vs layer", rec, caches.kda_recurrent[0], F32)


def _bad(**changes) -> dict:
    inp = make_inputs("cpu", F32, H=2, d=16, W=4, slots=[0, 1], num_slots=3)
    inp.update(changes)
    return inp


@pytest.mark.parametrize("changes,match", [
    (dict(lower_bound=-6.0), "lower_bound must be None or in \\[-5, 0\\), got -6.0"),
    (dict(lower_bound=0.0), "got 0.0"),
    (dict(full_rank_gate=True), "proj must be \\[N, 4P \\+ d \\+ H = 146\\]"),
    (dict(head_dim=12), "head_dim must be a power of two in \\[8, 128\\], got 12"),
    (dict(head_dim=256), "got 256"),
    (dict(rec_cache=torch.zeros(3, 2, 16, 32)), "rec_cache K=16 != V=32"),
    (dict(rec_cache=torch.zeros(3, 2, 8, 8)), "rec_cache must be \\[3, 2, 16, 16\\]"),
    (dict(rec_cache=torch.zeros(3, 2, 16, 16, dtype=BF16)), "rec_cache must be fp32"),
    (dict(proj=torch.zeros(2, 100)), "proj must be \\[N, 3P \\+ 2d \\+ H = 130\\]"),
    (dict(proj=torch.zeros(130, 2).t()), "proj must have a contiguous last dim"),
    (dict(proj=torch.zeros(2, 130, dtype=torch.int32)), "proj dtype torch.int32"),
    (dict(conv_weight=torch.zeros(96, 1)), "conv_weight must be \\[3P = 96, W >= 2\\]"),
    (dict(conv_cache=torch.zeros(3, 96, 4)), "conv_cache must be \\[3, 96, 3\\]"),
    (dict(state_indices=torch.zeros(3, dtype=torch.int32)), "state_indices must be \\[2\\]"),
    (dict(state_indices=torch.zeros(2)), "state_indices must be int32 or int64"),
    (dict(fg_b_weight=torch.zeros(2, 32, 8)), "fg_b_weight must be \\[2, 32, 16\\]"),
    (dict(A_log=torch.zeros(3)), "A_log must have H=2 elements"),
    (dict(dt_bias=torch.zeros(16)), "dt_bias must have P=32 elements"),
    (dict(o_norm_weight=torch.zeros(32)), "o_norm_weight must be \\[16\\]"),
    (dict(out=torch.zeros(2, 32, dtype=BF16)), "out must be torch.float32"),
    (dict(num_warps=3), "num_warps must be a power of two in \\[1, 16\\], got 3"),
])
def test_bad_inputs_name_the_value(changes, match):
    with pytest.raises(ValueError, match=match):
        kda_decode_fused(**_bad(**changes))


def test_reference_refuses_a_bound_out_of_range():
    with pytest.raises(ValueError, match="lower_bound must be None or in"):
        kda_decode_fused_reference(**_bad(lower_bound=0.5))


def test_k3_fg_b_weight_is_f_b_alone():
    inp = make_inputs("cpu", F32, H=2, d=16, W=4, slots=[0, 1], num_slots=3, k3=True)
    with pytest.raises(ValueError, match="fg_b_weight must be \\[1, 32, 16\\]"):
        kda_decode_fused(**dict(inp, fg_b_weight=torch.zeros(2, 32, 16)))


def test_cpu_tensors_need_the_interpreter():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter mode accepts CPU tensors")
    with pytest.raises(ValueError, match="CUDA"):
        kda_decode_fused(**_bad())


# ---------------------------------------------------------------------------------------------
# sm_90 compile (no GPU needed)
# ---------------------------------------------------------------------------------------------

# Kimi-Linear-48B: bf16 activations and weights, fp32 states / A_log / dt_bias; unit strides are
# constexpr (the JIT specializes them), the others i32.
SM90_TYPES = dict(proj_ptr="*bf16", conv_w_ptr="*bf16", conv_ptr="*bf16", rec_ptr="*fp32",
                  idx_ptr="*i32", fgb_ptr="*bf16", a_log_ptr="*fp32", dt_bias_ptr="*fp32",
                  norm_w_ptr="*bf16", out_ptr="*bf16", o_part_ptr="*fp32",
                  ss_part_ptr="*fp32", ticket_ptr="*i32", P="i32", eps="fp32", scale="fp32",
                  stride_pn="i32", stride_on="i32", stride_wd="i32", stride_cs="i32",
                  stride_cd="i32", stride_rs="i32", stride_rh="i32", stride_rk="i32",
                  stride_fg="i32", stride_fp="i32", graw_ptr="*bf16", gout_ptr="*bf16",
                  stride_gr="i32", stride_go="i32")
SM90_CONSTS = dict(D=128, W=4, BW=4, BV=32, stride_wj=1, stride_cj=1, stride_rv=1)
WEIGHT_PARAMS = {"conv_w_ptr", "fgb_ptr", "a_log_ptr", "dt_bias_ptr", "norm_w_ptr"}


def _ptxas() -> Path:
    triton = pytest.importorskip("triton")
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not path.exists():
        pytest.skip("triton's bundled ptxas is missing")
    return path


K3_CONSTS = dict(FULL_RANK_GATE=True, LOWER_BOUND=-5.0)
"""Kimi K3's variant: the full-rank output gate read from proj, the bounded decay."""


def _compile(use_pdl: bool, num_warps: int = 8, k3: bool = False, **consts):
    import gemv_checks as gc
    from kdaserve.kernels.kda.triton_decode_fused import kda_decode_fused_kernel

    return gc.sm90_compile(kda_decode_fused_kernel, SM90_TYPES,
                           dict(SM90_CONSTS, USE_PDL=use_pdl, **(K3_CONSTS if k3 else {}),
                                **consts), num_warps=num_warps, launch_pdl=use_pdl)


_REG = re.compile(r"%[a-z]+\d+")


def global_ops_with_params(ptx: str, names: list[str | None]) -> list[tuple[str, set[str]]]:
    """Every global load / store and griddepcontrol of a PTX listing in program order, with the
    kernel pointer parameters its address derives from (a backward slice over the registers;
    a loaded value carries the parameters of its address, e.g. a state slot from idx_ptr)."""
    src: dict[str, set[str]] = {}
    ops = []
    for raw in ptx.splitlines():
        line = re.sub(r"^@!?%p\d+\s+", "", raw.split("//")[0].strip()).rstrip(";").strip()
        param = re.match(r"ld\.param\.\w+\s+(%\w+),\s*\[\w+_param_(\d+)\]", line)
        if param:
            i = int(param[2])
            src[param[1]] = {names[i]} if i < len(names) and names[i] else set()
            continue
        if line.startswith(("ld.global", "st.global", "griddepcontrol")):
            addr = re.search(r"\[\s*(%\w+)", line)
            params = set(src.get(addr[1], set())) if addr else set()
            ops.append((line.split()[0], params))
            if line.startswith("ld.global"):
                for reg in _REG.findall(line.split("[")[0]):
                    src[reg] = params
            continue
        regs = _REG.findall(line)
        if len(regs) >= 2 and not line.startswith(("st.", "bar", "setp", "@")):
            src[regs[0]] = src.get(regs[0], set()).union(*(src.get(r, set()) for r in regs[1:]))
    return ops


def _param_names() -> list[str | None]:
    """The kernel's PTX parameters in order (its non-constexpr arguments): the pointer
    names, None for the scalars."""
    from kdaserve.kernels.kda.triton_decode_fused import kda_decode_fused_kernel

    return [n if SM90_TYPES[n].startswith("*") else None
            for n in kda_decode_fused_kernel.arg_names if n in SM90_TYPES]


@pytest.mark.parametrize("k3", [False, True])
def test_pdl_sm90_only_weights_before_the_wait(k3):
    """Compiled for sm_90: every global load before griddepcontrol.wait reads a weight (conv
    taps, f_b / g_b rows (f_b alone for K3), A_log, dt_bias, norm weight: all five are
    prefetched); nothing is stored before it; launch_dependents follows the wait; proj (K3:
    the output gate with it), the state index and both caches are read after it, and only the
    caches and the output are written."""
    _ptxas()
    k = _compile(use_pdl=True, k3=k3)
    assert k.metadata.launch_pdl
    ops = global_ops_with_params(k.asm["ptx"], _param_names())
    waits = [i for i, (op, _) in enumerate(ops) if op == "griddepcontrol.wait"]
    assert len(waits) == 1, ops
    before, after = ops[:waits[0]], ops[waits[0] + 1:]
    assert all(op.startswith("ld.global") for op, _ in before), before
    assert all(p and p <= WEIGHT_PARAMS for _, p in before), before
    assert set().union(*(p for _, p in before)) == WEIGHT_PARAMS, before
    assert after[0][0] == "griddepcontrol.launch_dependents", after[:2]
    read_after = set().union(*(p for op, p in after if op.startswith("ld.global")))
    assert {"proj_ptr", "idx_ptr", "conv_ptr", "rec_ptr"} <= read_after, read_after
    written = set().union(*(p for op, p in after if op.startswith("st.global")))
    assert written - {"idx_ptr"} == {"conv_ptr", "rec_ptr", "out_ptr", "o_part_ptr",
                                     "ss_part_ptr"}, written


def test_norm_kernel_pdl_sm90_reads_after_the_wait():
    """kda_decode_norm_kernel under PDL: griddepcontrol.wait before every global load and
    store (each input is the decode kernel's output or a cache it writes), then
    launch_dependents; it writes the output and the conv windows only."""
    _ptxas()
    import gemv_checks as gc
    from kdaserve.kernels.kda.triton_decode_fused import kda_decode_norm_kernel

    types = {n: SM90_TYPES.get(n, "fp32" if n == "eps" else "i32")
             for n in kda_decode_norm_kernel.arg_names
             if n not in ("D", "W", "BW", "SPLITS", "USE_PDL")}
    types.update(o_part_ptr="*fp32", ss_part_ptr="*fp32")
    k = gc.sm90_compile(kda_decode_norm_kernel, types,
                        dict(D=128, W=4, BW=4, SPLITS=2, USE_PDL=True, stride_cj=1),
                        num_warps=4, launch_pdl=True)
    names = [n if types[n].startswith("*") else None
             for n in kda_decode_norm_kernel.arg_names if n in types]
    ops = global_ops_with_params(k.asm["ptx"], names)
    assert [op for op, _ in ops[:2]] == ["griddepcontrol.wait",
                                         "griddepcontrol.launch_dependents"], ops[:3]
    written = set().union(*(p for op, p in ops if op.startswith("st.global")))
    assert written - {"idx_ptr"} == {"out_ptr", "conv_ptr"}, written


def test_pdl_sm90_prefetch_state_order():
    """PREFETCH_STATE: the state index and both caches join the weights before the wait (all
    read there), still nothing stored before it; proj is read after it."""
    _ptxas()
    import gemv_checks as gc
    from kdaserve.kernels.kda.triton_decode_fused import kda_decode_fused_kernel

    k = gc.sm90_compile(kda_decode_fused_kernel, SM90_TYPES,
                        dict(SM90_CONSTS, USE_PDL=True, PREFETCH_STATE=True), num_warps=8,
                        launch_pdl=True)
    ops = global_ops_with_params(k.asm["ptx"], _param_names())
    waits = [i for i, (op, _) in enumerate(ops) if op == "griddepcontrol.wait"]
    assert len(waits) == 1, ops
    before, after = ops[:waits[0]], ops[waits[0] + 1:]
    early = WEIGHT_PARAMS | {"idx_ptr", "conv_ptr", "rec_ptr"}
    assert all(op.startswith("ld.global") and p and p <= early for op, p in before), before
    assert set().union(*(p for _, p in before)) == early, before
    assert after[0][0] == "griddepcontrol.launch_dependents", after[:2]
    assert "proj_ptr" in set().union(*(p for op, p in after if op.startswith("ld.global")))
    assert "proj_ptr" not in set().union(*(p for _, p in before))


def test_no_pdl_ptx_has_no_griddepcontrol():
    _ptxas()
    k = _compile(use_pdl=False)
    assert not k.metadata.launch_pdl and "griddepcontrol" not in k.asm["ptx"]


@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("k3", [False, True])
@pytest.mark.parametrize("tile", ["one row", "rows", "gates in"])
def test_sm90_no_register_spills_at_48b_shapes(use_pdl, k3, tile, tmp_path):
    """d = 128 with the default 8 warps: the [128, 128] fp32 state plus the two bf16 gate
    tiles (K3: f_b alone) fit in registers (ptxas -v: no spill stores or loads), at 32 value
    columns a program (1-2 rows), at 64 (3-15 rows), and with the gates computed beforehand
    at 64 columns and 4 warps, the head finished by the norm launch (16 rows and more)."""
    ptxas = _ptxas()
    consts = {"one row": dict(), "rows": dict(BV=64),
              "gates in": dict(num_warps=4, BV=64, GATES_IN=True)}[tile]
    k = _compile(use_pdl=use_pdl, k3=k3, **consts)
    (tmp_path / "k.ptx").write_text(k.asm["ptx"])
    res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in res.stderr, res.stderr


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

H48, D48, W48, HIDDEN48 = 32, 128, 4, 2304
SLOTS = {1: [5], 4: [2, 7, 0, 8]}   # 8 = the scratch row (last) of a 9-row pool


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [1, 4])
def test_matches_twin_gpu(N):
    for v_block in (None, 16, 64, 128):   # the default split (32 at N=1, 64 at N=4) and others
        check_against_twin("cuda", BF16, H48, D48, W48, SLOTS[N], num_slots=9, seed=N,
                           v_block=v_block)
    check_against_twin("cuda", BF16, H48, D48, W48, SLOTS[N][:-1] + [-1], num_slots=9)
    check_against_twin("cuda", F32, H48, D48, W48, SLOTS[N], num_slots=9, seed=N + 1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [16, 64])
def test_gates_in_matches_twin_gpu(N):
    """Batch-size steps take the gate projections from one GEMM (the layer does from
    GATE_GEMM_MIN_ROWS rows): the kernel with them against the twin with the same gates, in
    bf16 and fp32, the K3 variant too; and close to the in-kernel gates."""
    slots = list(range(N - 1)) + [N + 2]
    for dtype in (BF16, F32):
        check_against_twin("cuda", dtype, H48, D48, W48, slots, num_slots=N + 3, seed=N,
                           gates=True)
        check_against_twin("cuda", dtype, H48, D48, W48, slots, num_slots=N + 3, seed=N,
                           gates=True, pdl=True, prefetch_state=True, v_block=32)
    check_against_twin("cuda", BF16, 16, D48, W48, slots, num_slots=N + 3, seed=N + 1,
                       gates=True, k3=True, pdl=True, prefetch_state=True)
    inp = make_inputs("cuda", BF16, H48, D48, W48, slots, num_slots=N + 3, seed=N)
    a, b = fresh_caches(inp), fresh_caches(inp)
    with_gates = kda_decode_fused(**a, gates=gate_projections(inp["proj"], inp["fg_b_weight"],
                                                              H48, D48))
    kc.assert_close("gates in vs in-kernel gates", with_gates, kda_decode_fused(**b), BF16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [1, 4])
def test_matches_unfused_layer_gpu(N):
    """The layer's CUDA path (causal_conv1d_update, bmm, fla fused_recurrent_kda_fwd,
    rms_norm_gated) rounds q/k/v, f_b / g_b outputs and o to bf16 between kernels; the fused
    kernel keeps fp32: the layer outputs agree to the bf16 bound, the states to 1e-2."""
    pytest.importorskip("fla")
    check_against_layer("cuda", BF16, H48, D48, W48, HIDDEN48, SLOTS[N], num_slots=9, seed=N,
                        state_bound=1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [1, 4])
def test_k3_matches_twin_and_layer_gpu(N):
    """Kimi K3's variant (kimi-k3-mini's KDA: 16 heads of 128 on a 2048 hidden): against the
    twin, and against the layer's unfused CUDA path (the K3 gate kernel, fla's recurrent)."""
    for v_block in (None, 64):
        check_against_twin("cuda", BF16, 16, D48, W48, SLOTS[N], num_slots=9, seed=N,
                           v_block=v_block, k3=True)
    check_against_twin("cuda", BF16, 16, D48, W48, SLOTS[N], num_slots=9, seed=N + 2,
                       pdl=True, prefetch_state=True, k3=True)
    pytest.importorskip("fla")
    check_against_layer("cuda", BF16, 16, D48, W48, 2048, SLOTS[N], num_slots=9, seed=N,
                        state_bound=1e-2, k3=True)


def _run_pdl(inp: dict, pdl: bool, prefetch_state: bool = False):
    caches = fresh_caches(inp)
    out = kda_decode_fused(**caches, pdl=pdl, prefetch_state=prefetch_state)
    return out, caches["conv_cache"], caches["rec_cache"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [1, 4])
@pytest.mark.parametrize("prefetch_state", [False, True])
def test_pdl_matches_gpu(N, prefetch_state):
    inp = make_inputs("cuda", BF16, H48, D48, W48, SLOTS[N], num_slots=9, seed=N)
    want, got = _run_pdl(inp, False), _run_pdl(inp, True, prefetch_state)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "pdl=True differs from pdl=False"


def _chain(x, w_in, w_o, inp, pdl, prefetch_state=False):
    """in-proj GEMV -> fused KDA decode -> o_proj GEMV, every launch with pdl."""
    from kdaserve.kernels.linear.gemv import gemv

    proj = gemv(x, w_in, pdl=pdl)                                    # [N, 3P + 2d + H]
    o = kda_decode_fused(**dict(inp, proj=proj), pdl=pdl,
                         prefetch_state=prefetch_state)               # [N, P]
    return gemv(o, w_o, pdl=pdl)                                      # [N, hidden]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [1, 4])
@pytest.mark.parametrize("prefetch_state", [False, True])
def test_pdl_chain_in_cuda_graph_gpu(N, prefetch_state):
    """gemv -> fused decode -> gemv captured with PDL launches (and with the states read before
    the wait): a replay from the same caches equals the eager pdl=False chain bit for bit
    (output and both caches), two replays in a row equal two eager steps, and a replay after
    new inputs reads them."""
    inp = make_inputs("cuda", BF16, H48, D48, W48, SLOTS[N], num_slots=9, seed=N)
    g = torch.Generator(device="cuda").manual_seed(N)
    width = inp["proj"].shape[1]
    x = torch.randn(N, HIDDEN48, generator=g, device="cuda").to(BF16)
    w_in = (torch.randn(width, HIDDEN48, generator=g, device="cuda") * HIDDEN48 ** -0.5).to(BF16)
    w_o = (torch.randn(HIDDEN48, H48 * D48, generator=g, device="cuda") * 0.02).to(BF16)
    conv0, rec0 = inp["conv_cache"].clone(), inp["rec_cache"].clone()

    def restore():
        inp["conv_cache"].copy_(conv0)
        inp["rec_cache"].copy_(rec0)

    want = _chain(x, w_in, w_o, inp, pdl=False)
    want_conv, want_rec = inp["conv_cache"].clone(), inp["rec_cache"].clone()
    want2 = _chain(x, w_in, w_o, inp, pdl=False)                  # a second step on them
    want2_rec = inp["rec_cache"].clone()
    graph, out = kc.capture_graph(lambda: _chain(x, w_in, w_o, inp, pdl=True,
                                                 prefetch_state=prefetch_state))
    for _ in range(2):
        restore()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), "graph replay output differs from eager pdl=False"
        assert torch.equal(inp["conv_cache"], want_conv), "graph replay conv windows differ"
        assert torch.equal(inp["rec_cache"], want_rec), "graph replay states differ"
        graph.replay()                          # reads the states the replay above wrote
        torch.cuda.synchronize()
        assert torch.equal(out, want2) and torch.equal(inp["rec_cache"], want2_rec), \
            "second replay in a row differs from two eager steps"
    x.copy_(torch.randn(N, HIDDEN48, generator=g, device="cuda").to(BF16))
    restore()
    graph.replay()
    torch.cuda.synchronize()
    restore()
    assert torch.equal(out, _chain(x, w_in, w_o, inp, pdl=False)), "replay ignored the new x"


if __name__ == "__main__":
    run_interpreter_checks()
    print("kda decode fused interpreter checks passed")
