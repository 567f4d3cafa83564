"""The row-at-a-time varlen conv (kernels/conv/triton_conv.py conv_varlen_kernel) at the 48B
model's shapes, built for sm_90 with Triton's bundled toolchain (no GPU): it replaced a tile
kernel whose register use spilled, so its build must keep each input row a single 16-byte load
a thread and stay clear of spills. Its outputs are checked against the twin by the interpreter
suite (kernel_checks.py) and on the GPU (test_triton_kernels.py test_causal_conv1d_gpu)."""

import re
import subprocess
from pathlib import Path

import pytest

from gemv_checks import sm90_compile

TYPES = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", cu_seqlens_ptr="*i32",
             states_ptr="*bf16", state_idx_ptr="*i32", has_init_ptr="*u8", num_tokens="i32",
             dim="i32", num_seqs="i32", stride_xt="i32", stride_yt="i32", stride_wd="i32",
             stride_wj="i32", stride_ss="i32", stride_sd="i32", stride_sj="i32",
             stride_ysplit="i32")
"""The engine's launch: q|k|v columns of the input projection (bf16), out as q, k, v planes."""


def _build(block_t: int, block_d: int, warps: int, tmp_path: Path) -> tuple[str, str]:
    """(ptxas -v's report, the SASS) of the rows kernel at W = 4, the KDA planes of 4096."""
    triton = pytest.importorskip("triton")
    from kdaserve.kernels.conv.causal_conv1d import _search_steps
    from kdaserve.kernels.conv.triton_conv import conv_varlen_kernel

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "nvdisasm").exists():
        pytest.skip("triton's bundled ptxas / nvdisasm is missing")
    k = sm90_compile(conv_varlen_kernel, TYPES,
                     dict(W=4, SEARCH_STEPS=_search_steps(1), SILU=True, BLOCK_T=block_t,
                          BLOCK_D=block_d, SPLIT=4096, USE_PDL=True),
                     num_warps=warps, launch_pdl=True)
    (tmp_path / "k.ptx").write_text(k.asm["ptx"])
    res = subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"),
                          "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=True).stdout
    return res.stderr, sass


@pytest.mark.parametrize("tiles", [(8, 512, 2), (16, 1024, 4), (16, 2048, 8)])
def test_varlen_kernel_loads_each_row_once_without_spills(tiles, tmp_path):
    """At 8 channels a thread: the interior path's BLOCK_T rows plus the W-1 rows before them
    are 16-byte loads (LDG.E.128, one a row), all issued before its first 16-byte store (a
    load after a store that may alias it would wait: one row in flight), and nothing spills
    (the tile kernel it replaced spilled at 255 registers)."""
    block_t = tiles[0]
    report, sass = _build(*tiles, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert regs < 255, report
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    wide = "".join("L" if o == "LDG.E.128" else "S" if o == "STG.E.128" else "" for o in ops)
    assert wide.count("L") >= block_t + 3 and wide.count("S") >= block_t, wide
    # the interior path: its last BLOCK_T wide loads come before its last BLOCK_T stores
    tail = wide[wide.rindex("L") - block_t + 1:]
    assert tail.startswith("L" * block_t) and tail.endswith("S" * block_t), wide


@pytest.mark.parametrize("chunk", [8, 16])
def test_verify_conv_issues_a_chunks_loads_before_its_stores(chunk):
    """The speculative verify conv (kernels/kda/triton_recover.py conv_spec_verify_kernel) walks
    a window CHUNK tokens at a time: in its loop every x-row load precedes the first store, so
    the chunk's loads are in flight together (the window's tokens used to wait on each other:
    load, sums, store, next load)."""
    pytest.importorskip("triton")
    import gemv_checks as gc
    from kdaserve.kernels.kda.triton_recover import conv_spec_verify_kernel

    types = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", pool_ptr="*bf16", idx_ptr="*i32",
                 col_ptr="*i32", cu_ptr="*i32", dim="i32", stride_xt="i32", stride_yt="i32",
                 stride_wd="i32", stride_wj="i32", stride_ps="i32", stride_pd="i32",
                 stride_pj="i32", stride_idx="i32", stride_ysplit="i32")
    k = sm90_compile(conv_spec_verify_kernel, types,
                     dict(W=4, BW=4, BD=256, HAS_COLS=False, SILU=True, CHUNK=chunk, SPLIT=4096),
                     num_warps=4, launch_pdl=False)
    loops = gc.sass_loops(k)
    assert loops
    body = max(loops, key=len)
    seq = "".join("L" if o.startswith("LDG") else "S" if o.startswith("STG") else ""
                  for o in body)
    assert seq.count("S") == chunk and "L" not in seq[seq.index("S"):], seq
    assert seq.count("L") >= chunk, seq
