"""Side-stream L2 weight prefetch during latency-bound decode kernels: is the GEMV faster after it?

    python benchmarks/bench_prefetch.py [--out prefetch.json] [--lengths 4,8] [--shapes o_proj]
    python benchmarks/bench_prefetch.py --compile-sm90             # no GPU: compile the kernels
    TRITON_INTERPRET=1 python benchmarks/bench_prefetch.py --cpu-check   # no GPU: interpreter run

One decode "step" = a latency chain of L tiny 1-CTA Triton kernels (chain_kernel: a few serial
RMS-norm passes over 2304 fp32 values, ~2 us each; stand-in for norms / conv / state update /
router / attention) followed by the GEMV F.linear(x[1, K], W[N, K]) (cuBLAS, bf16). Variants,
each captured in one CUDA graph and timed by replay:
  baseline   chain then GEMV, W cold                                                   (a)
  prefetch   same, plus a branch forked (side stream, wait_stream) at the start of the chain
             that runs a prefetch kernel over W (its first `frac` of bytes), joined before
             the GEMV                                                                  (b)
  gemv_cold  the GEMV alone, W cold                                                    (c)
  gemv_hot   the GEMV alone, W hot (the same W read again and again)                   (d)
  chain      the chain alone;  ideal: chain then GEMV with W hot (what (b) can reach at best)
  pf_alone   the prefetch kernel alone (for the PTX prefetch kinds this is the time to issue
             the prefetches, not to land the data)
Cold W: no flush kernel. Each graph replays K steps over K copies of the weight (rotating,
K * bytes(W) >= max(4 x L2, 256 MB)), so between two reads of one copy the other K-1 copies
(>= 3 x L2) have passed through L2; time per step = replay time / K. Replays run back to back
(no L2 flush between them; triton's do_bench is not used because it zero-fills 256 MB before
each run, leaving L2 full of dirty lines written back during the timed run, and would make the
hot case cold). Each number is the median over --reps replays, timed with CUDA events.
Prefetch kinds: ld_el / ld_en: tl.load of 64 KB tiles per program per iteration (L1+L2
evict_last / evict_normal; ptxas rejects .cg with evict_last), xor-reduced into a value stored
only when it equals a sentinel (so the loads are live); pf128 / pf32: PTX
prefetch.global.L2::evict_last every 128 / 32 bytes (tl.inline_asm_elementwise); bulk /
bulk_el: PTX cp.async.bulk.prefetch.L2.global of 64 KB chunks (bulk_el with an L2::evict_last
cache policy), sm_90. The PTX kinds are probed first in a child process (a kernel that fails
to compile or faults is reported and skipped). A W over 0.75 x L2 (in_proj, 56.6 MB) also gets
rows prefetching only frac = 0.6 x L2 / bytes(W) of it; its gemv_hot / ideal are only partly hot.
The byte floor of a GEMV is bytes(W) / the device-to-device copy bandwidth measured in the run.
Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 2304                       # chain vector length (Kimi-Linear-48B hidden size)
SENTINEL = 0x5EED1E55               # the prefetch kernels store only if their xor equals this
TILE_BYTES = 64 * 1024              # ld_*: bytes per program per iteration
CHUNK_BYTES = 64 * 1024             # bulk*: bytes per cp.async.bulk.prefetch
SHAPES = {"o_proj": (2304, 4096), "in_proj": (12288, 2304), "proj_4096": (4096, 2304)}


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def chain_kernel(x_ptr, y_ptr, n, iters, BLOCK: tl.constexpr):
    """One CTA: `iters` serial RMS-norm passes over x[n] (fp32), written to y. Latency-bound."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0)               # [BLOCK]
    for _ in range(iters):
        ms = tl.sum(v * v, axis=0) / n
        v = v * tl.rsqrt(ms + 1e-6) * 0.5 + 0.25
        v = tl.where(mask, v, 0.0)
    tl.store(y_ptr + offs, v, mask=mask)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def load_prefetch_kernel(w_ptr, n_words, sentinel, out_ptr, BLOCK: tl.constexpr,
                         EVICT: tl.constexpr):
    """Programs stride over w[n_words] (int32 view of the weight) in BLOCK tiles; the xor of all
    words is stored to out[pid] only when it equals `sentinel`, which keeps the loads alive."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for t in range(pid, tl.cdiv(n_words, BLOCK), nprog):
        idx = t * BLOCK + offs                                         # n_words < 2**31
        acc ^= tl.load(w_ptr + idx, mask=idx < n_words, other=0, eviction_policy=EVICT)
    total = tl.reduce(acc, 0, _xor)
    if total == sentinel:
        tl.store(out_ptr + pid, total)


@triton.jit
def line_prefetch_kernel(w_ptr, n_bytes, sentinel, out_ptr, LINE: tl.constexpr,
                         LINES: tl.constexpr):
    """PTX prefetch.global.L2::evict_last of one address every LINE bytes of w[n_bytes] (u8)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lane = tl.arange(0, LINES)
    n_lines = tl.cdiv(n_bytes, LINE)
    acc = tl.zeros([LINES], dtype=tl.int32)
    for l0 in range(pid * LINES, n_lines, nprog * LINES):
        line = tl.minimum(l0 + lane, n_lines - 1).to(tl.int64)
        acc |= tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
            [w_ptr + line * LINE], dtype=tl.int32, is_pure=False, pack=1)
    total = tl.sum(acc, axis=0)
    if total == sentinel:
        tl.store(out_ptr + pid, total)


