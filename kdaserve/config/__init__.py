"""Engine configuration: one dataclass per concern, field names = vLLM flag names."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.config.synthetic import resolve_synthetic_rates


@dataclass
class ModelConfig:
    model: str
    """Path to an HF-style model folder (config.json + safetensors + tokenizer)."""
    tokenizer: str | None = None
    dtype: str = "auto"
    """auto | bfloat16 | float16 | float32. auto = bf16 on CUDA, fp32 on the CPU."""
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    trust_remote_code: bool = False
    quantization: str | None = None
    """vLLM's --quantization. None: as the checkpoint says (its quantization_config); "mxfp4":
    routed experts in MXFP4 (a checkpoint's model-dtype experts are quantised at load)."""

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = self.model
        cfg_path = os.path.join(self.model, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model folder {self.model!r} has no config.json")
        with open(cfg_path) as f:
            self.hf_config: dict[str, Any] = json.load(f)
        self.arch = KimiLinearArgs.from_hf_config(self.hf_config)
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or "
                                 f"None, got {self.quantization!r}")
            self.arch = dataclasses.replace(self.arch, expert_quantization=self.quantization)
            self.arch.validate()
        limit = self.arch.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's limit {limit}")

    def torch_dtype(self, device_type: str):
        import torch

        names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                 "half": torch.float16, "float32": torch.float32, "float": torch.float32}
        if self.dtype == "auto":
            return torch.bfloat16 if device_type == "cuda" else torch.float32
        if self.dtype not in names:
            raise ValueError(f"unknown dtype {self.dtype!r}; use auto, bfloat16, float16 or float32")
        return names[self.dtype]


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per MLA latent-KV block."""
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None
    """Explicit MLA KV block count (CPU default: 512; GPU: sized from memory when None)."""
    num_state_slots: int | None = None
    """Explicit KDA state slot count (CPU default: max_num_seqs + 8; GPU: sized from memory)."""
    enable_prefix_caching: bool = True
    kda_checkpoint_interval: int | None = None
    """Tokens between KDA prefix checkpoints (a multiple of block_size); None = the smallest
    multiple of lcm(block_size, 64) that is >= 512 (512 for block_size 16)."""
    kda_checkpoint_mode: str = "internal"
    """internal: a prefill exports the KDA states at the checkpoints it crosses from inside the
    same kernel call; split: the baseline that ends a prefill chunk at the last checkpoint it
    crosses (one more forward pass), for ablation."""
    kda_checkpoint_turn_end: bool = True
    """Also checkpoint at the end of each prompt and where each request finishes (any token
    position: where the next turn of a chat or agent loop diverges)."""
    num_kda_checkpoint_slots: int | None = None
    """KDA checkpoint slots (each one request slot's size). None: 64 on the CPU, on CUDA 10% of
    the cache memory budget (at most max(64, 2 * max_num_seqs)); 0 without prefix caching."""
    kv_offload_size: float = 0.0
    """GiB of host memory (over all ranks) for the prefix cache's offload tier: evicted MLA
    blocks and KDA checkpoints spill there (0: no tier). Pinned on CUDA."""
    kv_offload_disk_path: str | None = None
    """Folder of the offload tier's disk level (host entries are written through to files
    there and read back after a restart); None: host memory only."""
    kv_offload_disk_size: float = 64.0
    """GiB the disk level may fill (over all ranks), least recently used files dropped."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kda_checkpoint_mode not in ("internal", "split"):
            raise ValueError(f"kda_checkpoint_mode must be internal or split, got "
                             f"{self.kda_checkpoint_mode!r}")
        interval = self.kda_checkpoint_interval
        if interval is not None and (interval < 1 or interval % self.block_size):
            raise ValueError(f"kda_checkpoint_interval={interval} must be a positive multiple "
                             f"of block_size={self.block_size}")
        if self.num_kda_checkpoint_slots is not None and self.num_kda_checkpoint_slots < 0:
            raise ValueError(f"num_kda_checkpoint_slots must be >= 0, got "
                             f"{self.num_kda_checkpoint_slots}")
        if not self.kv_offload_size >= 0:
            raise ValueError(f"kv_offload_size must be >= 0 GiB, got {self.kv_offload_size}")
        if self.kv_offload_size > 0 and not self.enable_prefix_caching:
            raise ValueError("kv_offload_size > 0 needs prefix caching (the tier holds what "
                             "the prefix cache evicts): drop --no-enable-prefix-caching")
        if self.kv_offload_disk_path is not None:
            if self.kv_offload_size <= 0:
                raise ValueError("kv_offload_disk_path needs kv_offload_size > 0 (the disk "
                                 "level is written through from host memory)")
            if not self.kv_offload_disk_size > 0:
                raise ValueError(f"kv_offload_disk_size must be > 0 GiB, got "
                                 f"{self.kv_offload_disk_size}")

    @property
    def checkpoint_interval(self) -> int:
        """kda_checkpoint_interval resolved (see its docstring)."""
        if self.kda_checkpoint_interval is not None:
            return self.kda_checkpoint_interval
        unit = math.lcm(self.block_size, 64)
        return unit * -(-512 // unit)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0
    """Cap on tokens of one prefill per step (0 = no cap beyond the budget)."""
    enable_chunked_prefill: bool = True
    adaptive_spec_budget: bool = True
    """Reserve draft slots only for requests actually scheduled (off: the static rule that
    reserves them for max_num_seqs requests)."""
    async_scheduling: bool = True
    """Schedule and launch step N+1 before step N's sampled ids reach the host (they feed N+1
    on the device), so the host work of one step overlaps the device work of the other. The
    engine falls back to one step at a time under speculative decoding and while a running
    request uses penalties (both need the host tokens before the next step)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ParallelConfig:
    """vLLM's / SGLang's names. Ranks are laid out node by node: node n hosts ranks
    n * ranks_per_node .. (n + 1) * ranks_per_node - 1; rank 0 (node 0) sits beside the
    scheduler, worker nodes (node_rank > 0, `serve --headless`) only host ranks."""
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    """Node 0's address: torch.distributed's rendezvous (tcp://master_addr:master_port)."""
    master_port: int | None = None
    """None: a free port on node 0 (single node only; several nodes must agree on one)."""
    dist_timeout: int = 600
    """Seconds a collective of the tensor-parallel group may wait for a peer before it fails
    (NCCL's and gloo's timeout); a dead rank fails the step sooner (engine/core.py)."""
    decode_context_parallel_size: int = 1
    """DCP: MLA's latent KV sharded along the sequence over groups of this many consecutive
    TP ranks (must divide tensor_parallel_size), so each rank stores 1/dcp of every context
    and the KV capacity grows dcp times (attention/dcp.py). KDA state is not sharded by it."""
    dcp_kv_cache_interleave_size: int = 1
    """DCP: position p is stored on DCP rank (p // size) % dcp (1 = token round robin; must
    divide block_size)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "nnodes", "dist_timeout",
                     "decode_context_parallel_size", "dcp_kv_cache_interleave_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ValueError(f"decode_context_parallel_size={self.decode_context_parallel_size}"
                             f" must divide tensor_parallel_size={self.tensor_parallel_size} "
                             "(the DCP ranks are sub-groups of the TP group)")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks (tensor_parallel_size="
                             f"{self.tensor_parallel_size}) do not split evenly over "
                             f"nnodes={self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got "
                             f"{self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("nnodes > 1 needs master_port (every node must use the same one)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node hosts."""
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)


SPEC_METHODS = ("ngram", "draft_model", "mtp", "dspark")


@dataclass
class SpeculativeConfig:
    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_sample_method: str = "greedy"
    """draft_model, mtp and dspark: greedy (argmax drafts) or probabilistic (drafts sampled at the
    request's temperature, their distributions go to the rejection sampler)."""
    rejection_sample_method: str = "standard"
    synthetic_acceptance_length: float | None = None
    synthetic_acceptance_rates: list[float] | None = None
    kda_state_mode: str = "recover"
    """recover: one KDA state slot per request, verify from it read-only and fold the accepted
    tokens in after sampling (RecoverSSM); per_position: the baseline that writes the state after
    every window token into 1 + K slots per request and keeps the accepted one."""
    batch_layout: str = "contiguous"
    """contiguous: spec rows last, each KDA group a slice of the batch (no copies); gather: the
    baseline that keeps the plain request order and index_selects / index_copy_s each group."""
    disable_by_batch_size: int | None = None
    """vLLM's key: no drafts are proposed in a step whose batch holds at least this many
    requests (large batches gain little from speculation and pay for the wider verify)."""
    draft_catchup: str = "window"
    """draft_model only. window: the draft's catch-up over the accepted tokens runs as K+1-row
    windows in the verify form, commit included (one CUDA-graph replay on the GPU); varlen: the
    baseline, a varlen prefill of exactly the new tokens (eager)."""

    synthetic_rates: list[float] | None = field(default=None, init=False)
    """Resolved unconditional per-position rates (rejection_sample_method="synthetic")."""

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got "
                             f"{self.method!r}")
        if self.num_speculative_tokens < 0 or (self.method is not None
                                               and self.num_speculative_tokens < 1):
            raise ValueError(f"num_speculative_tokens must be >= 1 with method="
                             f"{self.method!r}, got {self.num_speculative_tokens}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs model (the draft model "
                             "folder)")
        if self.method == "dspark" and not self.model:
            raise ValueError("speculative method 'dspark' needs model (the speculators-format "
                             "DSpark folder)")
        for name, allowed in (("draft_sample_method", ("greedy", "probabilistic")),
                              ("rejection_sample_method", ("standard", "synthetic")),
                              ("kda_state_mode", ("recover", "per_position")),
                              ("batch_layout", ("contiguous", "gather")),
                              ("draft_catchup", ("window", "varlen"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(f"disable_by_batch_size must be >= 2, got "
                             f"{self.disable_by_batch_size}")
        if self.prompt_lookup_min < 1 or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.rejection_sample_method == "synthetic" and self.enabled:
            self.synthetic_rates = resolve_synthetic_rates(
                self.num_speculative_tokens, self.synthetic_acceptance_rates,
                self.synthetic_acceptance_length)

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.num_speculative_tokens > 0


KV_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")

KV_CONNECTOR_EXTRA_DEFAULTS: dict[str, Any] = {
    "hold_timeout_s": 120.0,
    "load_timeout_s": 30.0,
    "handshake_timeout_s": 5.0,
    "backends": ["UCX"],
}
"""kv_connector_extra_config keys and their defaults. hold_timeout_s: how long a producer holds
a finished request's KV blocks and KDA state slot for its consumer to pull them; load_timeout_s:
how long a consumer waits for a pull before it recomputes the prompt (capped at half the
producer's hold, so a pull never reads blocks the producer has freed); handshake_timeout_s: the
side-channel exchange of agent metadata; backends: NIXL backends to create."""


@dataclass
class KVTransferConfig:
    """vLLM's --kv-transfer-config: which connector moves the KV blocks and KDA state between
    instances (prefill/decode disaggregation), and this instance's role."""

    kv_connector: str
    kv_role: str
    engine_id: str | None = None
    """Names this instance to its peers (None: a random id at start-up)."""
    kv_ip: str = "127.0.0.1"
    """Address of the producer's side channel (agent metadata, releases), as consumers reach it."""
    kv_port: int = 0
    """Side-channel port of TP rank 0 (rank r listens on kv_port + r); 0: a free port each."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Connector knobs (KV_CONNECTOR_EXTRA_DEFAULTS); unknown keys are an error."""
    kv_buffer_device: str = "cuda"
    """Where transfers read and write: "cuda", the caches themselves (device memory on a GPU);
    "cpu", host buffers of kv_buffer_size bytes on each side, the producer copying a request's
    blocks and state in and the consumer copying them out (for transports that cannot reach
    device memory quickly). Both sides of a transfer must agree."""
    kv_buffer_size: float = 1e9
    """Bytes of each side's host buffer with kv_buffer_device "cpu" (one request's state must
    fit; requests beyond it wait for buffer space)."""

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS)}, got "
                             f"{self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got "
                             f"{self.kv_role!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be in 0..65535, got {self.kv_port!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")
        unknown = sorted(set(extra) - set(KV_CONNECTOR_EXTRA_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; valid keys: "
                             f"{', '.join(KV_CONNECTOR_EXTRA_DEFAULTS)}")
        self.kv_connector_extra_config = KV_CONNECTOR_EXTRA_DEFAULTS | extra
        for key in ("hold_timeout_s", "load_timeout_s", "handshake_timeout_s"):
            v = self.kv_connector_extra_config[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"kv_connector_extra_config {key!r} must be a number > 0, "
                                 f"got {v!r}")
        if self.kv_buffer_device not in ("cuda", "cpu"):
            raise ValueError(f"kv_buffer_device must be 'cuda' or 'cpu', got "
                             f"{self.kv_buffer_device!r}")
        if (isinstance(self.kv_buffer_size, bool)
                or not isinstance(self.kv_buffer_size, (int, float))
                or not self.kv_buffer_size >= 2**20):
            raise ValueError(f"kv_buffer_size must be a number of bytes >= 1 MiB, got "
                             f"{self.kv_buffer_size!r}")
        backends = self.kv_connector_extra_config["backends"]
        if not (isinstance(backends, list) and backends
                and all(isinstance(b, str) for b in backends)):
            raise ValueError(f"kv_connector_extra_config 'backends' must be a non-empty list "
                             f"of names, got {backends!r}")

    @classmethod
    def from_dict(cls, data: Any) -> "KVTransferConfig":
        """From the flag's JSON object; a missing or unknown key is a ValueError."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {data!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown kv_transfer_config keys {unknown}; valid keys: "
                             f"{', '.join(sorted(names))}")
        for key in ("kv_connector", "kv_role"):
            if key not in data:
                raise ValueError(f"kv_transfer_config needs {key!r}")
        return cls(**data)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def staged(self) -> bool:
        """Transfers go through host buffers (kv_buffer_device "cpu")."""
        return self.kv_buffer_device == "cpu"

    def extra(self, key: str) -> Any:
        return self.kv_connector_extra_config[key]


LOAD_FORMATS = ("auto", "safetensors", "fastsafetensors", "dummy")
QUANTIZATIONS = ("mxfp4",)


@dataclass
class LoadConfig:
    load_format: str = "auto"
    """auto | safetensors | fastsafetensors | dummy. fastsafetensors reads the safetensors
    files through the fastsafetensors library (the safetensors walk, after one log line, where
    it is not installed)."""
    dummy_routing: str = "vllm"
    """Dummy weights only. vllm: every float weight uniform in [-1e-3, 1e-3] (vLLM's convention,
    routing collapses onto the same experts); spread: router weights drawn so that tokens pick
    different experts."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got "
                             f"{self.load_format!r}")
        if self.dummy_routing not in ("vllm", "spread"):
            raise ValueError(f"dummy_routing must be vllm or spread, got {self.dummy_routing!r}")


