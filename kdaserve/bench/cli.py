# SPDX-License-Identifier: Apache-2.0
"""`kdaserve bench <kind>`: benchmark commands.

Each kind lives in its own module exposing `add_cli_args(parser)` and `main(args)`; add a kind
by adding one line to `_BENCH_KINDS` (modules are imported only when `bench` is used).
"""

from __future__ import annotations

import argparse
import importlib

_BENCH_KINDS = {
    # name: (module, one-line help)
    "serve": ("kdaserve.bench.serve",
              "Load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput)."),
    "plot": ("kdaserve.bench.plot_cli", "Plot one or more `bench serve` result JSON files."),
    "roofline": ("kdaserve.bench.roofline",
                 "Decode step time vs its byte floor, in-process (W4)."),
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="Benchmarks.", description=__doc__.split("\n")[0])
    kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    for name, (module_name, help_text) in _BENCH_KINDS.items():
        module = importlib.import_module(module_name)
        p = kinds.add_parser(name, help=help_text, description=module.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(p)
        p.set_defaults(func=module.main)
    return bench
