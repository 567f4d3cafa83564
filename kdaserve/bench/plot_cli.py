# SPDX-License-Identifier: Apache-2.0
"""`kdaserve bench plot`: draw several `bench serve` result files into one PNG (one line per
file, labelled by each run's --label)."""

from __future__ import annotations

import argparse

from kdaserve.bench.plot import plot_files


def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("results", nargs="+", help="Result JSON files written by `bench serve --out`.")
    p.add_argument("--out", required=True, help="PNG path.")
    p.add_argument("--title", default=None, help="Figure title.")
    return p


def main(args: argparse.Namespace) -> int:
    plot_files(args.results, args.out, args.title)
    print(args.out)
    return 0
