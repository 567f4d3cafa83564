"""Per-step batch metadata shared by the KDA and MLA layers, and the caches the engine owns.

The batch is flattened: the tokens of all scheduled requests are concatenated, request i owning
rows query_start_loc[i]:query_start_loc[i+1]. The model runner orders requests so that decodes
(exactly one new token on top of a non-empty context) come first; prefills (or prefill chunks)
follow. Each layer kind reads only what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kdaserve.attention.dcp import DCPMetadata


STATE_INDEX_COLUMNS = 16
"""Least width of AttentionMetadata.state_indices_per_token (kda_backend.SHORT_PREFILL_MAX):
fla's fused recurrent kernel specialises on its row stride (stride_indices_seq is a constexpr),
so a width that followed max_query_len would compile one variant per longest row."""


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_decodes: int
    """The first num_decodes requests have exactly one query token and a non-empty context."""
    num_actual_tokens: int
    """Real tokens in the batch; rows past this are padding (CUDA-graph sizes)."""
    query_start_loc: torch.Tensor     # [num_reqs + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, host
    seq_lens: torch.Tensor            # [num_reqs] int32: context length after this step
    seq_lens_cpu: torch.Tensor        # [num_reqs] int32, host
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32, host: context before this step
    slot_mapping: torch.Tensor        # [num_tokens] int64: flat latent-KV slot (-1 = padding)
    block_table: torch.Tensor         # [num_reqs, max_blocks_per_req] int32
    state_indices: torch.Tensor       # [num_reqs] int32: KDA state slot of each request
    has_initial_state: torch.Tensor   # [num_reqs] bool: num_computed_tokens > 0
    max_query_len: int
    max_seq_len: int
    kda_checkpoints: "KDACheckpointRequest | None" = None
    spec: "SpecStep | None" = None
    """Speculative verification rows of this step (KDA layers only; None = none)."""
    mla_absorbed: "MLAAbsorbedRows | None" = None
    """Multi-token rows MLA computes in the absorbed form (speculative verification)."""
    dcp: "DCPMetadata | None" = None
    """Decode context parallelism (attention/dcp.py): slot_mapping then holds this rank's slots
    only (-1 for positions other ranks store) and MLA's absorbed rows attend over
    dcp.local_seq_lens; seq_lens stay the whole contexts. None = no DCP."""

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @cached_property
    def all_continue_state(self) -> bool:
        """Every request has context before this step (host; once per step, not per layer)."""
        return bool((self.num_computed_tokens_cpu[:self.num_reqs] > 0).all())

    @cached_property
    def prefill_cu_seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(device, host) int64 [num_prefills + 1]: the prefill requests' query_start_loc from
        0, built once per step. fla's chunk kernels memoise their chunk indices by the identity
        of these tensors, so the KDA layers after the first reuse them instead of rebuilding
        them with a host-to-device copy (a device sync) each."""
        nd = self.num_decodes
        dev = self.query_start_loc[nd:self.num_reqs + 1]
        host = self.query_start_loc_cpu[nd:self.num_reqs + 1]
        return (dev - dev[0]).long(), (host - host[0]).long()

    @cached_property
    def state_indices_per_token(self) -> torch.Tensor:
        """[num_reqs, max(max_query_len, STATE_INDEX_COLUMNS)] int32: each request's state slot
        in every column (the per-token slot layout of fla's fused recurrent kernel); built once
        per step. The width, whose row stride the kernel takes as a constexpr, is the same for
        every step of rows up to STATE_INDEX_COLUMNS tokens."""
        n = self.num_reqs
        width = max(self.max_query_len, STATE_INDEX_COLUMNS)
        return self.state_indices[:n, None].expand(n, width).contiguous()


