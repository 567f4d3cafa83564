"""benchmarks/count_ops.py on kimi-k3-tiny under TRITON_INTERPRET=1 (test_count_ops.py runs it
in a subprocess): the K3-only pieces on their Triton kernels give the reference model's logits
(fp32, 1e-4) and the launch counts the fusion promises; the weights are bench_k3.py's
LeCun-normal init, so the depth softmax, SiTU and the gates work far from their flat regions."""

import importlib.util
import os

import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "count_ops.py")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(SCRIPT),
                                                                     name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


co, bench_k3 = _load("count_ops"), _load("bench_k3")

ATTN_RES = "KimiLinearModel own ops (AttnRes reads / residual adds)"


def main() -> None:
    torch.set_num_threads(1)
    device, dtype = torch.device("cpu"), torch.float32
    runs = {}
    for k3 in (False, True):   # twins, then the Triton kernels
        # LeCun-normal weights (bench_k3's KL init): depth softmax and gates far from uniform
        model, args = co.build("kimi-k3-tiny", device, dtype, k3, seed=3,
                               init=bench_k3.realistic_init)
        table, logits = co.count_decode_step(model, args, device, dtype, context=20, seed=3)
        runs[k3] = co.summary(table), logits
    (ref_rows, ref_logits), (rows, logits) = runs[False], runs[True]
    rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert rel <= 1e-4, f"logits with the K3 kernels differ from the reference by {rel:.2e}"
    reads = 2 * args.num_hidden_layers + 1
    assert rows[ATTN_RES]["triton"] == {"attn_res_kernel": reads}, rows[ATTN_RES]
    assert rows[ATTN_RES]["aten_ops"] == 1, rows[ATTN_RES]        # the blocks' zero fill
    assert ref_rows[ATTN_RES]["aten_ops"] > 10 * reads, ref_rows[ATTN_RES]
    mlps = args.num_hidden_layers                    # the dense MLP + one shared MLP per MoE
    assert rows["MLP"]["triton"] == {"situ_and_mul_kernel": mlps}, rows["MLP"]
    assert rows["MLP"]["aten"] == {"mm": 2 * mlps}, rows["MLP"]   # gate|up and down
    mla = len(args.mla_layer_ids)
    assert rows["MLAttention"]["triton"] == {"sigmoid_gate_kernel": mla}
    assert "sigmoid" not in rows["MLAttention"]["aten"]
    # KDA's CPU path stays the reference (its bounded gate kernel serves the CUDA path's
    # prefills; CUDA decodes run the one-launch fused decode)
    assert rows["KimiDeltaAttention"] == ref_rows["KimiDeltaAttention"]
    print(co.format_table(ref_rows))
    print(co.format_table(rows))
    print("ok")


if __name__ == "__main__":
    main()
