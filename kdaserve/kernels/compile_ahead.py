"""Start-up compiles of kdaserve's Triton kernels in a pool of processes.

Triton compiles a kernel variant (one specialisation of its arguments and constexprs) when it is
first launched, in the launching thread, and the start-up forwards launch their variants one
after another: on an empty Triton cache one core compiles them all in turn. CompileAhead runs
those forwards once with the compiles handed to worker processes instead:

    ahead = CompileAhead(workers, target)
    with ahead.deferring():
        run the start-up forwards      # no kdaserve kernel launched; new variants compiled by the pool
    ahead.wait()                        # the workers have filled Triton's on-disk cache
    run the start-up forwards again     # every variant now loads from the disk cache

Inside `deferring()` no kdaserve kernel is launched. A variant with no compiled binary in this
process is skipped (Triton's jit_cache_hook returns True: no compile, no launch) and its
specialisation data goes to a worker, which compiles it for the same target into the on-disk
cache (the same cache key: JITFunction.preload's reconstruction, with the target given instead
of read from a driver, so the workers never touch the GPU). A variant already compiled here (by an
earlier engine in this process, say) is skipped too: its in-process cache entries are hidden while
inside, so its launch reaches the hook. Were it launched, it would read the uninitialised output
of a skipped kernel before it, and a kernel that indexes memory with such an output (the fused
MoE's GEMMs with the skipped alignment's sorted token ids) reads out of bounds. Everything else
runs as usual: torch ops, cuBLAS and other packages' Triton kernels (fla's, whose autotuning
must time real launches). The deferred forwards therefore compute garbage from uninitialised
outputs: only forwards whose host side reads no device value and whose torch ops index with no
kernel output may run there (the target model's forward: indices come from the step's
metadata).

An autotuner (fla's, where no stored config serves the key) compiles its candidates one by one
as it benchmarks them. When the first candidate's compile is asked for, the hook hands every
candidate of that launch to the workers and waits for them: the benchmark then loads each from
the disk cache, and the candidates compile side by side instead of in turn.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

logger = logging.getLogger(__name__)

PACKAGE = "kdaserve."
"""The modules whose kernels are deferred."""

WORKER_ENV = "KDASERVE_COMPILE_WORKER"
"""Set in the workers' environment. A spawned process imports the parent's main script again
(its top level runs as `__mp_main__`); a script that builds an engine outside an
`if __name__ == "__main__":` guard would build one in every worker. refuse_engine_in_worker
stops that early."""

MAX_DEFAULT_WORKERS = 16
"""The default pool's cap: a start-up has about a hundred variants, compiled in a few waves."""