@triton.jit
def bulk_prefetch_kernel(w_ptr, n_bytes, chunk, sentinel, out_ptr, LANES: tl.constexpr,
                         EVICT_LAST: tl.constexpr):
    """PTX cp.async.bulk.prefetch.L2.global (sm_90) of w[n_bytes] (u8) in `chunk`-byte pieces
    (n_bytes and chunk multiples of 16), one piece per lane per iteration."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lane = tl.arange(0, LANES)
    n_chunks = tl.cdiv(n_bytes, chunk)
    acc = tl.zeros([LANES], dtype=tl.int32)
    for c0 in range(pid * LANES, n_chunks, nprog * LANES):
        c = c0 + lane
        start = tl.minimum(c, n_chunks - 1).to(tl.int64) * chunk
        size = tl.where(c < n_chunks, tl.minimum(n_bytes - start, chunk), 0).to(tl.int32)
        if EVICT_LAST:
            r = tl.inline_asm_elementwise(
                """{
                .reg .pred p;
                .reg .b64 pol;
                setp.ne.u32 p, $2, 0;
                createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
                @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
                mov.u32 $0, 0;
                }""", "=r,l,r", [w_ptr + start, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            r = tl.inline_asm_elementwise(
                """{
                .reg .pred p;
                setp.ne.u32 p, $2, 0;
                @p cp.async.bulk.prefetch.L2.global [$1], $2;
                mov.u32 $0, 0;
                }""", "=r,l,r", [w_ptr + start, size], dtype=tl.int32, is_pure=False, pack=1)
        acc |= r
    total = tl.sum(acc, axis=0)
    if total == sentinel:
        tl.store(out_ptr + pid, total)


# ---------------------------------------------------------------------------------------------
# prefetch implementations
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Impl:
    name: str      # ld_el, ld_en, pf128, pf32, bulk, bulk_el
    grid: int      # programs

    @property
    def asm(self) -> bool:
        return not self.name.startswith("ld_")

    @property
    def label(self) -> str:
        return f"{self.name}/g{self.grid}"


def impls(grids: list[int], asm: bool) -> list[Impl]:
    out = [Impl("ld_el", g) for g in grids] + [Impl("ld_en", 32)]
    if asm:
        out += [Impl("pf128", 16), Impl("pf128", 64), Impl("pf32", 64), Impl("bulk", 1),
                Impl("bulk", 8), Impl("bulk_el", 8)]
    return out


def prefetcher(impl: Impl, w: torch.Tensor, frac: float, dummy: torch.Tensor):
    """A no-argument launch that prefetches the first `frac` of w's bytes (rounded down to 4 KB,
    whole w when frac == 1). dummy: an int32 buffer of >= impl.grid elements."""
    nbytes = w.numel() * w.element_size()
    if frac < 1.0:
        nbytes = int(nbytes * frac) // 4096 * 4096
    u8 = w.view(-1).view(torch.uint8)                                 # [bytes(w)]
    grid = (impl.grid,)
    if impl.name.startswith("ld_"):
        w32 = u8.view(torch.int32)                                    # [bytes(w) / 4]
        evict = "evict_last" if impl.name == "ld_el" else ""
        return lambda: load_prefetch_kernel[grid](w32, nbytes // 4, SENTINEL, dummy,
                                                  BLOCK=TILE_BYTES // 4, EVICT=evict,
                                                  num_warps=8)
    if impl.name in ("pf128", "pf32"):
        line = 128 if impl.name == "pf128" else 32
        return lambda: line_prefetch_kernel[grid](u8, nbytes, SENTINEL, dummy, LINE=line,
                                                  LINES=1024, num_warps=4)
    if impl.name in ("bulk", "bulk_el"):
        return lambda: bulk_prefetch_kernel[grid](u8, nbytes, CHUNK_BYTES, SENTINEL, dummy,
                                                  LANES=32, EVICT_LAST=impl.name == "bulk_el",
                                                  num_warps=1)
    raise ValueError(f"unknown prefetch impl {impl.name!r}")


def chain_launcher(bufs: list[torch.Tensor], L: int, iters: int):
    """A no-argument launch of L chain kernels ping-ponging between bufs[0] and bufs[1]."""
    n = bufs[0].numel()
    block = triton.next_power_of_2(n)

    def run():
        for i in range(L):
            chain_kernel[(1,)](bufs[i % 2], bufs[(i + 1) % 2], n, iters, BLOCK=block,
                               num_warps=4)
    return run


# ---------------------------------------------------------------------------------------------
# graph timing
# ---------------------------------------------------------------------------------------------


class Timer:
    """Captures a list of step launches into one CUDA graph and times its replays."""

    def __init__(self, reps: int):
        self.reps = reps
        self.side = torch.cuda.Stream()      # the prefetch branch inside captures
        self.warm = torch.cuda.Stream()      # warm-up before capture

    def capture(self, steps) -> torch.cuda.CUDAGraph:
        self.warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.warm):
            for s in steps:
                s()
        torch.cuda.current_stream().wait_stream(self.warm)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for s in steps:
                s()
        return graph

    def us_per_step(self, steps) -> float:
        """Median replay time / len(steps), in microseconds; replays back to back."""
        graph = self.capture(steps)
        for _ in range(3):
            graph.replay()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(self.reps)]
        for start, end in ev:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in ev)
        del graph
        return ms * 1e3 / len(steps)

    def forked(self, prefetch, chain, gemv):
        """One step: fork `prefetch` on the side stream, run `chain`, join, run `gemv`."""
        def step():
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                prefetch()
            chain()
            main.wait_stream(self.side)
            gemv()
        return step


# ---------------------------------------------------------------------------------------------
# the measurement
# ---------------------------------------------------------------------------------------------


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written), as bench_layers.measure_ceilings."""
    n = 1 << 30                                                       # 1 GiB each way
    src = torch.empty(n // 2, device="cuda", dtype=torch.bfloat16).fill_(1.0)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100,
                                 return_mode="median")
    return 2 * n / ms / 1e6


