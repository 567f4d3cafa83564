# SPDX-License-Identifier: Apache-2.0
"""Run provenance (git commit, GPU) and the console table."""

from __future__ import annotations

import os
import shutil
import subprocess


def git_commit(path: str | None = None) -> str | None:
    """KDASERVE_COMMIT when set (the caller's commit, where a copy of the tree runs without its
    own .git, e.g. on the device machine); else HEAD of the git checkout holding `path`
    (default: the kdaserve package), with a `-dirty` suffix when tracked files are modified;
    None outside a checkout."""
    if os.environ.get("KDASERVE_COMMIT"):
        return os.environ["KDASERVE_COMMIT"]
    if path is None:
        import kdaserve

        path = os.path.dirname(os.path.dirname(os.path.abspath(kdaserve.__file__)))
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=10)
        suffix = "-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else ""
        return head.stdout.strip() + suffix
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_name() -> str:
    """`nvidia-smi --query-gpu=name`, one line per GPU joined by ', '; "none" without one."""
    if shutil.which("nvidia-smi") is None:
        return "none"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "none"
    names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
    return ", ".join(names) if out.returncode == 0 and names else "none"


TABLE_COLUMNS = [
    # (header, metrics key, scale, format)
    ("conc", "concurrency", 1, "{:d}"),
    ("ok", "completed", 1, "{:d}"),
    ("fail", "failed", 1, "{:d}"),
    ("req/s", "request_throughput", 1, "{:.2f}"),
    ("out tok/s", "output_throughput", 1, "{:.1f}"),
    ("tot tok/s", "total_token_throughput", 1, "{:.1f}"),
    ("E2E mean s", "mean_e2el_ms", 1e-3, "{:.2f}"),
    ("TTFT mean ms", "mean_ttft_ms", 1, "{:.1f}"),
    ("TTFT p99 ms", "p99_ttft_ms", 1, "{:.1f}"),
    ("TPOT mean ms", "mean_tpot_ms", 1, "{:.2f}"),
    ("ITL med ms", "median_itl_ms", 1, "{:.2f}"),
    ("ITL p99 ms", "p99_itl_ms", 1, "{:.2f}"),
]


def format_table(levels: list[dict]) -> str:
    """One row per concurrency level (vLLM metric definitions)."""
    rows = [[h for h, *_ in TABLE_COLUMNS]]
    for lv in levels:
        m = {"concurrency": lv["concurrency"], **lv["metrics"]}
        rows.append(["-" if m.get(key) is None else fmt.format(m[key] * scale)
                     for _, key, scale, fmt in TABLE_COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