def default_compile_workers(ranks_on_host: int = 1) -> int:
    """The pool size when none is configured: this process's CPUs shared by the host's ranks,
    one left to each rank's own thread, at most MAX_DEFAULT_WORKERS; 0 (no pool) where that
    leaves fewer than two, as a pool of one compiles in turn like the rank's own thread."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = min(MAX_DEFAULT_WORKERS, (cpus or 1) // max(1, ranks_on_host) - 1)
    return n if n >= 2 else 0


def refuse_engine_in_worker() -> None:
    """Raise if this process is a compile worker (an engine is about to be built while the
    worker imports the parent's main script)."""
    if os.environ.get(WORKER_ENV) == "1":
        raise RuntimeError(
            "kdaserve's start-up compile workers import the main script again, and its top "
            "level builds an engine: put that code under `if __name__ == \"__main__\":`, or "
            "pass compile_workers=0. The start-up compiles in its own thread meanwhile.")


def compile_variant(module: str, qualname: str, specialization_data: str,
                    target: tuple[str, int | str, int]) -> str:
    """Compile one variant into Triton's on-disk cache (a worker process: no driver needed).
    specialization_data: the JSON of Triton's jit hooks; target: GPUTarget's fields (backend,
    arch, warp size). Returns the kernel's name."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, JITFunction):   # under triton.heuristics / autotune wrappers
        fn = fn.fn
    d = json.loads(specialization_data)
    constexprs = {tuple(k): (tl.dtype(v) if tl.dtype.is_dtype(v) else
                             tl.constexpr(v["constexpr"]) if isinstance(v, dict)
                             and "constexpr" in v else v)
                  for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in d["signature"].items()}
    gpu = GPUTarget(*target)
    options = make_backend(gpu).parse_options(
        {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()})
    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu,
                   options=options.__dict__)
    return fn.__name__


def _tuples(v):
    """JSON lists back to the tuples Triton's signatures hold."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def candidate_variants(specialization_data: str, arg_names: list[str], configs) -> list[str]:
    """The specialisation data of one launch under each autotune config (triton.Config): its
    tuned constexprs (config.kwargs, by parameter position) and its warps, stages, CTAs and
    register cap replaced."""
    d = json.loads(specialization_data)
    keys = [tuple(k) for k in d["constant_keys"]]
    out = []
    for c in configs:
        e = copy.deepcopy(d)
        for name, v in c.kwargs.items():
            e["constant_vals"][keys.index((arg_names.index(name),))] = v
        e["options"].update(num_warps=c.num_warps, num_stages=c.num_stages, num_ctas=c.num_ctas)
        for name in ("maxnreg", "ir_override"):   # a config's None is the option's default
            if name in e["options"]:
                e["options"][name] = getattr(c, name, None)
        out.append(json.dumps(e))
    return out


def variant_identity(specialization_data: str) -> str:
    """What names a build: the specialisation less its "key" (Triton's in-process cache key,
    which a derived candidate keeps from the launch it came from), keys sorted."""
    d = json.loads(specialization_data)
    d.pop("key", None)
    return json.dumps(d, sort_keys=True)


def benchmarking_autotuner():
    """(the Autotuner, its launch's keyword arguments) whose benchmark is compiling, found in
    the callers' frames (Autotuner._bench -> do_bench -> the launch -> JIT compile), else
    None."""
    from triton.runtime.autotuner import Autotuner

    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_bench" and isinstance(f.f_locals.get("self"), Autotuner):
            return f.f_locals["self"], f.f_locals.get("meta", {})
        f = f.f_back
    return None


def package_kernels() -> list:
    """kdaserve's JITFunctions: the module-level kernels of the imported kdaserve modules (an
    autotuner's or heuristics' wrapper unwrapped), each once."""
    from triton.runtime.jit import JITFunction, KernelInterface

    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(PACKAGE) or module is None:
            continue
        for obj in list(vars(module).values()):
            while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
                obj = getattr(obj, "fn", None)
            if isinstance(obj, JITFunction) and obj.module.startswith(PACKAGE):
                found[id(obj)] = obj
    return list(found.values())


def _kernel_caches(fn) -> list[dict]:
    """fn's in-process compiled variants, one dict (Triton key -> kernel) per device."""
    return [entry[0] for entry in fn.device_caches.values()]


class CompileAhead:
    """A pool of compile workers and the hook that defers kdaserve's kernels to it."""

    def __init__(self, workers: int, target: tuple[str, int | str, int]) -> None:
        """workers: processes (spawned: the parent holds a CUDA context); target: the GPU's
        (backend, arch, warp size), e.g. from triton.runtime.driver.active.get_current_target()."""
        self.target = tuple(target)
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        self.workers = workers
        self._futures: dict[str, Future] = {}
        """By variant_identity: one compile per build."""
        self._candidates: set[str] = set()
        """Autotune candidates handed to the workers (their benchmark then loads them), by
        variant_identity."""
        self._t0 = time.perf_counter()
        self._spawn_without_gpu()

    @classmethod
    def start(cls, workers: int, target: tuple[str, int | str, int]) -> CompileAhead | None:
        """A pool, or None (logged) where this host cannot start processes (process limits, no
        /dev/shm for the pool's semaphores): start-up then compiles in its own thread."""
        try:
            return cls(workers, target)
        except (OSError, RuntimeError) as exc:
            logger.warning("compile ahead: no worker processes (%s: %s); start-up compiles in "
                           "this thread", type(exc).__name__, exc)
            return None

    def _spawn_without_gpu(self) -> None:
        """Start every worker now, with no GPU visible: they build for the given target, and a
        library that queries the device when imported (fla does) must not open a CUDA context
        in them (its memory would count against this process's cache budget). The pool spawns
        a worker per submit while none is idle, and a worker keeps the environment it was
        spawned with."""
        saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", WORKER_ENV)}
        os.environ.update({"CUDA_VISIBLE_DEVICES": "", WORKER_ENV: "1"})
        try:
            for _ in range(self.workers):
                self.pool.submit(int)
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    def submit(self, module: str, qualname: str, specialization_data: str) -> None:
        """Compile one variant in a worker (once per specialisation). A pool that cannot take
        it (its workers could not start) records the failure for wait() to report."""
        ident = variant_identity(specialization_data)
        if ident in self._futures:
            return
        try:
            fut = self.pool.submit(compile_variant, module, qualname, specialization_data,
                                   self.target)
        except Exception as exc:   # noqa: BLE001 - BrokenProcessPool, shut down: reported
            fut = Future()
            fut.set_exception(exc)
        self._futures[ident] = fut

    def _hook(self, outer, hidden: dict):
        """hidden: {id(JITFunction): its in-process entries} while they are hidden."""
        def hook(*, fn, compile, **kw) -> bool:
            spec = compile["specialization_data"]
            if fn.module.startswith(PACKAGE):
                if compile["key"] not in hidden.get(id(fn.jit_function), ()):
                    self.submit(fn.module, fn.name, spec)
                return True                  # no compile, no launch
            if variant_identity(spec) not in self._candidates:
                self._compile_candidates(fn, spec)
            return bool(outer(fn=fn, compile=compile, **kw)) if outer is not None else False
        return hook

    def _compile_candidates(self, fn, spec: str) -> None:
        """Inside an autotuner's benchmark: every candidate of this launch compiled by the
        workers, waited for (a failed one compiles in-process as before)."""
        found = benchmarking_autotuner()
        if found is None:
            return
        tuner, meta = found
        try:
            configs = tuner.prune_configs(meta)
        except Exception:   # noqa: BLE001 - a pruning that needs more: every candidate
            configs = tuner.configs
        try:
            specs = candidate_variants(spec, fn.jit_function.arg_names, configs)
        except (ValueError, KeyError) as exc:   # a config that sets no constexpr of the kernel
            logger.debug("compile ahead: %s's candidates not derived (%s)", fn.name, exc)
            self._candidates.add(variant_identity(spec))
            return
        idents = [variant_identity(s) for s in specs]
        self._candidates.update(idents + [variant_identity(spec)])
        for s in specs:
            self.submit(fn.module, fn.name, s)
        for ident in idents:
            try:
                self._futures[ident].result()
            except Exception:   # noqa: BLE001 - reported by wait(); compiles at its launch
                pass

    @contextlib.contextmanager
    def deferring(self):
        """While inside, no kdaserve kernel is launched; the compiles of the variants not yet
        compiled in this process go to the workers."""
        from triton import knobs

        kernels = package_kernels()
        hidden = {}
        for fn in kernels:                   # every launch a cache miss: it reaches the hook
            for cache in _kernel_caches(fn):
                hidden.setdefault(id(fn), {}).update(cache)
                cache.clear()
        outer = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook(outer, hidden)
        try:
            yield self
        finally:
            knobs.runtime.jit_cache_hook = outer
            for fn in kernels:
                for cache in _kernel_caches(fn):
                    cache.update(hidden.get(id(fn), {}))

    def wait(self) -> dict:
        """Wait for every compile and stop the workers. A variant that failed to compile there
        compiles again (and raises) where it is launched; it is logged here. Returns
        {variants, failed, seconds} (seconds since the pool started)."""
        failed: list[Exception] = []
        for fut in self._futures.values():
            try:
                fut.result()
            except Exception as exc:   # noqa: BLE001 - reported, and retried at its launch
                failed.append(exc)
        if failed:
            logger.warning("compile ahead: %d of %d variants failed in the workers (the first: "
                           "%s: %s); they compile at their launch", len(failed),
                           len(self._futures), type(failed[0]).__name__, failed[0])
            if any(isinstance(e, BrokenProcessPool) for e in failed):
                logger.warning("compile ahead: the worker processes died; if the main script "
                               "builds the engine at its top level, guard it with `if "
                               "__name__ == \"__main__\":` (the workers import it again) or "
                               "set compile_workers=0")
        self.pool.shutdown()
        stats = {"variants": len(self._futures), "failed": len(failed),
                 "seconds": round(time.perf_counter() - self._t0, 2)}
        logger.info("compile ahead: %d kernel variants compiled in %d worker processes in "
                    "%.1f s (%d failed)", stats["variants"], self.workers, stats["seconds"],
                    stats["failed"])
        return stats