def weight_copies(N: int, K: int, l2_bytes: int) -> list[torch.Tensor]:
    """Enough [N, K] bf16 copies that together they are >= max(4 x L2, 256 MB)."""
    nbytes = N * K * 2
    count = max(2, math.ceil(max(4 * l2_bytes, 256 << 20) / nbytes))
    return [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
            for _ in range(count)]


class ShapeBench:
    """All variants of one weight shape; rows go to `rows`, printed as they come."""

    def __init__(self, timer, rows, name, ws, x, bufs, iters, l2_bytes, copy_gbps):
        self.t, self.rows, self.name = timer, rows, name
        self.ws, self.x, self.bufs, self.iters = ws, x, bufs, iters
        self.dummy = torch.zeros(256, device="cuda", dtype=torch.int32)
        self.w_bytes = ws[0].numel() * 2
        self.shape = f"{ws[0].shape[0]}x{ws[0].shape[1]}"
        self.partial_hot = self.w_bytes > 0.75 * l2_bytes
        self.floor_us = self.w_bytes / (copy_gbps * 1e3)             # bytes(W) / copy rate

    def gemv(self, w):
        x = self.x
        return lambda: F.linear(x, w)                                 # [1, N]

    def row(self, variant, us, L=0, impl=None, frac=1.0, base=None):
        r = {"variant": variant, "shape": self.name, "NxK": self.shape, "w_MB": self.w_bytes / 1e6,
             "floor_us": self.floor_us, "L": L, "impl": impl.label if impl else "-",
             "frac": frac, "us": us, "GBps": self.w_bytes * frac / (us * 1e3) if L == 0 else None,
             "saving_us": None if base is None else base - us,
             "saving_pct": None if base is None else 100 * (base - us) / base}
        self.rows.append(r)
        print_row(r)
        return us

    def singles(self):
        """(c) GEMV cold over the rotation; (d) GEMV hot (one copy, again and again)."""
        n = len(self.ws)
        self.row("gemv_cold", self.t.us_per_step([self.gemv(w) for w in self.ws]))
        hot = self.t.us_per_step([self.gemv(self.ws[0])] * n)
        self.row("gemv_hot" + ("(W>L2)" if self.partial_hot else ""), hot)

    def prefetch_alone(self, impl, frac):
        steps = [prefetcher(impl, w, frac, self.dummy) for w in self.ws]
        self.row("pf_alone", self.t.us_per_step(steps), impl=impl, frac=frac)

    def chained(self, L, impl_fracs):
        chain = chain_launcher(self.bufs, L, self.iters)
        n = len(self.ws)
        self.row("chain", self.t.us_per_step([chain] * n), L=L)
        base = self.t.us_per_step([_seq(chain, self.gemv(w)) for w in self.ws])
        self.row("baseline", base, L=L, base=base)
        self.row("ideal", self.t.us_per_step([_seq(chain, self.gemv(self.ws[0]))] * n), L=L,
                 base=base)
        for impl, frac in impl_fracs:
            steps = [self.t.forked(prefetcher(impl, w, frac, self.dummy), chain, self.gemv(w))
                     for w in self.ws]
            self.row("prefetch", self.t.us_per_step(steps), L=L, impl=impl, frac=frac,
                     base=base)


