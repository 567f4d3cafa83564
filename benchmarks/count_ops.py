"""Ops per decode step, per piece of the model: what a step launches, counted on any device.

    python benchmarks/count_ops.py --preset kimi-k3-tiny                  # the CPU reference
    TRITON_INTERPRET=1 python benchmarks/count_ops.py --preset kimi-k3-tiny --k3-kernels on
    python benchmarks/count_ops.py --preset kimi-k3-mini --device cuda [--k3-kernels off]

One batch-1 decode step (after --context tokens: a prefill and a decode step, not counted; the
first decode lets autotuners settle) of the model built with random weights, under a
TorchDispatchMode that counts every aten op that computes (views and allocations apart: on
CUDA each counted op is about one kernel launch) and a hook on Triton's launcher counting
every Triton kernel launch (fla-core's included). Each op or launch goes to
the innermost module that runs it, named by its class; ops a decoder layer or the model runs in
their own code are the AttnRes reads (K3) or the residual adds. Prints one row per piece (its
aten ops, its Triton launches, the aten ops by name) and writes the table as JSON with --out.

--k3-kernels on: the backends of the K3-only pieces (layers/backends.py attn_res, gated_act,
k3_gates) set to their Triton kernels whatever the device; on the CPU that needs
TRITON_INTERPRET=1 (the kernels run in Triton's interpreter); off: their twins (on CUDA, the
count before the kernels). auto (default): the CPU gets the reference set, CUDA
select_backends' choice. The CPU reference counts ops, not
launches, for pieces CUDA runs as kernels (RMSNorm, KDA, MLA, the experts); for the K3-only
pieces the reference is what CUDA ran before those kernels, cast ops included with --dtype
bfloat16 (the default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdaserve.attention.builder import build_metadata  # noqa: E402
from kdaserve.attention.caches import allocate_caches  # noqa: E402
from kdaserve.attention.forward_context import ForwardContext, StepPlan  # noqa: E402
from kdaserve.config import KernelConfig  # noqa: E402
from kdaserve.layers.backends import select_backends  # noqa: E402
from kdaserve.models.loader import init_dummy_weights  # noqa: E402
from kdaserve.models.make_model import preset_args  # noqa: E402
from kdaserve.models.registry import build_model  # noqa: E402

BLOCK = 16
NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
             "lift_fresh", "set_", "resize_", "_local_scalar_dense", "detach", "alias"}
"""aten ops that allocate or alias without computing (no kernel on CUDA)."""


class _Pieces:
    """The innermost running module's piece name, kept by forward hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack = ["model"]
        self.in_triton = 0
        """> 0 inside a Triton launch: the interpreter's own tensor copies are not counted."""
        self.handles = []
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._enter))
            self.handles.append(m.register_forward_hook(self._leave))

    def _enter(self, module, _inp) -> None:
        name = type(module).__name__
        if name in ("DecoderLayer", "KimiLinearModel"):
            name += " own ops (AttnRes reads / residual adds)"
        self.stack.append(name)

    def _leave(self, _module, _inp, _out) -> None:
        self.stack.pop()

    @property
    def top(self) -> str:
        return self.stack[-1]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _CountOps(TorchDispatchMode):
    def __init__(self, pieces: _Pieces, table: dict) -> None:
        super().__init__()
        self.pieces, self.table = pieces, table

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_LAUNCH and not self.pieces.in_triton:
            self.table[self.pieces.top]["aten"][name] += 1
        return out