@dataclass
class KernelConfig:
    """Kernel choices on CUDA (no effect on the CPU reference path), read once at start-up to
    pick each layer kind's backend (kdaserve/layers/backends.py). All off = the baseline (each
    switch says what it replaces); the defaults are the fastest measured set
    (benchmarks/PERF_NOTES.md)."""
    decode_gemv: bool = True
    """Projections of 1-2 token rows (decode batches <= 2) through the Triton GEMV
    (kernels/linear/gemv.py) instead of cuBLAS; the router reads its fp32 weight directly."""
    skinny_gemm: bool = True
    """With decode_gemv: projections of 3-64 rows (decode batches of 3-64, small verify steps)
    through the Triton skinny GEMM (kernels/linear/skinny.py: tensor cores, one program per
    output tile holding every row, each weight element read once) instead of cuBLAS."""
    router_partials: bool = True
    """The MoE router's fp32 logits of 3-64 rows (decode batches, small verify steps) as
    K-split partial products on the CUDA cores that the top-k launch adds up
    (kernels/moe/router.py router_partials), instead of a cast launch and cuBLAS's fp32 GEMM."""
    pdl: bool = True
    """Triton kernels inside the captured CUDA graphs launched with programmatic dependent
    launch (Hopper and newer; off on older GPUs): each may start while the previous kernel
    finishes, reading only weights before `griddepcontrol.wait`. Takes effect with decode_gemv
    for the projections. Eager steps launch without it (the step plan decides)."""
    fused_kda_decode: bool = True
    """Decode-only steps run each KDA layer's conv update, gate projections, delta rule and
    gated norm in one Triton launch (kernels/kda/decode_fused.py) instead of five."""
    kda_state_prefetch: bool = True
    """With fused_kda_decode and pdl: the one-launch KDA decode reads its state index, conv
    windows and recurrent state before its PDL wait, so they stream while the input
    projection finishes."""
    mla_absorb_gemv: bool = True
    """Decode batches <= 2: MLA's per-head W_UK and W_UV products (the absorbed decode) as one
    batched Triton GEMV launch each (kernels/linear/gemv.py gemv_batched) instead of cuBLAS;
    the MLA decode kernel behind the W_UK GEMV then reads its first cache tile before its PDL
    wait (the GEMV does not write the cache)."""
    dense_mlp_gemv: bool = True
    """With decode_gemv, decode batches <= 2: the dense SwiGLU MLP (layer 0; Kimi K3's SiTU
    MLPs, shared experts included) as two GEMV launches, gate|up then the down projection
    reading silu(gate) * up (or SiTU) in its K loop (kernels/linear/gemv.py swiglu, situ),
    instead of three cuBLAS GEMMs and the activation's ops."""
    latent_moe_fused_tail: bool = True
    """Latent MoE (Kimi K3): the routed experts (MXFP4 or bf16) as the Triton latent-MoE
    kernels, whose tail launch sums the top-k expert outputs while it runs the latent norm and
    up projection (kernels/moe/mxfp4_moe.py), instead of experts, top-k sum, norm and up
    projection as separate ops."""
    k3_fused_ops: bool = True
    """Kimi K3's pieces that are elementwise or per-row reductions as one Triton launch each
    (layers/backends.py attn_res, gated_act, k3_gates): each AttnRes read, the SiTU of the
    dense and shared-expert MLPs (after one merged gate|up projection), MLA's sigmoid output
    gate, KDA's bounded decay gate with beta; instead of their plain-torch twins (tens of
    small launches a layer)."""
    sampling_threshold_kernel: bool = True
    """Top-k / top-p of the sampler and the rejection sampler through the sort-free threshold
    search (kernels/sample/top_p.py) instead of a full sort of the vocabulary per row."""
    sampling_race_kernel: bool = True
    """The sampler's random draw (and the candidates of synthetic acceptance) as one Triton
    pass over the filtered logits, an exponential race with in-kernel Philox noise and the
    top-p threshold as its cut (kernels/sample/race.py), instead of masking, softmax, a noise
    tensor, a division and an argmax over the vocabulary."""
    mla_verify_fold: bool = True
    """Speculative verify steps whose windows all have one length (the verify CUDA graphs, the
    DSpark block pass): the MLA decode takes 2 rows of a window as one program's columns
    (kernels/mla/triton_decode.py mla_decode_partial_fold_kernel), so a window's context is
    read once per 2 rows instead of once per row (benchmarks/PERF_NOTES.md: a small gain on the
    verify forward at batch 1 and 16). Off: one program per row."""
    moe_tma_weights: bool = True
    """The fused MoE's wgmma tile classes (64 and more rows a block: 33-64 tokens, and more
    than 32 routing entries an expert on average, as in prefill) read the bf16 expert weights
    by TMA through tensor descriptors instead of pointer tiles (kernels/moe/fused_moe.py
    MoEGemmConfig.tma_weights; the pointer tiles spill registers in the sm_90 build of the
    prefill tiles; benchmarks/PERF_NOTES.md, Decisions). Hopper and later; experts whose rows
    are not whole 16-byte units keep pointer tiles. Off: pointer tiles everywhere."""

    @classmethod
    def baseline(cls) -> "KernelConfig":
        """Every switch off: the plain path each optimisation is measured against."""
        return cls(**{f: False for f in cls.__dataclass_fields__})


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    device: str = "auto"
    """auto | cuda | cpu."""
    enforce_eager: bool = False
    max_logprobs: int = 20
    compile_workers: int | None = None
    """CUDA start-up: processes (per rank) that compile kdaserve's Triton kernel variants while
    the start-up forwards run once without them (kernels/compile_ahead.py); 0: each variant
    compiles in the rank's own thread at its first launch; None: the host's CPUs shared by its
    ranks (kernels.compile_ahead.default_compile_workers)."""
    kv_transfer_config: KVTransferConfig | None = None
    """Prefill/decode disaggregation (None: this instance serves alone)."""

    def __post_init__(self) -> None:
        if self.compile_workers is not None and (
                not isinstance(self.compile_workers, int) or isinstance(self.compile_workers, bool)
                or self.compile_workers < 0):
            raise ValueError(f"compile_workers must be an int >= 0 or None (as many as the "
                             f"host's CPUs allow), got {self.compile_workers!r}")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.scheduler_config.max_model_len = self.model_config.max_model_len
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.from_dict(self.kv_transfer_config)
            if self.speculative_config.enabled:
                raise ValueError("kv_transfer_config with speculative decoding is not "
                                 "supported yet")
            pc = self.parallel_config
            if pc.decode_context_parallel_size > 1:
                raise ValueError("kv_transfer_config with decode_context_parallel_size="
                                 f"{pc.decode_context_parallel_size} is not supported: the "
                                 "connector sends the latent KV from one rank, DCP shards it")
            if pc.nnodes > 1:
                raise ValueError(f"kv_transfer_config with nnodes={pc.nnodes} is not "
                                 "supported: every rank's side channel is reached at kv_ip")
        spec = self.speculative_config
        if spec.method == "mtp":   # the target's own MTP layers draft
            n = self.model_config.arch.num_nextn_predict_layers
            if n < 1:
                raise ValueError("speculative method 'mtp' needs a target with MTP layers "
                                 f"(num_nextn_predict_layers >= 1); {self.model_config.model!r}"
                                 f" has num_nextn_predict_layers={n}")
            if spec.model is None:
                spec.model = self.model_config.model
        self._check_dcp()

    def _check_dcp(self) -> None:
        """Decode context parallelism's combinations (ParallelConfig checks the sizes)."""
        pc = self.parallel_config
        dcp, inter = pc.decode_context_parallel_size, pc.dcp_kv_cache_interleave_size
        if dcp == 1:
            return
        block = self.cache_config.block_size
        if block % inter:
            raise ValueError(f"dcp_kv_cache_interleave_size={inter} must divide block_size="
                             f"{block} (decode_context_parallel_size={dcp})")
        if self.speculative_config.enabled:
            raise ValueError(f"decode_context_parallel_size={dcp} with speculative decoding "
                             f"(method {self.speculative_config.method!r}) is not supported: "
                             "the verification rows and the drafters' caches are not sharded")
