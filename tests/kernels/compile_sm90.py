"""Compile recorded kernel launches (record_launches.py) for an H100/H200 (sm_90) with Triton's
own toolchain (LLVM + the bundled ptxas), no GPU needed.

    python compile_sm90.py LAUNCHES.jsonl

Non-constexpr ints become i32 (i64 past its range), floats fp32, tensors pointers of their dtype,
TMA tensor descriptors descriptors of their dtype and block;
constexpr parameters keep their recorded value, or their default when not passed. Each launch
gets the specialisation the JIT would give it on a GPU: a 16-divisibility hint on ints that
are multiples of 16 and on 16-byte aligned tensors, except where the kernel says
do_not_specialize (ints) or do_not_specialize_on_alignment (so the loads vectorise as they do
there). Each distinct
(kernel, signature, constexprs, options) compiles once, and once more with every fp32 pointer
as bf16 (the checks run fp32 on the CPU; the GPU runs bf16 activations). Prints one line per
failure and exits 1 if any failed.
"""

import importlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor

PTR = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16", "int32": "i32",
       "int64": "i64", "uint8": "u8", "int8": "i8", "bool": "i1", "int16": "i16"}


def _scalar_type(v) -> str:
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"unsupported scalar {v!r}")


def plan(rec: dict):
    """(key, module, name, signature, constexprs, options) of one launch."""
    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    sig, consts, divisible = {}, {}, []
    for i, p in enumerate(fn.params):
        arg = rec["args"].get(p.name)
        if p.is_constexpr or (arg is not None and arg.get("value", 0) is None):
            val = arg["value"] if arg is not None else p.default
            if arg is not None and "value" not in arg:
                raise TypeError(f"constexpr {p.name} recorded as {arg}")
            sig[p.name] = "constexpr"
            consts[(i,)] = val
        elif arg is None:
            raise TypeError(f"{rec['name']}: argument {p.name} was not recorded")
        elif "desc" in arg:     # a TMA tensor descriptor: its dtype and block shape
            sig[p.name] = f"tensordesc<{PTR[arg['desc']]}[{', '.join(map(str, arg['block']))}]>"
        elif "tensor" in arg:
            sig[p.name] = "*" + PTR[arg["tensor"]]
            if arg.get("aligned") and not p.do_not_specialize_on_alignment:
                divisible.append(i)
        else:
            sig[p.name] = _scalar_type(arg["value"])
            v = arg["value"]
            if (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0
                    and not p.do_not_specialize and not p.do_not_specialize_on_alignment):
                divisible.append(i)
    key = json.dumps([rec["module"], rec["name"], sig, sorted((k[0], repr(v)) for k, v in
                                                               consts.items()),
                      sorted(rec["options"].items()), divisible])
    return key, rec["module"], rec["name"], sig, consts, rec["options"], divisible


def compile_one(item) -> str | None:
    _, module, name, sig, consts, options, divisible = item
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    try:
        attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(options))
    except Exception as e:  # noqa: BLE001 - reported per launch
        msg = str(e).strip().splitlines()
        return f"{name} {sig} {options}: {type(e).__name__}: {msg[-1] if msg else ''}"
    return None


def bf16_variant(item):
    """The launch with bf16 activations, as on the GPU; a kernel with a LUT constexpr (a PTX
    path the interpreter cannot run, taken for bf16 on CUDA) gets LUT=True as well."""
    key, module, name, sig, consts, options, divisible = item
    sig = {k: "*bf16" if v == "*fp32" else v.replace("tensordesc<fp32[", "tensordesc<bf16[")
           for k, v in sig.items()}
    fn = getattr(importlib.import_module(module), name)
    names = [p.name for p in fn.params]
    if "LUT" in names and consts.get((names.index("LUT"),)) is not None:
        consts = dict(consts)
        consts[(names.index("LUT"),)] = consts.get((names.index("MXFP4"),), True) \
            if "MXFP4" in names else True
    return (key + " bf16", module, name, sig, consts, options, divisible)


def main(path: str, workers: int = 2) -> int:
    items = {}
    for line in open(path):
        item = plan(json.loads(line))
        items.setdefault(item[0], item)
        if any(v == "*fp32" or v.startswith("tensordesc<fp32") for v in item[3].values()):
            variant = bf16_variant(item)
            items.setdefault(variant[0], variant)
    with ProcessPoolExecutor(workers) as pool:
        failures = [f for f in pool.map(compile_one, items.values()) if f]
    for f in failures:
        print("FAILED", f)
    names = sorted({item[2] for item in items.values()})
    print(f"{len(items)} distinct launches of {len(names)} kernels compiled for sm_90, "
          f"{len(failures)} failed: {' '.join(names)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
