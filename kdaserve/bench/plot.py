# SPDX-License-Identifier: Apache-2.0
"""Plots of `bench serve` results: throughput and latency against concurrency (one line per
run, so several result files can share one figure)."""

from __future__ import annotations

import json
import pathlib

PANELS = [
    # (title, y label, [(metrics key, line style suffix)])
    ("Output throughput", "tokens/s", [("output_throughput", "")]),
    ("Time to first token", "ms", [("mean_ttft_ms", "mean"), ("p99_ttft_ms", "p99")]),
    ("Time per output token", "ms", [("mean_tpot_ms", "mean"), ("median_itl_ms", "ITL median")]),
    ("End-to-end latency", "s", [("mean_e2el_ms", "mean")]),
]


def plot_results(runs: list[dict], path: str, title: str | None = None) -> None:
    """Write a 2x2 PNG: output tok/s, TTFT, TPOT/ITL and E2E latency vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("nothing to plot: no runs")
    from matplotlib.ticker import NullLocator, ScalarFormatter

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ticks = sorted({lv["concurrency"] for run in runs for lv in run["levels"]})
    for ax, (panel, ylabel, series) in zip(axes.flat, PANELS):
        for i, run in enumerate(runs):
            levels = [lv for lv in run["levels"] if lv["metrics"]["completed"] > 0]
            x = [lv["concurrency"] for lv in levels]
            label = run.get("label") or f"run {i}"
            for key, suffix in series:
                scale = 1e-3 if key == "mean_e2el_ms" else 1.0
                y = [lv["metrics"][key] * scale for lv in levels]
                style = "--" if suffix in ("p99", "ITL median") else "-"
                name = f"{label} {suffix}".strip()
                ax.plot(x, y, style, marker="o", color=f"C{i}", label=name)
        ax.set_title(panel)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "kdaserve bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_files(paths: list[str], out: str, title: str | None = None) -> None:
    plot_results([json.loads(pathlib.Path(p).read_text()) for p in paths], out, title)
