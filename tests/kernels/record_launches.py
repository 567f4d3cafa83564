"""Run interpreter check scripts and record every kernel launch they make (run with
TRITON_INTERPRET=1; used by test_compile_sm90.py).

    python record_launches.py OUT.jsonl SCRIPT [SCRIPT ...]

Each launch is one JSON line: the kernel (module, name), every argument as a tensor dtype
(and whether its address is 16-byte aligned) or a plain value, and the launch options
(num_warps, num_stages).
"""

import json
import runpy
import sys
from pathlib import Path

import torch
import triton.runtime.interpreter as interp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def describe(value):
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."),
                "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if type(value).__name__ == "TensorDescriptor":   # triton.tools.tensor_descriptor
        return {"desc": str(value.base.dtype).removeprefix("torch."),
                "block": list(value.block_shape)}
    return {"repr": repr(value)}


def install(out_path: str) -> None:
    original = interp.InterpretedFunction.run
    out = open(out_path, "a")

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        rec = {"module": self.fn.__module__, "name": self.fn.__name__,
               "args": {n: describe(a) for n, a in zip(names, args)},
               "options": {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}}
        rec["args"].update({k: describe(v) for k, v in kwargs.items() if k in names})
        out.write(json.dumps(rec, sort_keys=True) + "\n")
        out.flush()
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = run


if __name__ == "__main__":
    install(sys.argv[1])
    for script in sys.argv[2:]:
        runpy.run_path(str(HERE / script), run_name="__main__")