def _hook_triton(pieces: _Pieces, table: dict):
    """Counts Triton launches (compiled and interpreted); returns an undo function."""
    try:
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit
    except ImportError:
        return lambda: None
    undo = []
    for cls in (jit.JITFunction, interp.InterpretedFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if not kwargs.get("warmup", False) and not pieces.in_triton:
                table[pieces.top]["triton"][self.fn.__name__] += 1
            pieces.in_triton += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                pieces.in_triton -= 1

        cls.run = run
        undo.append((cls, original))

    def restore():
        for cls, original in undo:
            cls.run = original
    return restore


def k3_kernel_backends(backends, on: bool):
    """backends with the K3-only pieces on their Triton kernels (on) or their twins."""
    name = "triton" if on else "reference"
    return dataclasses.replace(backends, attn_res=name, gated_act=name, k3_gates=name)


def build(preset: str, device: torch.device, dtype: torch.dtype, k3_kernels: bool | None,
          seed: int, init=None):
    """k3_kernels: None keeps select_backends' choice for the K3-only pieces. init(model,
    seed) fills the weights (default: the dummy fill with spread routing)."""
    args = preset_args(preset)
    backends = select_backends(KernelConfig(), device)
    if k3_kernels is not None:
        backends = k3_kernel_backends(backends, k3_kernels)
    model = build_model(args, dtype, device, backends=backends)
    if init is None:
        init_dummy_weights(model, seed, "spread")
    else:
        init(model, seed)
    model.process_weights_after_loading()
    return model, args


@torch.no_grad()
def count_decode_step(model, args, device: torch.device, dtype: torch.dtype,
                      context: int = 8, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """({piece: {"aten": Counter, "triton": Counter}}, the step's logits [1, V]) of one batch-1
    decode step after `context` tokens (a prefill and one decode step, not counted)."""
    blocks = list(range(-(-(context + 1) // BLOCK)))
    caches = allocate_caches(args, num_blocks=len(blocks) + 1, block_size=BLOCK, num_slots=2,
                             dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, args.vocab_size, (context + 1,), generator=gen).to(device)

    def step(ids: torch.Tensor, computed: int) -> torch.Tensor:
        md = build_metadata([ids.numel()], [computed], [blocks], [1], BLOCK, device)
        h = model(ids, ForwardContext(md, caches, StepPlan.eager(md)))
        return model.compute_logits(h)

    step(prompt[:context - 1], 0)
    step(prompt[context - 1:context], context - 1)   # a first decode: autotuners settle here
    table = defaultdict(lambda: {"aten": Counter(), "triton": Counter()})
    pieces = _Pieces(model)
    restore = _hook_triton(pieces, table)
    try:
        with _CountOps(pieces, table):
            logits = step(prompt[context:context + 1], context)
    finally:
        restore()
        pieces.remove()
    return dict(table), logits


def summary(table: dict) -> dict:
    rows = {}
    for piece, c in sorted(table.items()):
        rows[piece] = {"aten_ops": sum(c["aten"].values()),
                       "triton_launches": sum(c["triton"].values()),
                       "aten": dict(sorted(c["aten"].items())),
                       "triton": dict(sorted(c["triton"].items()))}
    rows["total"] = {"aten_ops": sum(r["aten_ops"] for r in rows.values()),
                     "triton_launches": sum(r["triton_launches"] for r in rows.values())}
    return rows


def format_table(rows: dict) -> str:
    lines = [f"{'piece':48s} {'aten':>6s} {'triton':>6s}  aten ops by name"]
    for piece, r in rows.items():
        by = ", ".join(f"{k} {v}" for k, v in r.get("aten", {}).items())
        lines.append(f"{piece:48s} {r['aten_ops']:6d} {r['triton_launches']:6d}  {by}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k3-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--context", type=int, default=8)
    ap.add_argument("--k3-kernels", choices=["auto", "on", "off"], default="auto",
                    help="the K3-only pieces' backends: select_backends' choice for the "
                         "device (auto), their Triton kernels (on), their twins (off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    k3 = {"auto": None, "on": True, "off": False}[a.k3_kernels]
    model, args = build(a.preset, device, dtype, k3, a.seed)
    rows = summary(count_decode_step(model, args, device, dtype, a.context, a.seed)[0])
    print(format_table(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "device": a.device, "dtype": a.dtype,
                       "k3_kernels": a.k3_kernels, "pieces": rows}, f, indent=1)


if __name__ == "__main__":
    main()
