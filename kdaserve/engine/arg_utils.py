"""vLLM-style flat engine arguments (model=, max_num_seqs=, ...) -> EngineConfig.

Shared by the in-process LLMEngine and the engine-core process, which builds its config from the
same keyword arguments the server passes it."""

from __future__ import annotations

from dataclasses import fields

from kdaserve.config import (CacheConfig, EngineConfig, KernelConfig, KVTransferConfig,
                             LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig)
from kdaserve.kernels.compile_ahead import refuse_engine_in_worker


def default_max_num_batched_tokens(device: str) -> int:
    """vLLM's rule: 16384 on GPUs with >= 160 GiB of memory, else 8192."""
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        if torch.cuda.get_device_properties(0).total_memory >= 160 * 2**30:
            return 16384
    return 8192


def config_from_kwargs(kwargs: dict) -> EngineConfig:
    """EngineConfig from flat keyword arguments; unknown names are a ValueError. Refused in a
    start-up compile worker (kernels/compile_ahead.py WORKER_ENV)."""
    refuse_engine_in_worker()
    kwargs = dict(kwargs)
    groups = {}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoadConfig,
                KernelConfig):
        names = {f.name for f in fields(cls)}
        groups[cls] = {k: kwargs.pop(k) for k in list(kwargs) if k in names
                       and (cls is not SchedulerConfig or k != "max_model_len")}
    kv_transfer = kwargs.pop("kv_transfer_config", None)
    spec = kwargs.pop("speculative_config", None) or {}
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    engine_keys = {f.name for f in fields(EngineConfig) if not f.name.endswith("_config")}
    engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in engine_keys}
    if kwargs:
        raise ValueError(f"unknown engine arguments: {sorted(kwargs)}")
    model_config = ModelConfig(**groups[ModelConfig])
    load = groups[LoadConfig]
    load.setdefault("seed", model_config.seed)
    sched = groups[SchedulerConfig]
    sched["max_model_len"] = model_config.max_model_len
    if sched.get("max_num_batched_tokens") is None:
        sched["max_num_batched_tokens"] = default_max_num_batched_tokens(
            engine_kwargs.get("device", "auto"))
    return EngineConfig(
        model_config=model_config, cache_config=CacheConfig(**groups[CacheConfig]),
        scheduler_config=SchedulerConfig(**sched),
        parallel_config=ParallelConfig(**groups[ParallelConfig]),
        speculative_config=SpeculativeConfig(**spec), load_config=LoadConfig(**load),
        kernel_config=KernelConfig(**groups[KernelConfig]),
        kv_transfer_config=(KVTransferConfig.from_dict(kv_transfer)
                            if kv_transfer is not None else None), **engine_kwargs)
