"""KDA over a step with speculative-verification rows (AttentionMetadata.spec).

The non-spec rows (decodes, prefill chunks) go through the plain backend path with the
non-spec metadata; the spec rows go through kernels.kda.recover: RecoverSSM verify (the state
pool is read only; records kept for the commit) or the per-position baseline (the state after
every window token written to its own slot). Both groups write straight into the layer's output:

- contiguous layout: each group is a slice of the batch, so the inputs are views and the plain
  path writes its output slice in place (the spec conv output is one copy: the verify kernel
  has no `out`);
- gather layout (the baseline): each group is index_selected from the batch and its output
  index_copy_'d back.

The plain path is passed in (`plain`) so that this module does not import the backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kdaserve.attention.metadata import SpecStep
from kdaserve.kernels.kda import recover as rc


def short_conv(x: torch.Tensor, weight: torch.Tensor, spec: SpecStep, conv_cache: torch.Tensor,
               out: torch.Tensor, plain: Callable) -> None:
    """x: [T, 3P] pre-conv q|k|v; out: [3, T, P] planes (CUDA) or [T, 3P] (CPU), written here.
    plain(x, weight, md, conv_cache, out) convolves the non-spec rows and updates their slots.
    Keeps the spec rows' inputs in spec.conv_inputs for the commit."""
    planes = out.dim() == 3
    tok_dim = 1 if planes else 0
    if spec.layout == "contiguous":
        t = spec.t_spec
        xs = x[t:]
        if spec.md_non is not None:
            plain(x[:t], weight, spec.md_non, conv_cache, out.narrow(tok_dim, 0, t))
        rc.conv_spec_verify(xs, weight, spec.cu_spec, conv_cache, spec.idx_spec,
                            per_position=spec.per_position,
                            out=out.narrow(tok_dim, t, xs.shape[0]))       # written in place
        # a view would pin the whole batch's [T, 3P] per layer until the commit
        spec.conv_inputs[conv_cache.data_ptr()] = xs if t == 0 else xs.clone()
        return
    xs = x.index_select(0, spec.tok_spec)
    if spec.md_non is not None:
        xn = x.index_select(0, spec.tok_non)
        on = xn.new_empty(out.shape[0], xn.shape[0], out.shape[2]) if planes else \
            torch.empty_like(xn)
        plain(xn, weight, spec.md_non, conv_cache, on)
        out.index_copy_(tok_dim, spec.tok_non, on)
    ys = rc.conv_spec_verify(xs, weight, spec.cu_spec, conv_cache, spec.idx_spec,
                             per_position=spec.per_position)
    out.index_copy_(tok_dim, spec.tok_spec, _as_out(ys, planes))
    spec.conv_inputs[conv_cache.data_ptr()] = xs


def _as_out(y: torch.Tensor, planes: bool) -> torch.Tensor:
    """y: [n, 3P] -> the output layout ([3, n, P] planes or as is)."""
    if not planes:
        return y
    return y.view(y.shape[0], 3, -1).transpose(0, 1)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor,
               beta_logits: torch.Tensor, gate, spec: SpecStep, rec_cache: torch.Tensor,
               out: torch.Tensor, plain: Callable) -> None:
    """Inputs as kda_backend.delta_rule; out: [T, H, V], written here.
    plain(q, k, v, g_raw, beta_logits, gate, md, rec_cache, out) runs the non-spec rows.
    Keeps the spec rows' RecoverSSM records in spec.records for the commit."""
    gate_params = rc.KDAGateParams(gate.A_log, gate.dt_bias, gate.lower_bound)
    inputs = (q, k, v, g_raw, beta_logits)
    if spec.layout == "contiguous":
        t = spec.t_spec
        if spec.md_non is not None:
            plain(*(x[:t] for x in inputs), gate, spec.md_non, rec_cache, out[:t])
        _, records = rc.kda_spec_verify(*(x[t:] for x in inputs), spec.cu_spec, rec_cache,
                                        spec.idx_spec, per_position=spec.per_position,
                                        gate=gate_params, out=out[t:])
    else:
        if spec.md_non is not None:
            on = out.new_empty(spec.tok_non.shape[0], *out.shape[1:])
            plain(*(x.index_select(0, spec.tok_non) for x in inputs), gate, spec.md_non,
                  rec_cache, on)
            out.index_copy_(0, spec.tok_non, on)
        os_, records = rc.kda_spec_verify(*(x.index_select(0, spec.tok_spec) for x in inputs),
                                          spec.cu_spec, rec_cache, spec.idx_spec,
                                          per_position=spec.per_position, gate=gate_params)
        out.index_copy_(0, spec.tok_spec, os_)
    if records is not None:
        spec.records[rec_cache.data_ptr()] = records


def commit(spec: SpecStep, kda_recurrent: list[torch.Tensor], kda_conv: list[torch.Tensor],
           num_accepted: torch.Tensor, state_indices: torch.Tensor | None = None) -> None:
    """After sampling: fold the first num_accepted[i] (= accepted drafts + 1) window tokens of
    each spec row into its state (recover), or move the state after them into the row's own
    slot (per_position). state_indices: recover only, the slots to write (default
    spec.idx_spec; the runner points rows at checkpoint slots to export a state)."""
    if spec.per_position:
        rc.select_per_position([*kda_recurrent, *kda_conv], spec.idx_spec, num_accepted)
        return
    idx = spec.idx_spec if state_indices is None else state_indices
    for rec, conv in zip(kda_recurrent, kda_conv):
        rc.kda_recover_commit(rec, idx, spec.records[rec.data_ptr()], spec.cu_spec,
                              num_accepted)
        rc.conv_recover_commit(conv, idx, spec.conv_inputs[conv.data_ptr()], spec.cu_spec,
                               num_accepted)