@dataclass
class MLAAbsorbedRows:
    """Short multi-token query rows (speculative verification: last token + drafts) that MLA
    computes like decodes, in the absorbed form over the latent cache, one row per token: token
    j of request i sees its context and the window's tokens up to j (seq_len = num_computed_i
    + j + 1). No context is expanded with kv_b_proj, and one kernel call covers every row."""

    reqs: list[int]
    """Request indices (host); MLA's prefill path skips them."""
    token_start: int | None
    """The rows' tokens are [token_start, token_start + num_tokens) (contiguous layout)..."""
    tokens: torch.Tensor | None
    """...or these [S] int64 token indices (gather layout)."""
    seq_lens: torch.Tensor            # [S] int32
    block_table: torch.Tensor         # [S, max_blocks_per_req] int32: the token's request's row
    rows_per_seq: int = 1
    """> 1: every run of this many rows is one request's window (all windows one length), which
    the MLA decode can fold (KernelConfig.mla_verify_fold); 1: windows of varying lengths."""

    @property
    def num_tokens(self) -> int:
        return self.seq_lens.shape[0]

    def rows(self):
        """Index of the rows' tokens in the batch: a slice or an index tensor."""
        if self.tokens is not None:
            return self.tokens
        return slice(self.token_start, self.token_start + self.num_tokens)


@dataclass
class KDACheckpointRequest:
    """States to export from inside a prefill (hybrid prefix caching): for prefill request r,
    the recurrent + conv state after `offsets[i]` of its new tokens is written to checkpoint slot
    `dst_slots[i]`."""

    req_index: list[int]
    offsets: list[int]
    dst_slots: list[int]


@dataclass
class SpecStep:
    """The speculative-verification group of one step's batch, for the KDA layers.

    A spec row is a request verifying drafts: its query is [last token] + K_i drafts. MLA needs
    nothing from here (build_spec_step gives it md.mla_absorbed: one absorbed row per token). KDA
    runs the non-spec rows through the plain path with `md_non` and the spec rows through the
    verify kernels (kernels.kda.recover); after sampling the runner commits the accepted tokens
    from `records` / `conv_inputs` (recover) or selects the accepted column (per_position).

    Layouts: "contiguous": the spec rows are the batch's last rows, tokens [t_spec, T), and the
    non-spec rows its first, tokens [0, t_spec); each group is a slice. "gather": rows keep
    their plain order and each group is index_selected (tok_spec / tok_non) and index_copy_'d
    back (the baseline)."""

    layout: str
    per_position: bool
    t_spec: int
    """contiguous: first token of the spec group; gather: its token count."""
    cu_spec: torch.Tensor             # [N_spec + 1] int32: spec-group query_start_loc
    idx_spec: torch.Tensor            # [N_spec] int32 state slots, per_position [N_spec, 1 + K]
    md_non: AttentionMetadata | None
    """Metadata of the non-spec rows alone (None when every row is a spec row)."""
    tok_spec: torch.Tensor | None = None   # gather: [T_spec] int64 token indices
    tok_non: torch.Tensor | None = None    # gather: [T_non] int64
    conv_inputs: dict = field(default_factory=dict)
    """Per KDA layer, keyed by its conv cache's data_ptr(): the spec rows' pre-conv inputs
    [T_spec, 3P] (the conv commit replays the accepted ones)."""
    records: dict = field(default_factory=dict)
    """Per KDA layer, keyed by its recurrent cache's data_ptr(): KDARecoverRecords (recover)."""

    @property
    def num_spec_reqs(self) -> int:
        return self.cu_spec.shape[0] - 1


@dataclass
class ModelCaches:
    """Every cache tensor, allocated by the worker; layers find theirs by index."""

    mla_kv: list[torch.Tensor]
    """Per MLA layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], model dtype."""
    kda_recurrent: list[torch.Tensor]
    """Per KDA layer: [num_slots, num_heads, head_k_dim, head_v_dim] fp32."""
    kda_conv: list[torch.Tensor]
    """Per KDA layer: [num_slots, 3 * num_heads * head_dim, conv_kernel - 1] (q|k|v channels)."""

    @property
    def block_size(self) -> int:
        return self.mla_kv[0].shape[1] if self.mla_kv else 0

    def copy_state(self, src: int, dst: int) -> None:
        for rec, conv in zip(self.kda_recurrent, self.kda_conv):
            rec[dst].copy_(rec[src])
            conv[dst].copy_(conv[src])

    def copy_block(self, src: int, dst: int) -> None:
        for kv in self.mla_kv:
            kv[dst].copy_(kv[src])
