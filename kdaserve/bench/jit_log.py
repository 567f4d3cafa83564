"""Which Triton kernels compile (or load from the disk cache) while some code runs.

Triton's runtime hooks (`triton.knobs.runtime.jit_cache_hook` / `jit_post_compile_hook`) fire on
every in-memory cache miss of a `@triton.jit` function: a new specialisation compiles there, or
comes back from the on-disk cache. Used by benchmarks/first_steps.py (per engine step) and by the
test that a warmed-up engine compiles nothing while it serves.
"""

from __future__ import annotations

import time


class CompileLog:
    """Records {kernel, s, attrs} for each cache miss from construction until close()."""

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
        return False

    def _after(self, *, fn, **kw) -> None:
        t = time.perf_counter() - self._t0.pop(fn.name, time.perf_counter())
        attrs = kw.get("compile", {}).get("configs", [None])[0]
        self.events.append({"kernel": fn.name, "s": round(t, 3), "attrs": str(attrs)[:800]})

    def take(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def close(self) -> None:
        from triton import knobs

        (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook,
         knobs.autotuning.print) = self._saved
