"""A model of the few PTX instructions our inline-asm kernels use, for checks without a GPU:
run_ptx executes an asm block's straight-line text on 32-bit values, and run_inline_asm gives
Triton's interpreter tl.inline_asm_elementwise (kernel_checks.patch_triton_interpreter), with
Triton's operand order: the outputs' registers first (each output `pack` registers of 32-bit
elements), then each input's (elements narrower than 32 bits packed into registers, element i
of a register at bits i * width, as the compiled kernel packs them). Any other instruction
raises, so new PTX cannot pass unmodelled."""

import re

import numpy as np

MASK = 0xFFFFFFFF


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[4i+2:4i] of {b, a} (a's
    bytes 0-3, b's 4-7), or that byte's bit 7 replicated when sel bit 4i+3 is set."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Run the straight-line PTX of an inline-asm block: .reg declarations and and / or /
    shl / shr.u32 / mov / prmt on .b32 values; $n operands from `operands`; returns every
    register $n written, with the operands passed in."""
    regs = {f"${k}": v & MASK for k, v in operands.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", tok):
            return int(tok, 0) & MASK
        raise KeyError(f"operand {tok!r} read before written")

    written = set()
    for line in asm.replace("{", ";").replace("}", ";").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        v = [val(t) for t in src]
        if op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & MASK if v[1] < 32 else 0
        elif op == "shr.u32":
            r = v[0] >> v[1] if v[1] < 32 else 0
        elif op == "mov.b32":
            r = v[0]
        elif op == "prmt.b32":
            r = prmt(*v)
        else:
            raise NotImplementedError(f"PTX op {op} is not modelled")
        regs[d] = r
        written.add(d)
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$") and k in written}


_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32}


def run_inline_asm(asm: str, constraints: str, inputs: list[tuple[np.ndarray, int]],
                   out_bits: list[int], pack: int) -> list[np.ndarray]:
    """tl.inline_asm_elementwise over flat inputs [(raw bits as an unsigned array, element
    width in bits)], all of one length n (a multiple of pack): returns each output's raw bits
    (uint32 arrays of n). Elements are grouped `pack` at a time in order (the op is
    elementwise, so the grouping does not change a correct asm's result)."""
    n = inputs[0][0].size
    if n % pack:
        raise ValueError(f"{n} elements do not fill packs of {pack}")
    if any(b != 32 for b in out_bits):
        raise NotImplementedError("outputs narrower than 32 bits are not modelled")
    cons = [c.strip() for c in constraints.split(",")]
    n_out = len(out_bits) * pack
    n_in = sum(pack * bits // 32 if bits < 32 else pack for _, bits in inputs)
    if len(cons) != n_out + n_in or any(not c.startswith("=") for c in cons[:n_out]):
        raise ValueError(f"constraints {constraints!r} do not match {len(out_bits)} outputs and "
                         f"inputs of widths {[b for _, b in inputs]} at pack {pack}")
    outs = [np.zeros(n, dtype=np.uint32) for _ in out_bits]
    for g in range(n // pack):
        ops, reg = {}, n_out
        for data, bits in inputs:
            chunk = [int(x) for x in data[g * pack:(g + 1) * pack]]
            if bits < 32:
                per = 32 // bits
                for r in range(0, pack, per):
                    ops[reg] = sum(c << (bits * i) for i, c in enumerate(chunk[r:r + per]))
                    reg += 1
            else:
                for c in chunk:
                    ops[reg] = c
                    reg += 1
        res = run_ptx(asm, ops)
        for o in range(len(out_bits)):
            for e in range(pack):
                outs[o][g * pack + e] = res[o * pack + e]
    return outs
