# SPDX-License-Identifier: Apache-2.0
"""Server-side counters from a Prometheus `/metrics` page, diffed over a benchmark level.

Names are matched without their namespace (`vllm:`, `kdaserve:`) and `_total` suffix, and
summed over label sets, so the same code reads vLLM's and kdaserve's pages.
"""

from __future__ import annotations

import httpx

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens", "spec_decode_kda_state_bytes_written",
            "prefix_cache_queries", "prefix_cache_hits",
            "num_preemptions", "prompt_tokens", "generation_tokens")


def parse_prometheus(text: str) -> dict[str, float]:
    """{bare metric name: value summed over label sets} for every sample line."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_labels, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
        name = name_labels.split("{", 1)[0].strip()
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        name = name.rsplit(":", 1)[-1].removesuffix("_total")
        out[name] = out.get(name, 0.0) + value
    return out


async def scrape(client: httpx.AsyncClient, base_url: str, api_key: str | None = None
                 ) -> dict[str, float] | None:
    """The parsed page, or None when the server has no usable /metrics."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    return parse_prometheus(resp.text) if resp.status_code == 200 else None


def level_counters(before: dict | None, after: dict | None) -> dict | None:
    """Counter deltas over a level plus derived spec-decode and prefix-cache rates."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in COUNTERS if k in after}
    drafts, proposed = d.get("spec_decode_num_drafts"), d.get("spec_decode_num_draft_tokens")
    accepted = d.get("spec_decode_num_accepted_tokens")
    if proposed:
        d["spec_decode_acceptance_rate"] = accepted / proposed
    if drafts:
        d["spec_decode_acceptance_length"] = 1.0 + accepted / drafts
        written = d.get("spec_decode_kda_state_bytes_written")
        if written is not None:
            d["spec_decode_kda_state_bytes_per_verify"] = written / drafts
    if d.get("prefix_cache_queries"):
        d["prefix_cache_hit_rate"] = d.get("prefix_cache_hits", 0.0) / d["prefix_cache_queries"]
    return d