def _seq(*fns):
    def run():
        for f in fns:
            f()
    return run


def print_header() -> None:
    print(f"{'variant':<14} {'shape':<10} {'NxK':<11} {'L':>2} {'impl':<11} {'frac':>5} "
          f"{'us/step':>8} {'GB/s of W':>9} {'saving vs baseline':>18}", flush=True)


def print_row(r: dict) -> None:
    saving = "" if r["saving_us"] is None else f"{r['saving_us']:+7.2f} us {r['saving_pct']:+5.1f}%"
    gbps = "" if r["GBps"] is None else f"{r['GBps']:.0f}"
    print(f"{r['variant']:<14} {r['shape']:<10} {r['NxK']:<11} {r['L']:>2} {r['impl']:<11} "
          f"{r['frac']:>5.2f} {r['us']:8.2f} {gbps:>9} {saving:>18}", flush=True)


def fracs_for(w_bytes: int, l2_bytes: int) -> list[float]:
    """1.0, plus a fraction that fits in 60% of L2 when W itself does not fit in 75% of it."""
    if w_bytes <= 0.75 * l2_bytes:
        return [1.0]
    return [1.0, round(0.6 * l2_bytes / w_bytes, 2)]


def run_shape(timer, rows, name, args, l2_bytes, usable: list[Impl]) -> None:
    N, K = SHAPES[name]
    ws = weight_copies(N, K, l2_bytes)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)        # [1, K]
    bufs = [torch.randn(HIDDEN, device="cuda") for _ in range(2)]     # [HIDDEN] fp32 each
    sb = ShapeBench(timer, rows, name, ws, x, bufs, args.chain_iters, l2_bytes, args.copy_GBps)
    print(f"--- {name} W[{N}, {K}] bf16 {sb.w_bytes / 1e6:.1f} MB x {len(ws)} copies, "
          f"byte floor {sb.floor_us:.2f} us", flush=True)
    sb.singles()
    impl_fracs = [(i, f) for f in fracs_for(sb.w_bytes, l2_bytes) for i in usable]
    for impl, frac in impl_fracs:
        sb.prefetch_alone(impl, frac)
    for L in args.lengths:
        sb.chained(L, impl_fracs)
    del ws, sb
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# probes and no-GPU checks
# ---------------------------------------------------------------------------------------------


