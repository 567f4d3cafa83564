# SPDX-License-Identifier: Apache-2.0
"""Per-request records and the metrics computed from them, in vLLM's (`vllm bench serve`) and
guidellm 0.8.1's vocabularies (the names clash, so every key says which one it follows).

The definitions are those of kdaserve.bench.serve's docstring (`kdaserve bench serve --help`),
all times from `start` = just before the HTTP POST. Beyond them: vLLM's TPOT counts outputs of
more than one token, unweighted over requests; guidellm's time_to_first_token_ms skips a
role-only chunk (it equals vLLM TTFT when the server sends the role chunk with the first token);
inter_token_latency_ms is weighted by output_tokens - 1, time_per_output_token_ms by
output_tokens; throughputs are totals / benchmark duration.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `start` is relative to the level's
    t0, every other time is relative to `start`."""

    req_id: str
    start: float = 0.0
    prompt_len: int = 0
    """Tokens the client generated for the prompt (chat: the message content only)."""
    expected_output_len: int = 0
    success: bool = False
    error: str = ""
    ttft: float | None = None
    latency: float | None = None
    """E2EL: time of the last choices-bearing event."""
    request_end: float | None = None
    """Time the stream closed (after the usage chunk and [DONE])."""
    event_times: list[float] = field(default_factory=list)
    """Times of the choices-bearing events."""
    event_tokens: list[int] = field(default_factory=list)
    """Output tokens each choices event added (from continuous usage stats; else 1 each)."""
    first_text_time: float | None = None
    """First event that carried output text (guidellm's first token iteration: a role-only
    chunk with empty content does not count)."""
    last_text_time: float | None = None
    num_text_events: int = 0
    prompt_tokens: int | None = None
    """usage.prompt_tokens as reported by the server."""
    output_tokens: int | None = None
    output_tokens_source: str = ""
    """usage | tokenizer | events."""
    finish_reason: str | None = None
    generated_chars: int = 0

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.event_times)]

    @property
    def tpot(self) -> float | None:
        """vLLM TPOT (s); None for outputs of one token or fewer."""
        if not self.success or not self.output_tokens or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self, detailed: bool = True) -> dict:
        """The record as JSON; `detailed=False` drops the per-event lists (a 1000-token
        request's three lists are most of a result file's bytes)."""
        if detailed:
            return {**asdict(self), "itl": self.itl, "tpot": self.tpot}
        d = asdict(self)
        del d["event_times"], d["event_tokens"]
        return {**d, "num_events": len(self.event_times), "tpot": self.tpot}


# ---------------------------------------------------------------------------------------------
# Distributions


def percentile_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def summarize(values: list[float], percentiles=DEFAULT_PERCENTILES, scale: float = 1.0) -> dict:
    """mean / median / std / min / max / percentiles (numpy's linear interpolation, like vLLM)
    of `values * scale`; zeros when empty (vLLM's convention), with count 0."""
    arr = np.asarray(values, dtype=np.float64) * scale
    if arr.size == 0:
        keys = ["mean", "median", "std", "min", "max"] + [percentile_key(p) for p in percentiles]
        return {"count": 0, **dict.fromkeys(keys, 0.0)}
    out = {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }
    out.update({percentile_key(p): float(np.percentile(arr, p)) for p in percentiles})
    return out


def weighted_summarize(values: list[float], weights: list[float],
                       percentiles=DEFAULT_PERCENTILES, scale: float = 1.0) -> dict:
    """Token-weighted distribution (guidellm's aggregation of ITL and TPOT). The weighted
    percentile p is the smallest value whose cumulative weight reaches p% of the total."""
    v = np.asarray(values, dtype=np.float64) * scale
    w = np.asarray(weights, dtype=np.float64)
    if v.shape != w.shape:
        raise ValueError(f"values and weights differ in length: {v.shape} vs {w.shape}")
    keep = w > 0
    v, w = v[keep], w[keep]
    if v.size == 0:
        return summarize([], percentiles)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    mean = float(np.sum(v * w) / np.sum(w))
    cum = np.cumsum(w) / np.sum(w)

    def wpct(p: float) -> float:
        idx = int(np.searchsorted(cum, p / 100.0 - 1e-12, side="left"))
        return float(v[min(idx, v.size - 1)])

    out = {
        "count": int(v.size),
        "total_weight": float(np.sum(w)),
        "mean": mean,
        "median": wpct(50.0),
        "std": float(np.sqrt(np.sum(w * (v - mean) ** 2) / np.sum(w))),
        "min": float(v[0]),
        "max": float(v[-1]),
    }
    out.update({percentile_key(p): wpct(p) for p in percentiles})
    return out


