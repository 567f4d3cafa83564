"""The Kimi K3 kernels of the plain-torch pieces (AttnRes read, SiTU, sigmoid output gate, KDA
bounded gate + beta) against their twins: fp32 through the Triton interpreter on the CPU, bf16
on a GPU at kimi-k3-mini's and Kimi K3's sizes."""

import pytest
import torch

import kernel_checks as kc


def test_k3_ops_under_interpreter():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("k3_ops_checks.py", timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 3, 300])
@pytest.mark.parametrize("D", [2048, 7168])
@pytest.mark.parametrize("pdl", [False, True])
def test_attn_res_on_gpu(T, D, pdl):
    import k3_ops_checks as checks

    for seed, (n, w, delta, norm) in enumerate([(0, 0, False, True), (3, -1, True, True),
                                                (2, 2, True, True), (4, -1, True, False)]):
        checks.check_attn_res("cuda", torch.bfloat16, T=T, NB=5, D=D, num_blocks=n,
                              write_idx=w, delta=delta, out_norm=norm, pdl=pdl, seed=seed)


@pytest.mark.gpu
@needs_cuda
def test_attn_res_pdl_equals_plain_on_gpu():
    import k3_ops_checks as checks

    a = checks.check_attn_res("cuda", torch.bfloat16, T=2, NB=4, D=2048, num_blocks=3, seed=9)
    b = checks.check_attn_res("cuda", torch.bfloat16, T=2, NB=4, D=2048, num_blocks=3, seed=9,
                              pdl=True)
    assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2, 77])
def test_elementwise_on_gpu(T):
    import k3_ops_checks as checks

    for inter in (1536, 6144):                     # mini's and K3's shared experts
        checks.check_situ("cuda", torch.bfloat16, T=T, inter=inter, seed=T)
    checks.check_situ("cuda", torch.bfloat16, T=T, inter=300, linear_beta=None, seed=T + 1)
    checks.check_sigmoid_gate("cuda", torch.bfloat16, T=T, n=16 * 128, seed=T)
    for H in (16, 96):
        checks.check_kda_gate("cuda", torch.bfloat16, T=T, H=H, K=128, seed=T + H)


# ---------------------------------------------------------------------------------------------
# sm_90 PTX (no GPU needed): under PDL only weights are read before griddepcontrol.wait
# ---------------------------------------------------------------------------------------------

def _pdl_ops(kernel, types: dict, consts: dict, num_warps: int = 4):
    """(global ops before the wait, after it), each with the pointer parameters its address
    derives from (test_kda_decode_fused.global_ops_with_params)."""
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    import gemv_checks as gc
    from test_kda_decode_fused import global_ops_with_params

    k = gc.sm90_compile(kernel, types, dict(consts, USE_PDL=True), num_warps=num_warps,
                        launch_pdl=True)
    assert k.metadata.launch_pdl
    names = [n if types[n].startswith("*") else None for n in kernel.arg_names if n in types]
    ops = global_ops_with_params(k.asm["ptx"], names)
    waits = [i for i, (op, _) in enumerate(ops) if op == "griddepcontrol.wait"]
    assert len(waits) == 1, ops
    before, after = ops[:waits[0]], ops[waits[0] + 1:]
    assert after[0][0] == "griddepcontrol.launch_dependents", after[:2]
    assert all(op.startswith("ld.global") for op, _ in before), before
    return before, after


def test_attn_res_pdl_sm90_only_weights_before_the_wait():
    from kdaserve.kernels.attn_res.triton_attn_res import attn_res_kernel

    types = dict(prefix_ptr="*bf16", delta_ptr="*bf16", blocks_ptr="*bf16", norm_w_ptr="*bf16",
                 query_ptr="*bf16", out_norm_w_ptr="*bf16", prefix_out_ptr="*bf16",
                 out_ptr="*bf16", D="i32", write_idx="i32", eps="fp32", stride_p="i32",
                 stride_d="i32", stride_bt="i32", stride_bb="i32", stride_po="i32",
                 stride_o="i32")
    before, after = _pdl_ops(attn_res_kernel, types, dict(
        NUM_BLOCKS=3, HAS_DELTA=True, WRITE=True, HAS_OUT_NORM=True, BLOCK_D=2048), 8)
    weights = {"norm_w_ptr", "query_ptr", "out_norm_w_ptr"}
    assert set().union(*(p for _, p in before)) == weights, before
    read = set().union(*(p for op, p in after if op.startswith("ld.global")))
    assert {"prefix_ptr", "delta_ptr", "blocks_ptr"} <= read and not read & weights, read
    written = set().union(*(p for op, p in after if op.startswith("st.global")))
    assert written == {"prefix_out_ptr", "blocks_ptr", "out_ptr"}, written


