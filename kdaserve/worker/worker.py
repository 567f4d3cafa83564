"""The worker: one rank's start-up (device, model load, kernel backends, cache sizing and
allocation, warm-up, graph capture) and its model runner, which runs the steps.

Under tensor parallelism every rank runs one Worker with its ParallelState (worker/executor.py
starts the ranks and drives them): the model holds the rank's shard, the KDA state its heads,
the cache sizes are the minimum over the ranks, and every rank runs the same steps (the same
sampling included: the logits are gathered on every rank and the random generators seeded
alike), so the collectives inside the forward always meet."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import time

import torch

from kdaserve.attention import caches as cache_sizes
from kdaserve.attention.builder import build_metadata
from kdaserve.attention.dcp import DCPGroup
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.config import EngineConfig, KernelConfig
from kdaserve.core.offload import host_tier_slots
from kdaserve.core.offload_index import layout_fingerprint
from kdaserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kdaserve.distributed.parallel_state import ParallelState
from kdaserve.disagg.base import ConnectorWorker
from kdaserve.disagg.factory import make_connector_worker
from kdaserve.disagg.ranks import RankAgreement
from kdaserve.kernels.compile_ahead import CompileAhead, default_compile_workers
from kdaserve.kernels.fla_configs import device_traits, use_stored_configs
from kdaserve.layers.backends import select_backends
from kdaserve.models.loader import load_weights
from kdaserve.models.registry import build_model, resolve_architecture
from kdaserve.sample.sampler import Sampler
from kdaserve.spec_decode.decoder import SpecDecoder
from kdaserve.spec_decode.metrics import SpecDecodingStats
from kdaserve.worker import checkpoints
from kdaserve.worker.cuda_graphs import CudaGraphManager, DecodeGraphs
from kdaserve.worker.input_batch import LaunchedStep
from kdaserve.worker.model_runner import ModelRunner
from kdaserve.worker.offload import OffloadWorker
from kdaserve.worker.warmup import warmup_sampler, warmup_steps

logger = logging.getLogger(__name__)


def supported_kernels(kc: KernelConfig, device: torch.device) -> KernelConfig:
    """kc less what this device cannot run: PDL and the MoE's TMA weight tiles need compute
    capability 9.0 (Hopper)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9:
        return kc
    off = {name: False for name in ("pdl", "moe_tma_weights") if getattr(kc, name)}
    if off:
        logger.info("%s off: compute capability %s < 9.0", ", ".join(off),
                    torch.cuda.get_device_capability(device))
    return dataclasses.replace(kc, **off)


def cache_budget(total: int, free: int, reserved: int, used_at_start: int, peak: int,
                 allocated: int, gpu_memory_utilization: float) -> float:
    """Device bytes for the KV blocks and KDA slots after the profile run. The instance's share
    is gpu_memory_utilization of the device (vLLM's meaning): memory other processes hold is
    not charged to it (used_at_start: in use outside this process's allocator before the model
    loaded), what this process took outside torch since (cuBLAS workspaces, NCCL) is, and so
    is its allocator's peak. The pools are new multi-GiB tensors: only memory the driver
    reports free can hold them (reserved-but-unused fragments cannot), less room for the
    activation peak."""
    own_non_torch = max(0, total - free - reserved - used_at_start)
    budget = total * gpu_memory_utilization - peak - own_non_torch
    activations = peak - allocated
    return min(budget, free - activations - (256 << 20))


def _allocator_setter():
    return getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)  # < 2.13


