"""`kdaserve` command line: serve | generate | bench | make-model | proxy.

Each subcommand lives in its own module, which exposes `add_parser(subparsers)`; the parser it
adds sets `func` to the function that runs the command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kdaserve import __version__

_SUBCOMMANDS = {
    "serve": "kdaserve.entrypoints.openai.cli_args",
    "generate": "kdaserve.entrypoints.generate",
    "bench": "kdaserve.bench.cli",
    "make-model": "kdaserve.models.make_model",
    "proxy": "kdaserve.entrypoints.disagg_proxy",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdaserve", description="Serve Kimi Linear models.")
    parser.add_argument("--version", "-v", action="version", version=f"kdaserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Import only the requested subcommand's module: keeps `kdaserve make-model` light.
    only = argv[0] if argv and argv[0] in _SUBCOMMANDS else None
    args = build_parser(only).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
