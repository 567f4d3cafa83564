"""Correctness checks of the decode GEMV (run on CUDA, or on CPU under TRITON_INTERPRET=1).

Run as a script (by test_gemv.py, with TRITON_INTERPRET=1) for the fp32 interpreter subset;
the GPU tests import check_gemv directly. sm90_compile / split_at_wait compile a kernel for sm_90
on the CPU and split its PTX at griddepcontrol.wait (the PDL instruction-order tests).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_checks import patch_triton_interpreter, rel_err  # noqa: E402


def _rand(shape, dtype, device, g, scale=1.0, row_pad=0):
    """Random [R, C] tensor; with row_pad > 0 a row-strided view (C + row_pad per row)."""
    rows, cols = shape
    t = torch.randn(rows, cols + row_pad, generator=g, device=device) * scale
    return t.to(dtype)[:, row_pad // 2: row_pad // 2 + cols]


def check_gemv(device, M, N, K, x_dtype, w_dtype, out_dtype=None, strided_out=False,
               strided_in=False, config=None, bound=None, seed=0, pdl=False, swiglu=False,
               situ=None):
    """gemv vs gemv_reference computed from fp64 copies of the inputs (immune to a global TF32
    switch); relative error <= bound (1e-5 for fp32 output, 1e-2 otherwise). swiglu: x is
    [M, 2K] (gate | up); situ: (beta, linear_beta), the same layout through SiTU (x drawn
    3x wider, so the soft clips act)."""
    swiglu = swiglu or situ is not None
    from kdaserve.kernels.linear.gemv import gemv, gemv_reference

    g = torch.Generator(device=device).manual_seed(seed)
    pad = 5 if strided_in else 0
    x = _rand((M, 2 * K if swiglu else K), x_dtype, device, g, row_pad=pad,
              scale=3.0 if situ else 1.0)                                 # [M, K or 2K]
    w = _rand((N, K), w_dtype, device, g, scale=K ** -0.5, row_pad=pad)  # [N, K]
    dtype = out_dtype or x_dtype
    out = None
    if strided_out:
        full = torch.full((M, N + 7), float("nan"), dtype=dtype, device=device)
        out = full[:, 3:3 + N]                                           # [M, N], row stride N + 7
    y = gemv(x, w, out=out, out_dtype=out_dtype, config=config, pdl=pdl, swiglu=swiglu,
             situ=situ)
    if strided_out:
        assert y.data_ptr() == out.data_ptr(), "gemv did not write into out"
        assert full[:, :3].isnan().all() and full[:, 3 + N:].isnan().all(), "wrote outside out"
    # fp64 math (no TF32 in the check); the kernel's x-dtype rounding of silu(gate) * up is
    # inside the bound
    ref = gemv_reference(x.double(), w.double(), dtype, swiglu=swiglu, situ=situ)
    name = (f"gemv M={M} N={N} K={K} x={x_dtype} w={w_dtype} out={dtype} cfg={config} "
            f"pdl={pdl} swiglu={swiglu} situ={situ}")
    assert y.shape == (M, N) and y.dtype == dtype, f"{name}: got {tuple(y.shape)} {y.dtype}"
    assert not torch.isnan(y).any(), f"{name}: NaN in output (unwritten columns?)"
    limit = bound if bound is not None else (1e-5 if dtype == torch.float32 else 1e-2)
    err = rel_err(y, ref)
    assert err <= limit, f"{name}: relative error {err:.3e} > {limit:.0e}"
    return y


def check_pdl_same(device, M, N, K, dtype, config=None, strided_in=False, seed=0):
    """gemv with pdl=True (its prefetched first tiles) equals pdl=False bit for bit; both write
    every column of a NaN-poisoned out. Returns the output."""
    from kdaserve.kernels.linear.gemv import gemv

    g = torch.Generator(device=device).manual_seed(seed)
    pad = 5 if strided_in else 0
    x = _rand((M, K), dtype, device, g, row_pad=pad)                     # [M, K]
    w = _rand((N, K), dtype, device, g, scale=K ** -0.5, row_pad=pad)    # [N, K]
    base, fast = (torch.full((M, N), float("nan"), dtype=dtype, device=device) for _ in range(2))
    gemv(x, w, out=base, config=config)
    gemv(x, w, out=fast, config=config, pdl=True)
    name = f"gemv pdl M={M} N={N} K={K} {dtype} cfg={config}"
    assert not torch.isnan(base).any(), f"{name}: NaN in the pdl=False output"
    assert torch.equal(fast, base), (f"{name}: pdl=True differs from pdl=False, max abs diff "
                                     f"{(fast.double() - base.double()).abs().max().item():.3e}")
    return fast


def check_gemv_batched(device, B, M, N, K, dtype, config=None, pdl=False, seed=0, bound=None):
    """gemv_batched on MLA's layouts: x a [M, B, K] slice of [M, B, K + 3] (per-head rows of a
    wider q, read through a transposed view), out a transposed view of [M, B, N], weight
    [B, N, K]; each entry against gemv_reference in fp64 (1e-5 in fp32, else 1e-2). Returns
    out as [M, B, N]."""
    from kdaserve.kernels.linear.gemv import gemv_batched, gemv_reference

    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(M, B, K + 3, generator=g, device=device).to(dtype)   # [M, B, K + 3]
    x = q[..., :K].transpose(0, 1)                                     # [B, M, K] view
    w = (torch.randn(B, N, K, generator=g, device=device) * K ** -0.5).to(dtype)  # [B, N, K]
    out = torch.full((M, B, N), float("nan"), dtype=dtype, device=device)
    y = gemv_batched(x, w, out=out.transpose(0, 1), config=config, pdl=pdl)
    assert y.data_ptr() == out.data_ptr(), "gemv_batched did not write into out"
    name = f"gemv_batched B={B} M={M} N={N} K={K} {dtype} cfg={config} pdl={pdl}"
    limit = bound if bound is not None else (1e-5 if dtype == torch.float32 else 1e-2)
    for b in range(B):
        ref = gemv_reference(x[b].double(), w[b].double(), dtype)      # [M, N]
        err = rel_err(out[:, b], ref)
        assert err <= limit, f"{name}: entry {b}: relative error {err:.3e} > {limit:.0e}"
    return out


def sm90_compile(kernel, arg_types: dict, constexprs: dict, num_warps: int, launch_pdl: bool):
    """Compile a @triton.jit kernel for sm_90 without a GPU (triton's bundled ptxas), with the
    16-byte divisibility hint the JIT gives aligned pointers and ints. arg_types: name ->
    '*bf16' / 'i32' / 'fp32' for every non-constexpr parameter; constexprs: the constexpr
    values (their defaults where left out). Returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: arg_types.get(n, "constexpr") for n in names}
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs}                  # the JIT's binder fills defaults
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or sig[n] == "i32"}
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "launch_pdl": launch_pdl})