def probe_asm(impl_list: list[Impl]) -> dict[str, str | None]:
    """Run each PTX-prefetch impl once in a child process (a fault there cannot poison this
    context). {label: None if it ran, else the error}."""
    todo = [i for i in impl_list if i.asm]
    if not todo:
        return {}
    arg = ",".join(f"{i.name}:{i.grid}" for i in todo)
    try:
        proc = subprocess.run([sys.executable, __file__, "--probe", arg], check=False,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {i.label: "probe timed out" for i in todo}
    result = {i.label: f"no result from probe (rc {proc.returncode}): "
                       f"{proc.stderr.strip()[-300:]}" for i in todo}
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            _, label, status = line.split(" ", 2)
            result[label] = None if status == "ok" else status
    return result


def probe_child(arg: str) -> int:
    w = torch.randn(4096, 2304, device="cuda", dtype=torch.bfloat16)
    dummy = torch.zeros(256, device="cuda", dtype=torch.int32)
    for item in arg.split(","):
        name, grid = item.split(":")
        impl = Impl(name, int(grid))
        try:
            prefetcher(impl, w, 1.0, dummy)()
            torch.cuda.synchronize()
            print(f"PROBE {impl.label} ok", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported per impl
            msg = " ".join(str(exc).split())[-300:]
            print(f"PROBE {impl.label} {type(exc).__name__}: {msg}", flush=True)
            if "CUDA" in str(exc) or "cuda" in str(exc):
                return 1                     # the context may be dead: stop here
    return 0


def compile_sm90() -> int:
    """Compile every kernel configuration the benchmark launches for sm_90, without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    u8, i32, f32 = "*u8", "*i32", "*fp32"
    jobs = [("chain", chain_kernel, {"x_ptr": f32, "y_ptr": f32, "n": "i32", "iters": "i32",
                                     "BLOCK": 4096}, 4)]
    for ev in ("evict_last", ""):
        jobs.append((f"ld {ev or 'normal'}", load_prefetch_kernel,
                     {"w_ptr": i32, "n_words": "i32", "sentinel": "i32", "out_ptr": i32,
                      "BLOCK": TILE_BYTES // 4, "EVICT": ev}, 8))
    for line in (128, 32):
        jobs.append((f"pf{line}", line_prefetch_kernel,
                     {"w_ptr": u8, "n_bytes": "i32", "sentinel": "i32", "out_ptr": i32,
                      "LINE": line, "LINES": 1024}, 4))
    for el in (False, True):
        jobs.append((f"bulk evict_last={el}", bulk_prefetch_kernel,
                     {"w_ptr": u8, "n_bytes": "i32", "chunk": "i32", "sentinel": "i32",
                      "out_ptr": i32, "LANES": 32, "EVICT_LAST": el}, 1))
    failed = 0
    for label, fn, args, warps in jobs:
        sig = {k: v if k[0].islower() else "constexpr" for k, v in args.items()}  # CAPS: constexpr
        consts = {(i,): v for i, (k, v) in enumerate(args.items()) if sig[k] == "constexpr"}
        # pointers and sizes divisible by 16, as the launches specialise them (vector loads)
        attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(args)
                 if sig[k] in (u8, i32, f32) or (sig[k] == "i32" and k.startswith("n_"))}
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            print(f"compiled {label} for sm_90: {len(k.asm['cubin'])} bytes of cubin")
        except Exception as exc:  # noqa: BLE001 - reported per kernel
            failed += 1
            print(f"FAILED {label}: {type(exc).__name__}: {str(exc).strip()[-500:]}")
    return 1 if failed else 0


def _patch_interpreter() -> None:
    """As tests/kernels/kernel_checks.patch_triton_interpreter: Triton 3.6's interpreter does
    int(ndarray) on 1-element loop bounds, which NumPy >= 2.4 rejects; use .item()."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        tensor.__index__ = lambda self: int(self.handle.data.item())

    interp._patch_lang_tensor = patched


def cpu_check() -> int:
    """Under TRITON_INTERPRET=1: the ld prefetch kernel covers every word (grid stride, masked
    tail) and stores only on the sentinel; the chain kernel matches its torch reference."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("--cpu-check needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    _patch_interpreter()
    block, grid = 1024, 3
    w = torch.randint(-2**31, 2**31 - 1, (7 * block + 17,), dtype=torch.int32)   # [words]
    tiles = torch.arange(w.numel()) // block
    w[tiles % grid != 1] = 0                       # only program 1's tiles (1, 4, 7) are non-zero
    want = _xor_all(w)
    for sentinel, expect in ((want, [0, want, 0]), (want ^ 1, [0, 0, 0])):
        out = torch.zeros(grid, dtype=torch.int32)
        load_prefetch_kernel[(grid,)](w, w.numel(), sentinel, out, BLOCK=block, EVICT="evict_last")
        print(f"ld_prefetch grid={grid} sentinel={sentinel}: stored {out.tolist()}, "
              f"expected {expect}")
        if out.tolist() != expect:
            return 1
    x = torch.randn(HIDDEN)
    y = torch.empty_like(x)
    chain_kernel[(1,)](x, y, HIDDEN, 3, BLOCK=4096)
    ref = x.clone()
    for _ in range(3):
        ref = ref * torch.rsqrt(ref.pow(2).mean() + 1e-6) * 0.5 + 0.25
    err = (y - ref).abs().max().item()
    print(f"chain_kernel max err {err:.2e}")
    return 0 if err < 1e-4 else 1


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _xor_all(w: torch.Tensor) -> int:
    acc = 0
    for v in w.tolist():
        acc ^= v
    return acc


def git_commit() -> str:
    """KDASERVE_COMMIT first: on the device machine the tree is copied without a current .git."""
    if os.environ.get("KDASERVE_COMMIT"):
        return os.environ["KDASERVE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             check=False, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def int_list(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--out", help="write the rows and run metadata as JSON here")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help="comma list of " + ", ".join(f"{k}={n}x{k_}"
                                                     for k, (n, k_) in SHAPES.items()))
    p.add_argument("--lengths", type=int_list, default=[4, 8], help="chain lengths L (4,8)")
    p.add_argument("--grids", type=int_list, default=[8, 16, 32, 64],
                   help="programs of the ld_el prefetch kernel (8,16,32,64)")
    p.add_argument("--chain-iters", type=int, default=8,
                   help="serial RMS-norm passes per chain kernel (8: ~2 us, see the chain rows)")
    p.add_argument("--reps", type=int, default=50, help="timed replays per graph (50)")
    p.add_argument("--no-asm", action="store_true", help="skip the PTX prefetch kernels")
    p.add_argument("--compile-sm90", action="store_true",
                   help="compile the kernels for sm_90 (no GPU needed) and exit")
    p.add_argument("--cpu-check", action="store_true",
                   help="with TRITON_INTERPRET=1: run the ld prefetch and chain kernels on CPU")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r} (known: {', '.join(SHAPES)})")
    return args


def run(args) -> int:
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    args.copy_GBps = copy_gbps()
    print(f"{props.name}: L2 {l2_bytes / 2**20:.0f} MiB, copy {args.copy_GBps:.0f} GB/s",
          flush=True)
    all_impls = impls(args.grids, not args.no_asm)
    probe = probe_asm(all_impls)
    for label, err in probe.items():
        print(f"PTX prefetch {label}: {'ok' if err is None else 'SKIPPED: ' + err}", flush=True)
    usable = [i for i in all_impls if probe.get(i.label) is None]
    timer, rows = Timer(args.reps), []
    meta = {"command": " ".join([sys.executable] + sys.argv), "gpu": props.name,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "commit": git_commit(), "copy_GBps": args.copy_GBps, "l2_bytes": l2_bytes,
            "chain_iters": args.chain_iters, "reps": args.reps, "tile_bytes": TILE_BYTES,
            "chunk_bytes": CHUNK_BYTES, "impls": [asdict(i) for i in usable],
            "skipped_impls": {k: v for k, v in probe.items() if v is not None},
            "cold_method": "rotation over weight copies totalling >= max(4 x L2, 256 MB)"}
    status = 0
    print_header()
    try:
        for name in args.shapes:
            run_shape(timer, rows, name, args, l2_bytes, usable)
    except Exception as exc:  # noqa: BLE001 - keep the rows measured so far
        print(f"ERROR: {type(exc).__name__}: {exc}", file=sys.stderr)
        meta["error"] = f"{type(exc).__name__}: {exc}"
        status = 1
    meta["wall_s"] = time.time() - t0
    print(f"wall {meta['wall_s']:.1f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_sm90:
        return compile_sm90()
    if args.cpu_check:
        return cpu_check()
    if not torch.cuda.is_available():
        print("bench_prefetch.py needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    if args.probe:
        return probe_child(args.probe)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
