"""benchmarks/count_ops.py on kimi-k3-tiny under TRITON_INTERPRET=1 (test_count_ops.py runs it
in a subprocess): the K3-only pieces on their Triton kernels give the reference model's logits
(fp32, 1e-4) and the launch counts the fusion promises."""

import importlib.util
import os

import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "count_ops.py")
spec = importlib.util.spec_from_file_location("count_ops", SCRIPT)
co = importlib.util.module_from_spec(spec)
spec.loader.exec_module(co)

ATTN_RES = "KimiLinearModel own ops (AttnRes reads / residual adds)"


def main() -> None:
    torch.set_num_threads(1)
    device, dtype = torch.device("cpu"), torch.float32
    runs = {}
    for k3 in (False, True):   # twins, then the Triton kernels
        model, args = co.build("kimi-k3-tiny", device, dtype, k3, seed=3)
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
    kda, mla = len(args.kda_layer_ids), len(args.mla_layer_ids)
    assert rows["KimiDeltaAttention"]["triton"] == {"kda_gate_beta_kernel": kda}
    assert rows["MLAttention"]["triton"] == {"sigmoid_gate_kernel": mla}
    assert "sigmoid" not in rows["MLAttention"]["aten"]
    assert "sigmoid" not in rows["KimiDeltaAttention"]["aten"]
    print(co.format_table(ref_rows))
    print(co.format_table(rows))
    print("ok")


if __name__ == "__main__":
    main()
