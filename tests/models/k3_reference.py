"""A straightforward per-sequence fp32 Kimi K3 text model, written from
shared/reference/kimi_k3.md (§1.4 AttnRes, §1.5 / §2.1 KDA, §1.6 MLA, §1.7 LatentMoE, §1.8 SiTU,
§1.9 MXFP4) and reading a K3-scheme checkpoint's tensors directly. It shares no code with
kdaserve's model: the ground truth of the K3 logits tests."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4 as compressed-tensors packs it: low nibble = even column; 2^(e - 127)."""
    lo, hi = (packed & 15).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1)
    vals = torch.tensor(FP4, dtype=torch.float64)[codes]
    mult = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)
    return (vals * mult).float()


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class K3Reference:
    def __init__(self, sd: dict[str, torch.Tensor], text_cfg: dict):
        self.w = {k.removeprefix("language_model."): v.float() if v.is_floating_point() else v
                  for k, v in sd.items()}
        self.c = text_cfg
        lac = text_cfg["linear_attn_config"]
        self.kda_layers = {i - 1 for i in lac["kda_layers"]}
        self.n = text_cfg["num_hidden_layers"]
        self.eps = text_cfg["rms_norm_eps"]
        self.B = text_cfg["attn_res_block_size"]

    def p(self, name):
        return self.w[name]

    # -------------------------------------------------------------------- pieces

    def situ(self, g, u):
        b, bl = self.c["activation_situ_beta"], self.c["activation_situ_linear_beta"]
        return b * torch.tanh(g / b) * torch.sigmoid(g) * (bl * torch.tanh(u / bl))

    def mlp(self, x, pre):
        return self.situ(x @ self.p(pre + "gate_proj.weight").T,
                         x @ self.p(pre + "up_proj.weight").T) @ self.p(pre + "down_proj.weight").T

    def moe(self, x, pre):
        c = self.c
        logits = x @ self.p(pre + "gate.weight").T                        # [T, E]
        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + self.p(pre + "gate.e_score_correction_bias"),
                         c["num_experts_per_token"], dim=-1).indices
        wts = scores.gather(1, ids)
        wts = wts / wts.sum(-1, keepdim=True) * c["routed_scaling_factor"]
        lat = x @ self.p(pre + "routed_expert_down_proj.weight").T        # [T, L]
        out = torch.zeros_like(lat)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                w1, w3, w2 = (dequant(self.p(f"{pre}experts.{e}.{n}.weight_packed"),
                                      self.p(f"{pre}experts.{e}.{n}.weight_scale"))
                              for n in ("w1", "w3", "w2"))
                out[t] += wts[t, j] * (self.situ(lat[t] @ w1.T, lat[t] @ w3.T) @ w2.T)
        out = rms(out, self.p(pre + "routed_expert_norm.weight"), self.eps)
        return out @ self.p(pre + "routed_expert_up_proj.weight").T + self.mlp(
            x, pre + "shared_experts.")

    def kda(self, x, pre):
        lac = self.c["linear_attn_config"]
        H, K = lac["num_heads"], lac["head_dim"]
        T = x.shape[0]

        def conv(name, inp):                                   # depthwise causal conv + SiLU
            w = self.p(pre + name).reshape(inp.shape[1], -1)   # [P, W]
            W = w.shape[1]
            padded = torch.cat([inp.new_zeros(W - 1, inp.shape[1]), inp])
            y = torch.stack([(padded[t:t + W] * w.T).sum(0) for t in range(T)])
            return F.silu(y)

        q = conv("q_conv1d.weight", x @ self.p(pre + "q_proj.weight").T).view(T, H, K)
        k = conv("k_conv1d.weight", x @ self.p(pre + "k_proj.weight").T).view(T, H, K)
        v = conv("v_conv1d.weight", x @ self.p(pre + "v_proj.weight").T).view(T, H, K)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        raw = (x @ self.p(pre + "f_a_proj.weight").T) @ self.p(pre + "f_b_proj.weight").T
        A = self.p(pre + "A_log").reshape(1, H, 1).exp()
        g = lac["gate_lower_bound"] * torch.sigmoid(
            A * (raw.view(T, H, K) + self.p(pre + "dt_bias").view(1, H, K)))
        beta = torch.sigmoid(x @ self.p(pre + "b_proj.weight").T)         # [T, H]
        S = torch.zeros(H, K, K)                                          # [H, K(key), V]
        o = torch.zeros(T, H, K)
        for t in range(T):
            S = S * g[t].exp()[:, :, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + torch.einsum("hk,hv->hkv", k[t], u)
            o[t] = torch.einsum("hkv,hk->hv", S, q[t])
        gate = torch.sigmoid(x @ self.p(pre + "g_proj.weight").T).view(T, H, K)
        o = rms(o, self.p(pre + "o_norm.weight"), self.eps) * gate
        return o.reshape(T, H * K) @ self.p(pre + "o_proj.weight").T

    def mla(self, x, pre):
        c = self.c
        H, dn, dr, dv = (c["num_attention_heads"], c["qk_nope_head_dim"],
                         c["qk_rope_head_dim"], c["v_head_dim"])
        r = c["kv_lora_rank"]
        T = x.shape[0]
        q_a = rms(x @ self.p(pre + "q_a_proj.weight").T, self.p(pre + "q_a_layernorm.weight"),
                  self.eps)
        q = (q_a @ self.p(pre + "q_b_proj.weight").T).view(T, H, dn + dr)
        kv_a = x @ self.p(pre + "kv_a_proj_with_mqa.weight").T
        ckv = rms(kv_a[:, :r], self.p(pre + "kv_a_layernorm.weight"), 1e-6)
        kv = (ckv @ self.p(pre + "kv_b_proj.weight").T).view(T, H, dn + dv)
        k = torch.cat([kv[..., :dn], kv_a[:, None, r:].expand(T, H, dr)], -1)  # NoPE
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(dn + dr)
        scores = scores.masked_fill(~torch.ones(T, T).tril().bool(), float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), kv[..., dn:])
        o = o * torch.sigmoid(x @ self.p(pre + "g_proj.weight").T).view(T, H, dv)
        return o.reshape(T, H * dv) @ self.p(pre + "o_proj.weight").T

    # -------------------------------------------------------------------- AttnRes model

    def read(self, blocks, prefix, n, norm_name, proj_name, out_norm_name):
        """Softmax over [blocks[:n], prefix] with logits q . RMSNorm(source)."""
        src = torch.stack(blocks[:n] + [prefix], dim=1)                  # [T, S, D]
        logits = (rms(src, self.p(norm_name), self.eps) * self.p(proj_name)[0]).sum(-1)
        mixed = (logits.softmax(-1)[..., None] * src).sum(1)
        return mixed if out_norm_name is None else rms(mixed, self.p(out_norm_name), self.eps)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """ids: one sequence -> fp32 logits [T, V]."""
        x = self.p("model.embed_tokens.weight")[torch.tensor(ids)]
        blocks: list[torch.Tensor] = []
        prefix, mlp_out = x, None
        for i in range(self.n):
            pre = f"model.layers.{i}."
            if mlp_out is not None:
                prefix = prefix + mlp_out
            if i % self.B == 0:                                # a new block starts here
                blocks.append(prefix)
                n_prev = len(blocks) - 1
            else:
                n_prev = len(blocks)
            h = self.read(blocks, prefix, n_prev, pre + "self_attention_res_norm.weight",
                          pre + "self_attention_res_proj.weight", pre + "input_layernorm.weight")
            a = (self.kda if i in self.kda_layers else self.mla)(h, pre + "self_attn.")
            prefix = a if i % self.B == 0 else prefix + a
            h = self.read(blocks, prefix, len(blocks), pre + "mlp_res_norm.weight",
                          pre + "mlp_res_proj.weight", pre + "post_attention_layernorm.weight")
            dense = i < self.c["first_k_dense_replace"]
            mlp_out = self.mlp(h, pre + "mlp.") if dense else self.moe(h, pre + "block_sparse_moe.")
        prefix = prefix + mlp_out
        h = self.read(blocks, prefix, len(blocks), "model.output_attn_res_norm.weight",
                      "model.output_attn_res_proj.weight", None)
        h = rms(h, self.p("model.norm.weight"), self.eps)
        return h @ self.p("lm_head.weight").T
