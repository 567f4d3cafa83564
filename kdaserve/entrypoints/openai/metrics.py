# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics for /metrics, with vLLM's names under a `kdaserve:` prefix.

Engine-side numbers (queue sizes, cache usage, token counters) are read from the engine core at
scrape time; request latencies are measured in the front, where the client's view is.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kdaserve.core.engine_output import SchedulerStats
from kdaserve.engine.async_engine import RequestTiming

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)

# (metric name, help, SchedulerStats field) -- gauges and counters read from the engine
_GAUGES = [
    ("num_requests_running", "Requests in the running batch.", "num_running_reqs"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting_reqs"),
    ("kv_cache_usage_perc", "Fraction of MLA KV blocks in use (0..1).", "kv_cache_usage"),
    ("num_free_kv_blocks", "Free MLA KV blocks.", "num_free_blocks"),
    ("num_total_kv_blocks", "All MLA KV blocks.", "num_total_blocks"),
    ("kv_cache_capacity_tokens", "MLA KV capacity in tokens (decode context parallelism: "
     "each rank stores its share, the capacity counts them all).", "num_total_kv_tokens"),
    ("num_free_state_slots", "Free KDA state slots.", "num_free_state_slots"),
    ("num_total_state_slots", "All KDA state slots.", "num_total_state_slots"),
    ("num_kda_checkpoints", "Ready KDA prefix checkpoints.", "num_kda_checkpoints"),
    ("num_total_kda_checkpoint_slots", "All KDA checkpoint slots.",
     "num_total_kda_checkpoint_slots"),
    ("kv_transfer_num_held", "Finished requests whose KV blocks and KDA state are held for a "
     "remote reader (prefill instance).", "num_kv_transfer_held"),
    ("kv_transfer_num_loading", "Requests waiting for their prompt's KV blocks and KDA state "
     "from a remote prefill (decode instance).", "num_kv_transfer_loading"),
    ("offload_host_entries", "Entries (MLA blocks, KDA states) in the offload tier's host "
     "memory.", "num_offload_host_entries"),
    ("offload_disk_entries", "Entries on the offload tier's disk.", "num_offload_disk_entries"),
    ("offload_disk_bytes", "Bytes on the offload tier's disk (one rank's).",
     "offload_disk_bytes"),
]
_COUNTERS = [
    ("prompt_tokens", "Prompt tokens admitted.", "num_prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "num_generation_tokens"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Preemptions.", "num_preemptions"),
    ("kda_checkpoint_exports", "KDA prefix checkpoints written.", "num_kda_checkpoint_exports"),
    ("spec_decode_num_drafts", "Verify steps of requests that had drafts.", "spec_num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_num_accepted_tokens"),
    ("spec_decode_kda_state_bytes_written",
     "KDA state bytes written by verify steps and their commits (spec rows).",
     "spec_kda_state_bytes_written"),
    ("kv_transfer_loads", "Prompt states (MLA KV blocks + KDA state) pulled from a remote "
     "prefill.", "kv_transfer_loads"),
    ("kv_transfer_bytes", "Bytes pulled from remote prefills.", "kv_transfer_bytes"),
    ("kv_transfer_seconds", "Sum of the pulls' latencies (start to completion); over "
     "kv_transfer_loads: the mean latency.", "kv_transfer_seconds"),
    ("kv_transfer_failures", "Pulls that failed or timed out (the prompt was recomputed).",
     "kv_transfer_failures"),
    ("kv_transfer_sends", "Held requests acknowledged or released by their consumer.",
     "kv_transfer_sends"),
    ("kv_transfer_expired", "Held requests freed by the hold timeout.", "kv_transfer_expired"),
    ("offload_host_hit_tokens", "Prompt tokens of prefix hits that loaded entries from the "
     "offload tier's host memory.", "offload_host_hit_tokens"),
    ("offload_disk_hit_tokens", "Prompt tokens of prefix hits that used entries read back "
     "from the offload tier's disk.", "offload_disk_hit_tokens"),
    ("offload_stored_bytes", "Device -> host bytes of the offload tier (one rank's).",
     "offload_bytes_stored"),
    ("offload_loaded_bytes", "Host -> device bytes of the offload tier (one rank's).",
     "offload_bytes_loaded"),
    ("offload_written_bytes", "Host -> disk bytes of the offload tier (one rank's).",
     "offload_bytes_written"),
    ("offload_read_bytes", "Disk -> host bytes of the offload tier (one rank's).",
     "offload_bytes_read"),
    ("offload_dropped_stores", "Device evictions the offload tier had no free host slot for.",
     "offload_dropped_stores"),
    ("offload_failures", "Offload file jobs that failed on some rank (a failed read is a "
     "miss).", "offload_failures"),
    ("offload_disk_jobs", "File writes and reads of the offload tier's disk level.",
     "offload_disk_jobs"),
    ("offload_disk_seconds", "Time in those file jobs (rank 0's); over offload_disk_jobs: the "
     "mean latency.", "offload_disk_seconds"),
]


class _EngineStatsCollector:
    """Custom collector: renders the last SchedulerStats snapshot at scrape time."""

    def __init__(self, prefix: str, model_name: str):
        self.prefix = prefix
        self.model_name = model_name
        self.stats: SchedulerStats | None = None
        self.healthy = True

    def collect(self):
        yield self._family(GaugeMetricFamily, "engine_healthy",
                           "1 while the engine process is alive.", 1.0 if self.healthy else 0.0)
        stats = self.stats
        if stats is None:
            return
        for name, doc, attr in _GAUGES:
            yield self._family(GaugeMetricFamily, name, doc, getattr(stats, attr))
        slots = stats.num_total_state_slots
        yield self._family(GaugeMetricFamily, "state_slot_usage_perc",
                           "Fraction of KDA state slots in use (0..1).",
                           (slots - stats.num_free_state_slots) / slots if slots else 0.0)
        for name, doc, attr in _COUNTERS:
            yield self._family(CounterMetricFamily, name, doc, getattr(stats, attr))
        if stats.step_floor_ratio is not None:
            yield self._family(GaugeMetricFamily, "step_floor_ratio",
                               "Last decode step time over its memory-bandwidth floor.",
                               stats.step_floor_ratio)

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(self.prefix + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], float(value))
        return family


class ServerMetrics:
    def __init__(self, model_name: str, prefix: str = "kdaserve:"):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine_stats = _EngineStatsCollector(prefix, model_name)
        self.registry.register(self.engine_stats)
        labels = ["model_name"]
        self.ttft = Histogram(f"{prefix}time_to_first_token_seconds",
                              "Time to first token, seen by the server front.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(f"{prefix}request_time_per_output_token_seconds",
                              "(last token - first token) / (output tokens - 1) per request.",
                              labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{prefix}e2e_request_latency_seconds",
                             "Arrival to last token.", labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry)
        self.success = Counter(f"{prefix}request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=self.registry)

    def observe(self, t: RequestTiming) -> None:
        """AsyncEngine.request_observer: called once per finished request."""
        m = self.model_name
        self.e2e.labels(m).observe(t.finished_time - t.arrival_time)
        if t.first_token_time is not None:
            self.ttft.labels(m).observe(t.first_token_time - t.arrival_time)
            n = t.num_generation_tokens
            if n > 1:
                self.tpot.labels(m).observe((t.finished_time - t.first_token_time) / (n - 1))
        for reason in t.finish_reasons:
            self.success.labels(m, reason).inc()

    def render(self, stats: SchedulerStats | None, healthy: bool) -> bytes:
        self.engine_stats.stats = stats
        self.engine_stats.healthy = healthy
        return generate_latest(self.registry)
