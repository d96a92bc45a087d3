"""``labkit`` command line: the same functions the notebooks call.

    labkit demo [--workdir DIR] [--engines N] [--max-functions N] [--steps N] [--no-reports]
    labkit verify SHARD_DIR
    labkit report NOTEBOOK OUT.html [--param key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def _demo(args: argparse.Namespace) -> int:
    from labkit.config import CorpusConfig, DemoConfig
    from labkit.demo import run_demo

    corpus = CorpusConfig()
    if args.max_functions is not None:
        corpus = dataclasses.replace(corpus, max_functions=args.max_functions)
    if args.paths:
        corpus = dataclasses.replace(corpus, paths=tuple(args.paths))
    cfg = DemoConfig(workdir=args.workdir, engines=args.engines, corpus=corpus,
                     train_steps=args.steps if args.steps is not None else DemoConfig().train_steps,
                     reports=not args.no_reports)
    run_demo(cfg)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from labkit.data.shards import verify_shards

    index = verify_shards(args.shard_dir)
    print(json.dumps({k: v for k, v in index.items() if k != "shards"} | {"shards_verified": len(index["shards"])},
                     indent=2))
    return 0


def _report(args: argparse.Namespace) -> int:
    from labkit.report import execute_notebook

    params = {}
    for item in args.param:
        key, _, value = item.partition("=")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    print(execute_notebook(args.notebook, args.out, parameters=params))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``labkit`` console script; returns the exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the end-to-end lab on local engines, CPU, real ELF binaries")
    demo.add_argument("--workdir", default="work/demo", help="where every artifact goes (default: work/demo)")
    demo.add_argument("--engines", type=int, default=2, help="local ipyparallel engines (default: 2)")
    demo.add_argument("--max-functions", type=int, default=None, help="functions to disassemble (default: 30000)")
    demo.add_argument("--paths", nargs="*", default=None, help="ELF files or directories (default: system dirs)")
    demo.add_argument("--steps", type=int, default=None, help="DDP training steps")
    demo.add_argument("--no-reports", action="store_true", help="skip executing the notebooks")
    demo.set_defaults(func=_demo)

    verify = sub.add_parser("verify", help="check a shard set's index and every shard's sha256")
    verify.add_argument("shard_dir")
    verify.set_defaults(func=_verify)

    report = sub.add_parser("report", help="execute a notebook and export it as self-contained HTML")
    report.add_argument("notebook")
    report.add_argument("out")
    report.add_argument("--param", action="append", default=[], help="key=value (JSON value) for the parameters cell")
    report.set_defaults(func=_report)

    args = parser.parse_args(argv)
    from ipyparallel.error import RemoteError

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"labkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RemoteError as exc:  # an engine raised: its error in one line, not the whole traceback
        print(f"labkit {args.command}: error on an engine: {exc.ename}: {exc.evalue}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"labkit {args.command}: interrupted; engines were stopped. Completed stages are kept and "
              "are reused by the next run with the same --workdir.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
