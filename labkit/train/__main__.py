"""``python -m labkit.train CONFIG [--set train.key=value ...]``: train one run as this process's rank.

Under ``torchrun --nproc-per-node N -m labkit.train CONFIG`` each process is one rank (torchrun
sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); without it, one process. CONFIG is
a TOML file (``labkit.config.tomlfile``); its ``[train]`` table is the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

INPUT_ERRORS = (ValueError, OSError, RuntimeError, FloatingPointError)
"""Errors of the input (a bad key, a missing file, shards that do not fit, a diverged loss):
one line and exit status 2 instead of a traceback (``--debug`` shows it)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m labkit.train``."""
    parser = argparse.ArgumentParser(
        prog="python -m labkit.train", description="Train one MLM run as this process's rank.",
        epilog="examples:\n  python -m labkit.train configs/walkthrough.toml\n"
               "  torchrun --nproc-per-node 2 -m labkit.train configs/walkthrough.toml --set train.max_steps=50",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="TOML config file (see configs/walkthrough.toml)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key (TOML value, else a string); repeatable")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Train ``[train]`` of CONFIG with ``labkit.train.train``; rank 0 prints the result as one
    JSON line. Returns the exit status: 0, or 2 after one line ``labkit.train (rank R): error:
    <cause>`` per rank for an error of the input."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    try:
        from labkit.config.tomlfile import load
        from labkit.train import train

        result = train(load(args.config, args.set).train)
    except INPUT_ERRORS as exc:
        if args.debug:
            raise
        cause = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        print(f"labkit.train (rank {rank}): error: {cause}", file=sys.stderr)
        return 2
    if rank == "0":
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
