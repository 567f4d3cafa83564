"""Build a connector's two sides from the engine config (kv_transfer_config)."""

from __future__ import annotations

import uuid

from kdaserve.config import EngineConfig
from kdaserve.disagg.base import ConnectorScheduler, ConnectorWorker


def resolve_engine_id(config: EngineConfig) -> str:
    """The instance's engine id (a random one, fixed in the config, when none was given)."""
    kvt = config.kv_transfer_config
    if kvt.engine_id is None:
        kvt.engine_id = uuid.uuid4().hex
    return kvt.engine_id


def make_connector_worker(config: EngineConfig, tp_rank: int = 0) -> ConnectorWorker | None:
    """This rank's worker side (None without kv_transfer_config)."""
    kvt = config.kv_transfer_config
    if kvt is None:
        return None
    resolve_engine_id(config)
    if kvt.kv_connector == "NixlConnector":
        from kdaserve.disagg.nixl.worker import NixlConnectorWorker

        return NixlConnectorWorker(kvt, config.cache_config.block_size, tp_rank,
                                   config.parallel_config.tensor_parallel_size)
    raise ValueError(f"unknown kv_connector {kvt.kv_connector!r}")


def make_connector_scheduler(config: EngineConfig,
                             side_channel_ports: list[int | None]) -> ConnectorScheduler | None:
    """The scheduler side (None without kv_transfer_config); side_channel_ports: each rank's
    (None on a consumer, which serves none)."""
    kvt = config.kv_transfer_config
    if kvt is None:
        return None
    if kvt.kv_connector == "NixlConnector":
        from kdaserve.disagg.nixl.scheduler import NixlConnectorScheduler

        ports = [p for p in side_channel_ports if p is not None]
        return NixlConnectorScheduler(kvt, config.cache_config.block_size, kvt.kv_ip, ports,
                                      config.parallel_config.tensor_parallel_size)
    raise ValueError(f"unknown kv_connector {kvt.kv_connector!r}")