def memory_ops(ptx: str) -> list[str]:
    """The global loads / stores / atomics and griddepcontrol instructions of a PTX listing,
    in program order (one line each, predicate guard `@%p1 ` dropped)."""
    keep = ("ld.global", "st.global", "atom.global", "red.global", "griddepcontrol")
    lines = (re.sub(r"^@!?%p\d+\s+", "", line.strip()) for line in ptx.splitlines())
    return [line for line in lines if line.startswith(keep)]


def split_at_wait(ptx: str) -> tuple[list[str], list[str]]:
    """(memory ops before the single griddepcontrol.wait, memory ops after it)."""
    ops = memory_ops(ptx)
    waits = [i for i, op in enumerate(ops) if op.startswith("griddepcontrol.wait")]
    assert len(waits) == 1, f"expected one griddepcontrol.wait, got {len(waits)}"
    return ops[:waits[0]], ops[waits[0] + 1:]


def run_interpreter_suite() -> None:
    """fp32 (and fp16 x into fp32 out) through the CPU interpreter; masked and unmasked K."""
    from kdaserve.kernels.linear.gemv import GemvConfig

    patch_triton_interpreter()
    f32, f16 = torch.float32, torch.float16
    check_gemv("cpu", 1, 37, 100, f32, f32)                              # default: K masked
    check_gemv("cpu", 3, 37, 100, f32, f32, config=GemvConfig(16, 32, 4, 2))
    check_gemv("cpu", 4, 300, 64, f32, f32)                              # default: K even
    check_gemv("cpu", 4, 300, 64, f32, f32, config=GemvConfig(64, 16, 4, 3))  # N tail clamped
    check_gemv("cpu", 2, 37, 100, f32, f32, strided_out=True, strided_in=True,
               config=GemvConfig(8, 64, 2, 2))
    check_gemv("cpu", 4, 45, 48, f16, f32, out_dtype=f32, config=GemvConfig(16, 16, 2, 2))
    check_gemv("cpu", 1, 8, 1, f32, f32)                                 # K = 1
    # pdl on CPU tensors: no griddepcontrol, but the prefetched-tiles-first K order
    for prefetch in (1, 2):
        for M, N, K, bk in ((1, 37, 100, 32), (2, 40, 128, 32), (4, 33, 64, 32), (3, 20, 48, 64),
                            (1, 8, 1, 16)):   # K masked / even / 2 tiles / 1 masked tile / K=1
            cfg = GemvConfig(16, bk, 4, 2, prefetch)
            check_pdl_same("cpu", M, N, K, f32, config=cfg, strided_in=M == 2, seed=K)
        check_gemv("cpu", 2, 37, 100, f32, f32, config=GemvConfig(8, 32, 2, 2, prefetch),
                   strided_out=True, pdl=True)
    check_gemv("cpu", 1, 37, 100, f32, f32, pdl=True)                    # default config
    # swiglu x (gate | up): K masked and even, strided rows, prefetched tiles
    check_gemv("cpu", 1, 37, 100, f32, f32, swiglu=True)
    check_gemv("cpu", 3, 24, 64, f32, f32, swiglu=True, strided_in=True,
               config=GemvConfig(8, 16, 2, 2))
    check_gemv("cpu", 2, 37, 100, f32, f32, swiglu=True, pdl=True,
               config=GemvConfig(8, 32, 2, 2, 2))
    # SiTU x (gate | up), Kimi K3's constants, the up branch clipped or not
    check_gemv("cpu", 1, 37, 100, f32, f32, situ=(4.0, 25.0))
    check_gemv("cpu", 2, 24, 64, f32, f32, situ=(4.0, 2.0), strided_in=True, pdl=True,
               config=GemvConfig(8, 16, 2, 2, 1))
    check_gemv("cpu", 1, 20, 48, f32, f32, situ=(1.5, None))
    # batched (MLA's per-head products): K-tail masked, N tail clamped, pdl order
    check_gemv_batched("cpu", 3, 1, 24, 40, f32)
    check_gemv_batched("cpu", 4, 2, 16, 64, f32, config=GemvConfig(8, 16, 2, 2), seed=1)
    check_gemv_batched("cpu", 2, 3, 20, 48, f32, config=GemvConfig(16, 32, 2, 2, 2), pdl=True)


if __name__ == "__main__":
    run_interpreter_suite()
    print("gemv interpreter checks passed")


def sass_loops(compiled) -> list[list[str]]:
    """The loops of a compiled kernel's SASS (nvdisasm of its cubin, triton's bundled copy):
    for each backward branch, the opcodes from its target to the branch, in order (not the
    branch-to-itself that ends every kernel)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    instr, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*\.L_x_(\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if not m:
            continue
        for name in pending:
            labels[name] = len(instr)
        pending = []
        instr.append((m.group(2).split(".")[0], m.group(3)))
    loops = []
    for i, (op, rest) in enumerate(instr):
        target = re.search(r"\.L_x_(\d+)", rest) if op == "BRA" else None
        if target and labels.get(target.group(1), i) < i:
            loops.append([o for o, _ in instr[labels[target.group(1)]:i + 1]])
    return loops
