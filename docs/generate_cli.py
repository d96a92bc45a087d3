"""docs/cli.md's option reference, generated from ``labkit.cli.build_parser`` (the parser every
``labkit COMMAND --help`` prints), so that the page and the help cannot disagree. docs/generate.py
merges ``BLOCKS``; tests/test_docs_generated.py fails when the committed block is stale.

Block: ``cli-options`` (docs/cli.md): per subcommand, its usage, then each option with its
default as the parser holds it and its help text.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _default(action: argparse.Action) -> str:
    """An option's default as a reader needs it: "off" for a flag, "none" for a repeatable option
    without entries, "unset" where the help says what applies (None), else the value."""
    if isinstance(action, (argparse._StoreTrueAction,)):
        return "off"
    if action.default is None:
        return "unset"
    if isinstance(action, argparse._AppendAction) and action.default == []:
        return "none"
    if isinstance(action.default, (list, tuple)):
        return " ".join(map(str, action.default))
    return str(action.default)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def cli_options() -> str:
    """Every subcommand's usage and options (default, help) as Markdown tables."""
    from labkit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = []
    for name, p in sub.choices.items():
        positional = " ".join(a.metavar or a.dest.upper() if a.dest != "kind" else "{" + "|".join(a.choices) + "}"
                              for a in p._actions if not a.option_strings)
        out.append(f"`labkit {name}{' ' + positional if positional else ''}`: {_cell(p.description)}\n\n")
        out.append("| option | default | what it sets |\n| --- | --- | --- |\n")
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or a.dest in ("help", "debug"):
                continue
            flag = ", ".join(f"`{o}`" for o in a.option_strings)
            if a.choices and not isinstance(a, argparse._StoreTrueAction):
                flag += f" {{{','.join(map(str, a.choices))}}}"
            out.append(f"| {flag} | {_cell(_default(a))} | {_cell(a.help or '')} |\n")
        out.append("\n")
    return "".join(out).rstrip("\n") + "\n"


BLOCKS = {("docs/cli.md", "cli-options"): cli_options}