def test_kda_gate_pdl_sm90_only_weights_before_the_wait():
    from kdaserve.kernels.kda.triton_gate import kda_gate_beta_kernel

    types = dict(g_ptr="*bf16", a_log_ptr="*fp32", dt_bias_ptr="*fp32", b_ptr="*bf16",
                 g_out_ptr="*fp32", beta_out_ptr="*fp32", HK="i32", K="i32", H="i32",
                 lower_bound="fp32", stride_g="i32", stride_b="i32", stride_go="i32",
                 stride_bo="i32")
    before, after = _pdl_ops(kda_gate_beta_kernel, types, dict(BLOCK=1024, BLOCK_H=16))
    assert set().union(*(p for _, p in before)) == {"a_log_ptr", "dt_bias_ptr"}, before
    read = set().union(*(p for op, p in after if op.startswith("ld.global")))
    assert {"g_ptr", "b_ptr"} <= read, read


@pytest.mark.parametrize("name", ["situ_and_mul_kernel", "sigmoid_gate_kernel"])
def test_elementwise_pdl_sm90_nothing_before_the_wait(name):
    from kdaserve.kernels.activation import triton_activation

    types = {"situ_and_mul_kernel": dict(x_ptr="*bf16", out_ptr="*bf16", inter="i32",
                                         beta="fp32", linear_beta="fp32", stride_x="i32",
                                         stride_o="i32"),
             "sigmoid_gate_kernel": dict(x_ptr="*bf16", g_ptr="*bf16", n="i32",
                                         stride_x="i32", stride_g="i32")}[name]
    consts = dict(BLOCK=1024, **({"CLIP_UP": True} if name == "situ_and_mul_kernel" else {}))
    before, after = _pdl_ops(getattr(triton_activation, name), types, consts)
    assert before == [] and any(op.startswith("st.global") for op, _ in after)


@pytest.mark.parametrize("block_d,num_blocks", [(2048, 3), (8192, 8)])
def test_attn_res_sm90_no_register_spills(block_d, num_blocks, tmp_path):
    """kimi-k3-mini's and Kimi K3's hidden sizes (2048; 7168 in 8192 lanes, K3's up to 8
    blocks) with the wrapper's 8 warps: the row's fp32 accumulator, source and weights fit in
    registers (ptxas -v: no spill stores or loads)."""
    import subprocess
    from pathlib import Path

    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton's bundled ptxas is missing")
    import gemv_checks as gc
    from kdaserve.kernels.attn_res.triton_attn_res import attn_res_kernel

    types = dict(prefix_ptr="*bf16", delta_ptr="*bf16", blocks_ptr="*bf16", norm_w_ptr="*bf16",
                 query_ptr="*bf16", out_norm_w_ptr="*bf16", prefix_out_ptr="*bf16",
                 out_ptr="*bf16", D="i32", write_idx="i32", eps="fp32", stride_p="i32",
                 stride_d="i32", stride_bt="i32", stride_bb="i32", stride_po="i32",
                 stride_o="i32")
    k = gc.sm90_compile(attn_res_kernel, types, dict(
        NUM_BLOCKS=num_blocks, HAS_DELTA=True, WRITE=True, HAS_OUT_NORM=True, BLOCK_D=block_d,
        USE_PDL=True), num_warps=8, launch_pdl=True)
    (tmp_path / "k.ptx").write_text(k.asm["ptx"])
    res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in res.stderr, res.stderr
