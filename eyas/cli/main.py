"""`eyas`: the command-line entry point.

Usage:
    eyas --help
    eyas generate --model smollm2-135m --prompt "Write a haiku about CPUs."
    eyas bench offline --model smollm2-135m

Each subcommand lives in its own module under `eyas/cli/` and exposes
`register(subparsers) -> None`; the parser it adds sets `func`, called with the parsed args.
A user's mistake raises `EyasError`: its message is printed and the exit code is 2, with no
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from eyas import __version__
from eyas.errors import EyasError

# Subcommand modules, in pipeline order (a plain list is the registry).
SUBCOMMAND_MODULES = [
    "eyas.cli.data",
    "eyas.cli.features",
    "eyas.cli.train",
    "eyas.cli.export",
    "eyas.cli.generate",
    "eyas.cli.eval",
    "eyas.cli.serve",
    "eyas.cli.bench",
    "eyas.cli.recommend",
    "eyas.cli.quickstart",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas",
        description=(
            "Train EAGLE-3 draft heads for a target LLM and serve it with lossless speculative "
            "decoding. Run `eyas COMMAND --help` for each command's options and examples."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:  # not written yet in this checkout
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except EyasError as error:
        print(f"eyas: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eyas: interrupted", file=sys.stderr)
        return 130


def run_subcommand(name: str, argv: list[str] | None = None) -> int:
    """`python -m eyas.cli.NAME ARGS` (what torchrun launches) runs `eyas NAME ARGS`."""
    return main([name, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
