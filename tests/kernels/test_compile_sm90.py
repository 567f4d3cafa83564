"""Every kernel launch of the interpreter checks also compiles for sm_90 (H100 / H200) with
Triton's own toolchain, on a machine without a GPU: the interpreter accepts code the compiler
rejects (a loop-carried value changing type, a tl.dot below 16, ...), and CI has no GPU. The
MXFP4 MoE kernels must be among them at every tile class of their default_config, since the
production tiles are constexprs that small test shapes would otherwise shrink away."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPTS = ["kernel_checks.py", "interp_extras.py", "gemv_checks.py",
           "test_top_p_threshold.py", "../spec_decode/recover_checks.py", "mxfp4_moe_checks.py",
           "k3_ops_checks.py", "mla_merge_checks.py", "race_checks.py",
           "skinny_checks.py"]
KERNELS = {"conv_varlen_kernel", "conv_varlen_state_kernel",
           "conv_update_kernel",
           "mla_decode_partial_kernel", "mla_decode_partial_t_kernel", "mla_decode_reduce_kernel",
           "mla_decode_partial_fold_kernel",
           "store_latent_kernel", "moe_gemm1_kernel", "moe_gemm2_kernel", "moe_sum_kernel",
           "topk_sigmoid_kernel", "router_logits_kernel", "router_partials_kernel",
           "add_rms_norm_kernel", "rms_norm_gated_kernel",
           "search_pass_kernel", "narrow_kernel", "race_partial_kernel", "race_reduce_kernel", "gemv_kernel",
           "kda_spec_verify_kernel",
           "kda_recover_commit_kernel", "conv_spec_verify_kernel", "moe_gemm2_sum_kernel",
           "mxfp4_moe_gemm1_kernel", "mxfp4_moe_gemm2_kernel", "mxfp4_moe_gemv1_kernel",
           "mxfp4_moe_gemv2_kernel", "latent_moe_tail_kernel",
           "latent_moe_tail_gemv_kernel",
           "attn_res_kernel", "situ_and_mul_kernel", "sigmoid_gate_kernel",
           "kda_gate_beta_kernel", "merge_attn_states_kernel", "mxfp4_decode_probe_kernel",
           "mla_prefill_attn_kernel", "skinny_gemm_kernel"}


def test_interpreter_launches_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    launches = tmp_path / "launches.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    rec = subprocess.run([sys.executable, str(HERE / "record_launches.py"), str(launches),
                          *SCRIPTS], env=dict(env, TRITON_INTERPRET="1"), capture_output=True,
                         text=True, timeout=900)
    assert rec.returncode == 0, rec.stdout[-2000:] + rec.stderr[-4000:]
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(HERE / "compile_sm90.py"), str(launches)],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    compiled = set(out.stdout.strip().splitlines()[-1].split(": ", 1)[1].split())
    assert KERNELS <= compiled, sorted(KERNELS - compiled)
    assert not _missing_mxfp4_moe_tiles(launches), _missing_mxfp4_moe_tiles(launches)


def _missing_mxfp4_moe_tiles(launches: Path) -> list:
    """The tile classes of kernels/moe/mxfp4_moe.py default_config (GEMMs and tail), and the
    opt-in GEMV tile GEMM_GEMV, that no recorded launch used unshrunk: each one must be among
    the launches compiled above."""
    from kdaserve.kernels.moe.mxfp4_moe import GEMM_CLASSES, GEMM_GEMV, TAIL_CLASSES

    seen = set()
    for line in launches.read_text().splitlines():
        rec = json.loads(line)
        consts = {n: a.get("value") for n, a in rec["args"].items() if n.isupper()}
        seen.add((rec["name"], consts.get("BLOCK_M"), consts.get("BLOCK_N"),
                  consts.get("BLOCK_K"), rec["options"].get("num_warps"),
                  rec["options"].get("num_stages")))
    want = [(name, t["block_m"], t["block_n"], t["block_k"], t["num_warps"], t["num_stages"])
            for _, t in GEMM_CLASSES for name in ("mxfp4_moe_gemm1_kernel",
                                                  "mxfp4_moe_gemm2_kernel")]
    want += [(name, None, GEMM_GEMV["block_n"], GEMM_GEMV["block_k"], GEMM_GEMV["num_warps"],
              GEMM_GEMV["num_stages"]) for name in ("mxfp4_moe_gemv1_kernel",
                                                    "mxfp4_moe_gemv2_kernel")]
    want += [("latent_moe_tail_kernel", t["tail_block_m"], t["tail_block_n"], t["tail_block_k"],
              t["tail_num_warps"], t["tail_num_stages"]) if t["tail_block_m"] > 1 else
             ("latent_moe_tail_gemv_kernel", None, t["tail_block_n"], t["tail_block_k"],
              t["tail_num_warps"], t["tail_num_stages"]) for _, t in TAIL_CLASSES]
    return [w for w in want if w not in seen]