# ---------------------------------------------------------------------------------------------
# Level metrics


def max_concurrent_requests(records: list[RequestRecord]) -> int:
    """Peak number of overlapping (start, end) intervals (sweep line; an end at the same instant
    as a start does not overlap it)."""
    events = []
    for r in records:
        end = r.request_end if r.request_end is not None else r.latency
        if end is None:
            continue
        events += [(r.start, 1), (r.start + end, -1)]
    events.sort()
    return max(itertools.accumulate(delta for _, delta in events), default=0)


def max_output_tokens_per_s(records: list[RequestRecord], t0: float = 0.0) -> float:
    """Peak of output tokens arriving in one 1-second bucket (buckets counted from t0)."""
    buckets: dict[int, int] = {}
    for r in records:
        if not r.success:
            continue
        tokens = r.event_tokens or [1] * len(r.event_times)
        for t, n in zip(r.event_times, tokens):
            b = int((r.start + t - t0) // 1.0)
            buckets[b] = buckets.get(b, 0) + n
    return float(max(buckets.values())) if buckets else 0.0


def is_good(r: RequestRecord, slos: dict[str, float]) -> bool:
    """DistServe goodput: every given SLO (ms) >= the measured value; TPOT counts as 0 for
    one-token outputs."""
    measured = {
        "ttft": r.ttft * 1000.0,
        "tpot": (r.tpot or 0.0) * 1000.0,
        "e2el": r.latency * 1000.0,
    }
    return all(measured[k] <= v for k, v in slos.items())


def vllm_metrics(records: list[RequestRecord], duration: float,
                 percentiles=DEFAULT_PERCENTILES, goodput_slos: dict[str, float] | None = None
                 ) -> dict:
    """`vllm bench serve` metrics over one level. `duration` (s) is the benchmark wall time."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    total_out = sum(r.output_tokens or 0 for r in ok)
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": max_output_tokens_per_s(ok),
        "max_concurrent_requests": max_concurrent_requests(ok),
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, vals in series.items():
        s = summarize(vals, percentiles, scale=1000.0)
        out[f"mean_{name}_ms"] = s["mean"]
        out[f"median_{name}_ms"] = s["median"]
        out[f"std_{name}_ms"] = s["std"]
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = s[percentile_key(p)]
    if goodput_slos:
        good = sum(is_good(r, goodput_slos) for r in ok)
        out["good_requests"] = good
        out["request_goodput"] = good / duration
    return out


def guidellm_metrics(records: list[RequestRecord], duration: float,
                     percentiles=DEFAULT_PERCENTILES) -> dict:
    """guidellm-named metrics over one level (successful requests)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in records if r.success and r.output_tokens]
    ttft_ms, itl_vals, itl_w, tpot_vals, tpot_w, per_iter = [], [], [], [], [], []
    for r in ok:
        first = r.first_text_time if r.first_text_time is not None else r.event_times[0]
        last = r.last_text_time if r.last_text_time is not None else r.event_times[-1]
        ttft_ms.append(first * 1000.0)
        per_iter.append(r.output_tokens / max(r.num_text_events or len(r.event_times), 1))
        if r.output_tokens > 1:
            itl_vals.append((last - first) / (r.output_tokens - 1) * 1000.0)
            itl_w.append(r.output_tokens - 1)
        tpot_vals.append(last / r.output_tokens * 1000.0)
        tpot_w.append(r.output_tokens)
    latency = [r.request_end for r in ok]
    prompt = [r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok]
    output = [r.output_tokens for r in ok]
    return {
        "requests_per_second": len(ok) / duration,
        "output_tokens_per_second": sum(output) / duration,
        "prompt_tokens_per_second": sum(prompt) / duration,
        "tokens_per_second": (sum(prompt) + sum(output)) / duration,
        "request_latency": summarize(latency, percentiles),
        "time_to_first_token_ms": summarize(ttft_ms, percentiles),
        "inter_token_latency_ms": weighted_summarize(itl_vals, itl_w, percentiles),
        "time_per_output_token_ms": weighted_summarize(tpot_vals, tpot_w, percentiles),
        "output_tokens_per_iteration": summarize(per_iter, percentiles),
        "prompt_token_count": summarize(prompt, percentiles),
        "output_token_count": summarize(output, percentiles),
        "request_totals": {"successful": len(ok), "errored": sum(not r.success for r in records),
                           "total": len(records)},
    }