def use_expandable_segments() -> bool:
    """Expandable allocator segments unless the user configured the allocator: loading folds
    and merges weights (new tensors, old ones freed), which otherwise leaves tens of GiB of
    reserved fragments that the multi-GiB cache pools cannot use. True when segments are
    expandable (set here or by the user's allocator settings)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if conf:
        return "expandable_segments:true" in conf.replace(" ", "").lower()
    setter = _allocator_setter()
    if setter is None:
        logger.info("expandable segments not set: this torch has no allocator-settings call")
        return False
    try:
        setter("expandable_segments:True")
    except RuntimeError as exc:   # refused: keep the default allocator
        logger.info("expandable segments not set: %s", exc)
        return False
    return True


@contextlib.contextmanager
def ipc_capable_allocations(expandable: bool):
    """Allocate what a NIXL agent registers from plain cudaMalloc segments. UCX's cuda_ipc
    transport exports only legacy-IPC-capable memory: VMM memory (expandable segments)
    registers fine, but every READ of it then falls back to UCX's emulated RMA over TCP,
    orders of magnitude slower, with correct data and no warning (nixl issue 1754)."""
    setter = _allocator_setter()
    if not expandable or setter is None:
        yield
        return
    setter("expandable_segments:False")
    try:
        yield
    finally:
        setter("expandable_segments:True")


class Worker:
    """Start-up in order: Worker(config) loads the model; determine_num_blocks_and_slots()
    profiles; initialize_cache() allocates, warms up and captures. Then launch / collect."""

    def __init__(self, config: EngineConfig, parallel: ParallelState | None = None) -> None:
        """parallel: this rank's place (None: the only rank)."""
        self.config = config
        self.parallel = parallel or ParallelState.single()
        self.tp_size = self.parallel.tp_size
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.parallel.world_size > 1:
            self.device = torch.device("cuda", self.parallel.local_rank)
            torch.cuda.set_device(self.device)
        mc = config.model_config
        self.args = mc.arch
        self.dtype = mc.torch_dtype(self.device.type)
        self.block_size = config.cache_config.block_size
        self._used_at_start = 0
        """CUDA: device bytes in use outside this process's torch allocator before the model
        loads (other processes, this one's context): not this instance's to count."""
        self._expandable = False
        if self.device.type == "cuda":
            self._expandable = use_expandable_segments()
            free, total = torch.cuda.mem_get_info(self.device)
            self._used_at_start = total - free - torch.cuda.memory_reserved(self.device)
        self.kernel_config = supported_kernels(config.kernel_config, self.device)
        self.backends = select_backends(self.kernel_config, self.device)
        if self.backends.kda.startswith("fla"):
            use_stored_configs(torch.cuda.get_device_name(self.device),
                               traits=device_traits(self.device))
        self._ahead: CompileAhead | None = None
        """Start-up only: the pool compiling kdaserve's kernel variants (compile_workers)."""
        workers = config.compile_workers
        if workers is None:
            workers = default_compile_workers(config.parallel_config.ranks_per_node)
        if self.device.type == "cuda" and workers > 0:
            from triton.runtime import driver

            t = driver.active.get_current_target()
            self._ahead = CompileAhead.start(workers, (t.backend, t.arch, t.warp_size))
        t0 = time.perf_counter()
        self.model = build_model(self.args, self.dtype, self.device,
                                 resolve_architecture(mc.hf_config), self.backends,
                                 self.parallel.tp if self.tp_size > 1 else None)
        load_weights(self.model, mc.model, config.load_config)
        logger.info("model loaded in %.2f s (%s, %s; backends %s)", time.perf_counter() - t0,
                    self.dtype, self.device, self.backends)
        spec = None
        if config.speculative_config.enabled:   # before profiling: a draft model's memory counts
            spec = SpecDecoder(config, self.args, self.device, self.dtype,
                               target_model=self.model, backends=self.backends)
        self.dcp_size = self.parallel.dcp_size
        dcp = (DCPGroup.of(self.parallel.dcp, config.parallel_config.dcp_kv_cache_interleave_size)
               if self.dcp_size > 1 else None)
        self.model_runner = ModelRunner(config, self.model,
                                        Sampler(self.backends.sampler == "threshold",
                                                self.backends.race_sampler), spec,
                                        self.device, self.dtype, dcp=dcp)
        self.kv_connector: ConnectorWorker | None = make_connector_worker(
            config, self.parallel.tp_rank)
        """The KV connector's worker side (prefill/decode disaggregation), else None."""
        self.kv_agreement = (RankAgreement(self.parallel.world)
                             if self.kv_connector is not None and self.parallel.world_size > 1
                             else None)
        """Several ranks: what their connectors finished, agreed at the polled collects."""
        self._kv_polls: collections.deque[bool] = collections.deque()
        self.kv_side_channel_ports: list[int | None] = []
        """Every rank's connector side channel (None on a consumer), in rank order."""
        self.offload: OffloadWorker | None = None
        """The prefix cache's offload tier (host slots, disk files), else None."""
        self.offload_spec: dict | None = None
        """OffloadManager's arguments for the scheduler (initialize_cache sets them)."""

    @property
    def spec(self) -> SpecDecoder | None:
        return self.model_runner.spec

    @property
    def spec_stats(self) -> SpecDecodingStats | None:
        return self.spec.stats if self.spec is not None else None

    # -----------------------------------------------------------------------------------------
    # Cache sizing and allocation
    # -----------------------------------------------------------------------------------------

    def determine_num_blocks_and_slots(self) -> tuple[int, int]:
        """CPU: explicit sizes or defaults. CUDA: profile the largest step, then split the free
        memory under gpu_memory_utilization between KDA slots (max_num_seqs of them) and KV.
        Several ranks: every rank sizes its own, then all take the minimum (a collective:
        every rank calls this once, in the same place of its start-up)."""
        num_blocks, num_slots = self._num_blocks_and_slots()
        if self.parallel.world_size == 1:
            return num_blocks, num_slots
        cc = self.config.cache_config
        num_blocks, num_slots, cc.num_kda_checkpoint_slots = self.parallel.world.all_reduce_min(
            [num_blocks, num_slots, cc.num_kda_checkpoint_slots])
        return num_blocks, num_slots

    def _num_blocks_and_slots(self) -> tuple[int, int]:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        num_slots = cc.num_state_slots or sc.max_num_seqs + 8
        if self.device.type != "cuda":
            cc.num_kda_checkpoint_slots = checkpoints.num_checkpoint_slots(
                cc, None, 0, sc.max_num_seqs)
            return cc.num_gpu_blocks or 512, num_slots
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._profile_run()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = cache_budget(total, free, torch.cuda.memory_reserved(), self._used_at_start,
                              peak, torch.cuda.memory_allocated(), cc.gpu_memory_utilization)
        slot_bytes = cache_sizes.state_bytes_per_slot(self.args, self.dtype, self.tp_size)
        block_bytes = cache_sizes.kv_bytes_per_block(self.args, self.block_size, self.dtype)
        if cc.num_state_slots is None:
            num_slots = sc.max_num_seqs
        budget -= num_slots * self._spec_rows_per_slot() * slot_bytes
        cc.num_kda_checkpoint_slots = checkpoints.num_checkpoint_slots(
            cc, budget - (num_slots + 1) * slot_bytes, slot_bytes, sc.max_num_seqs)
        num_blocks = cc.num_gpu_blocks or int(
            (budget - (num_slots + 1 + cc.num_kda_checkpoint_slots) * slot_bytes) // block_bytes)
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: budget {budget / 2**30:.2f} GiB, "
                f"{num_slots} KDA slots need {num_slots * slot_bytes / 2**30:.2f} GiB; lower "
                "max_num_seqs or raise gpu_memory_utilization")
        return num_blocks, num_slots

    def _spec_rows_per_slot(self) -> int:
        return self.spec.extra_rows_per_slot if self.spec is not None else 0

    def _profile_run(self) -> None:
        """A forward over max_num_batched_tokens prefill tokens on throwaway caches."""
        sc = self.config.scheduler_config
        n = min(sc.max_num_batched_tokens, sc.max_model_len)
        nb = (n + self.block_size - 1) // self.block_size
        caches = cache_sizes.allocate_caches(self.args, nb, self.block_size, 1, self.dtype,
                                             self.device, self.tp_size)
        md = build_metadata([n], [0], [list(range(nb))], [0], self.block_size, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        with torch.inference_mode(), self._deferring():   # launches skipped: same memory peak
            h = self.model(ids, ForwardContext(md, caches))
            self.model.compute_logits(h[-min(n, sc.max_num_seqs):])
        torch.cuda.synchronize()
        del caches, h

    def initialize_cache(self, num_blocks: int, num_slots: int) -> None:
        """Allocate the caches (KDA rows: the request slots, the checkpoint slots, one scratch
        row for CUDA-graph padding, per-position spec rows), then on CUDA warm up and capture
        the graphs."""
        cc = self.config.cache_config
        cc.num_kda_checkpoint_slots = num_ckpt = checkpoints.resolve_num_checkpoint_slots(cc)
        extra_rows = num_slots * self._spec_rows_per_slot()
        registered = self.kv_connector is not None and self.device.type == "cuda"
        with ipc_capable_allocations(self._expandable and registered):
            caches = cache_sizes.allocate_caches(self.args, num_blocks, self.block_size,
                                                 num_slots + num_ckpt + 1 + extra_rows,
                                                 self.dtype, self.device, self.tp_size)
        runner = self.model_runner
        runner.bind_caches(caches, num_blocks, num_slots, num_ckpt)
        if self.kv_connector is not None:
            self.kv_connector.register_caches(caches.mla_kv, caches.kda_recurrent,
                                              caches.kda_conv, num_blocks, num_slots)
            self.kv_side_channel_ports = self.parallel.world.all_gather_object(
                self.kv_connector.side_channel_port)
        if cc.kv_offload_size > 0:
            self._init_offload(caches)
        kv_tokens = num_blocks * self.block_size * self.dcp_size   # DCP: 1/dcp on each rank
        max_len = self.config.scheduler_config.max_model_len
        logger.info("MLA KV cache: %d tokens; %s; max concurrency at max_model_len: %.2f",
                    kv_tokens, checkpoints.capacity_line(
                        num_slots, num_ckpt, cache_sizes.state_bytes_per_slot(
                            self.args, self.dtype, self.tp_size)),
                    min(num_slots, kv_tokens / max_len))
        if self.dcp_size > 1:
            logger.info("MLA KV sharded over %d decode-context-parallel ranks: %d blocks of %d "
                        "tokens on each, interleave %d", self.dcp_size, num_blocks,
                        self.block_size,
                        self.config.parallel_config.dcp_kv_cache_interleave_size)
        if self.spec is not None:
            logger.info("%s", self.spec.memory_line())
        if self.device.type == "cuda":
            if self._ahead is not None:
                self._compile_ahead()
            warmup_steps(runner, self.config.scheduler_config)
            warmup_sampler(runner.sampler, self.args.vocab_size, self.device)
            if self.spec is not None:
                self.spec.warmup()
            if not self.config.enforce_eager:
                self._capture_graphs()
        if self.parallel.world_size > 1:
            # Unseeded sampling draws from the default generators: the same seed on every
            # rank keeps the ranks' samples (and so their next inputs) identical.
            torch.manual_seed(self.config.model_config.seed)

    def _init_offload(self, caches) -> None:
        """Host slots for the offload tier (this rank's share of kv_offload_size), its disk
        folder (named by the layout's fingerprint), and the scheduler's side's arguments."""
        cc, mc = self.config.cache_config, self.config.model_config
        world = self.parallel.world_size
        kv_bytes = cache_sizes.kv_bytes_per_block(self.args, self.block_size, self.dtype)
        state_bytes = cache_sizes.state_bytes_per_slot(self.args, self.dtype, self.tp_size)
        blocks_per_ckpt = max(1, cc.checkpoint_interval // (self.block_size * self.dcp_size))
        slots = host_tier_slots(int(cc.kv_offload_size * 2**30) // world, kv_bytes,
                                state_bytes, blocks_per_ckpt)
        layout = {
            "model": os.path.abspath(mc.model), "arch": dataclasses.asdict(self.args),
            "dtype": str(self.dtype), "load_format": self.config.load_config.load_format,
            "seed": self.config.load_config.seed, "quantization": mc.quantization,
            "block_size": self.block_size, "world_size": world, "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "dcp_interleave": self.config.parallel_config.dcp_kv_cache_interleave_size,
            "rows": {"kv": [list(t.shape[1:]) + [str(t.dtype)] for t in caches.mla_kv],
                     "state": [list(t.shape[1:]) + [str(t.dtype)]
                               for t in caches.kda_recurrent + caches.kda_conv]}}
        folder = (os.path.join(cc.kv_offload_disk_path, layout_fingerprint(layout))
                  if cc.kv_offload_disk_path is not None else None)
        self.offload = OffloadWorker(caches, slots, folder, self.parallel.world_rank,
                                     self.parallel.world, self.device)
        self.model_runner.offload = self.offload
        self.offload_spec = dict(num_host_slots=slots, entry_bytes=self.offload.nbytes,
                                 disk_folder=folder,
                                 disk_size=int(cc.kv_offload_disk_size * 2**30) // world,
                                 layout=layout)
        logger.info("offload tier: %d MLA blocks + %d KDA states in host memory (%.2f GiB)%s",
                    slots["kv"], slots["state"],
                    sum(slots[k] * self.offload.nbytes[k] for k in slots) / 2**30,
                    f", disk level in {folder}" if folder is not None else "")

    def _deferring(self):
        """The compile pool's deferral while it exists (start-up), else nothing."""
        return self._ahead.deferring() if self._ahead is not None else contextlib.nullcontext()

    def _compile_ahead(self) -> None:
        """The warm-up steps, the decode and verification graphs' forwards (eager, with the
        plan each graph is captured with) and DSpark's block passes once with kdaserve's
        kernel variants compiled by the pool instead of launched, then the pool's wait: the
        warm-up and the captures that follow load every variant from Triton's disk cache. Not
        the samplers nor what follows a draw (a draft model's next pass, DSpark's Markov
        head): sampled ids index embeddings, and the skipped kernels leave garbage. The pass
        writes where the warm-up does (cache rows no request holds yet), and the caches are
        zeroed after it."""
        runner, sc = self.model_runner, self.config.scheduler_config
        try:
            with self._ahead.deferring():
                warmup_steps(runner, sc)
                if not self.config.enforce_eager:
                    graphs = CudaGraphManager(sc.max_num_seqs, self.kernel_config.pdl)
                    self._decode_graphs(graphs).run_uncaptured()
                    if self.spec is not None:   # verification forwards, DSpark's block pass
                        self.spec.run_uncaptured(graphs, self.model, runner.caches,
                                                 runner.num_slots, self.block_size)
        except Exception:   # noqa: BLE001 - a speed-up only: the start-up below still compiles
            logger.exception("compile ahead: the deferred pass failed; the variants it did not "
                             "reach compile at their first launch")
        # fla's kernels ran on the skipped kernels' uninitialised outputs and wrote states
        # that may be NaN; a fresh request's state is its slot times has_initial_state = 0,
        # which is 0 only for finite values
        for t in (*runner.caches.mla_kv, *runner.caches.kda_recurrent, *runner.caches.kda_conv):
            t.zero_()
        torch.cuda.synchronize()
        self._ahead.wait()
        self._ahead = None

    def _decode_graphs(self, graphs: CudaGraphManager) -> DecodeGraphs:
        runner, sc = self.model_runner, self.config.scheduler_config
        return DecodeGraphs(graphs, self.model, runner.caches, runner.num_slots, self.block_size,
                            sc.max_model_len, self.device, dcp=runner.dcp,
                            hidden_outputs=self.spec.hidden_outputs if self.spec else None)

    def _capture_graphs(self) -> None:
        """Decode graphs, then the spec decoder's (verification, draft model), all in one
        manager; the graphs launch with PDL when the kernel config has it, eager steps never."""
        runner, sc = self.model_runner, self.config.scheduler_config
        graphs = CudaGraphManager(sc.max_num_seqs, self.kernel_config.pdl)
        decode = self._decode_graphs(graphs)
        decode.capture()
        if self.spec is not None:
            self.spec.capture_graphs(graphs, self.model, runner.caches, runner.num_slots,
                                     self.block_size)
        runner.bind_graphs(graphs, decode)

    # -----------------------------------------------------------------------------------------
    # Steps
    # -----------------------------------------------------------------------------------------

    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        if self.kv_connector is not None:
            self.kv_connector.start_step(so.kv_connector_metadata)
            self._kv_polls.append(so.kv_connector_poll)
        step = self.model_runner.launch(so)
        if so.offload is not None and so.offload.disk_jobs:
            self.offload.submit(so.offload.disk_jobs)
        return step

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """The step's output, with the KV connector's and the offload tier's reports of what
        finished meanwhile."""
        out = self.model_runner.collect(step)
        if self.kv_connector is not None:
            out.kv_connector_output = self.kv_connector.get_finished()
            poll = self._kv_polls.popleft()
            if self.kv_agreement is not None:
                self.kv_agreement.add(out.kv_connector_output)
                out.kv_connector_output = self.kv_agreement.agree() if poll else None
        if self.offload is not None:
            out.offload_output = self.offload.get_finished()
        return out

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(so))

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.offload is not None:
            self.offload.shutdown()
