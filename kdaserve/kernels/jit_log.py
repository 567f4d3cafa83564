"""Which Triton kernels compile (or load from the disk cache) while some code runs.

Triton's runtime hooks (`triton.knobs.runtime.jit_cache_hook` / `jit_post_compile_hook`) fire on
every in-memory cache miss of a `@triton.jit` function: a new specialisation compiles there, or
comes back from the on-disk cache. Used by the engine core on CUDA after its warm-up (a compile
while serving is a stall: the slow-step line names it), by benchmarks/first_steps.py (per
engine step) and by the test that a warmed-up engine compiles nothing while it serves. Logs
stack: a new one passes every event on to the hooks that were installed before it.
"""

from __future__ import annotations

import time


class CompileLog:
    """Records {kernel, s, attrs, constexprs, warps_stages} for each cache miss from
    construction until close(): attrs are the arguments' specialisations (alignment,
    divisibility), constexprs the values of the constexpr arguments (by position), so that two
    variants of one kernel can be told apart."""

    def __init__(self) -> None:
        from triton import knobs

        self.events: list[dict] = []
        self._t0: dict[str, float] = {}
        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook,
                       knobs.autotuning.print)
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after
        knobs.autotuning.print = True

    def _before(self, *, fn, **kw) -> bool:
        self._t0[fn.name] = time.perf_counter()
        outer = self._saved[0]
        return bool(outer(fn=fn, **kw)) if outer is not None else False

    def _after(self, *, fn, **kw) -> None:
        t = time.perf_counter() - self._t0.pop(fn.name, time.perf_counter())
        info = kw.get("compile", {})
        attrs = info.get("configs", [None])[0]
        constexprs = {k[0] if isinstance(k, tuple) and len(k) == 1 else k: v
                      for k, v in (info.get("constants") or {}).items()}
        self.events.append({"kernel": fn.name, "s": round(t, 3), "attrs": str(attrs)[:800],
                            "constexprs": str(constexprs)[:800],
                            "warps_stages": (info.get("num_warps"), info.get("num_stages"))})
        outer = self._saved[1]
        if outer is not None:
            outer(fn=fn, **kw)

    def take(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def close(self) -> None:
        from triton import knobs

        (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook,
         knobs.autotuning.print) = self._saved
