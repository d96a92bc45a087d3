"""What each ``labkit`` command prints: lines for a reader by default, one JSON object with ``--json``.

The lines round every number and name its unit (MB = 1e6 bytes, seconds, tokens/s, nats per
masked token for a loss); the JSON keeps the raw values under stable keys (tests, notebooks and
scripts parse it). ``Output`` routes them: with ``--json`` standard output holds the JSON alone,
and everything else printed while the command runs (the engines' streamed output, notes) goes
to standard error. ``labkit.commands`` calls the ``*_lines`` functions; each takes the object the
JSON prints, so the two cannot disagree. Nothing here imports torch or ipyparallel.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from typing import Any

__all__ = ["Output", "continue_command", "count", "export_lines", "mb", "prepare_lines", "stage_lines", "train_lines",
           "verify_line"]


def mb(n: float | None) -> str:
    """Bytes as MB (1e6 bytes), one decimal: ``"23.6 MB"``."""
    return "n/a" if n is None else f"{n / 1e6:,.1f} MB"


def count(n: float | None) -> str:
    """A count for a reader: ``"6,144"`` below a million, ``"11.68 M"`` from there."""
    return "n/a" if n is None else f"{n:,.0f}" if n < 1e6 else f"{n / 1e6:,.2f} M"


class Output:
    """Where a command's result goes (module docstring): ``with Output(as_json) as out: ...;
    out.show(obj, lines)``. With ``as_json`` standard output is redirected to standard error inside
    the block, and ``show`` prints ``obj`` as indented JSON (``default=str``) on the standard
    output the block started with; otherwise ``show`` prints ``lines``, one per line."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.stdout = sys.stdout
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Output":
        self.stdout = sys.stdout
        if self.as_json:
            self._stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def show(self, obj: Any, lines: list[str]) -> None:
        if self.as_json:
            print(json.dumps(obj, indent=2, default=str), file=self.stdout, flush=True)
        else:
            print("\n".join(lines), file=self.stdout, flush=True)


def prepare_lines(report: dict, workdir: str) -> list[str]:
    """``labkit prepare``: ``labkit.data.prepared.preparation_report`` in five lines."""
    stages = report.get("documents_per_stage", {})
    kinds = ", ".join(f"{k} {v['documents']:,}" for k, v in report.get("sources", {}).items())
    dropped = ", ".join(f"{k} {v:,}" for k, v in (report.get("dropped") or {}).items() if v) or "none"
    unk, scripts = report.get("unk_rate_held_out"), report.get("unk_rate_by_script") or {}
    unk_text = (f"UNK rate {100 * unk:.3f} % on {report.get('unk_rate_documents') or 0:,} documents left out of its "
                "training" if unk is not None else "UNK rate not measured")
    if len(scripts) > 1:
        unk_text += " (" + ", ".join(f"{k} {100 * v:.3f} %" for k, v in scripts.items()) + ")"
    ratio = report.get("training_to_dataset_ratio")
    return [
        f"prepared {workdir}:",
        f"  read {stages.get('read', 0):,} documents ({kinds}) from {report['files_read']:,} files, "
        f"{mb(report['raw_bytes'])}",
        f"  kept {report['documents_kept']:,} after cleaning and dedup (dropped: {dropped})",
        f"  tokenizer: vocabulary {report['vocab_size']:,}; {unk_text}",
        f"  shards: {count(report['tokens'])} tokens in {report['sequences']:,} sequences of "
        f"{report['seq_len']} tokens ({mb(report['shard_bytes'])}); held-out split (never trained on): "
        f"{report.get('heldout_documents', 0):,} documents",
        f"  training data {mb(report['training_data_bytes'])} = "
        + (f"{ratio:.2f}x" if ratio is not None else "n/a") + f" the document dataset ({mb(report['dataset_bytes'])})",
    ]


def stage_lines(staged: dict[str, dict], src: str) -> list[str]:
    """``labkit stage``: one line per node (``labkit.lab.stage``'s report)."""
    lines = [f"staged {src} on {len(staged)} node(s):"]
    for node, r in staged.items():
        how = (f"copied in {r['seconds']:.2f} s ({r['mb_per_s']:,.0f} MB/s)" if r["copied"]
               else "already there, verified")
        lines.append(f"  {node}: {mb(r['bytes'])} {how} -> {r['path']}")
    return lines


def continue_command(run_dir: str, cluster: Any = None) -> str:
    """The command that continues the run in ``run_dir`` from its newest checkpoint, with the
    cluster options it needs (``--slurm``, ``--profile``, ``--cluster-id``; a
    ``labkit.config.tomlfile.ClusterConfig``, or None for local engines). ``labkit resume`` runs
    on as many engines as the run had (its config.json)."""
    argv = ["labkit", "resume", str(run_dir)]
    if cluster is not None:
        if cluster.kind == "slurm":
            argv.append("--slurm")
        if cluster.profile:
            argv += ["--profile", cluster.profile]
        if cluster.cluster_id:
            argv += ["--cluster-id", cluster.cluster_id]
    return shlex.join(argv)


def train_lines(summary: dict) -> list[str]:
    """``labkit train`` / ``labkit resume``: the result's main numbers, the wall-clock goodput and
    the culprit's line when there is one, then where it stopped (``summary``:
    ``labkit.commands._summary``)."""
    def num(key: str, fmt: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, fmt)

    steps, total = summary.get("steps"), summary.get("max_steps")
    head = f"{summary['run_dir']}: " + ("already finished, nothing trained; " if summary.get("already_finished")
                                         else "")
    resumed = summary.get("resumed_from_step")
    head += f"step {steps} of {total}" + (f" (resumed from step {resumed})" if resumed else "")
    head += f", loss {num('initial_loss', '.3f')} -> {num('final_loss', '.3f')}"
    if summary.get("eval_loss") is not None:
        head += f", held-out loss {summary['eval_loss']:.3f} (perplexity {summary['perplexity']:.1f})"
    ranks = summary.get("world_size")
    lines = [head, f"  {count(summary.get('tokens'))} tokens at {num('tokens_per_s', ',.0f')} tokens/s on {ranks} "
                   f"rank{'' if ranks == 1 else 's'}, global batch {summary.get('global_batch_size')} sequences, "
                   f"{num('wall_s', '.1f')} s"]
    if summary.get("goodput") is not None:
        lines[1] += f", wall-clock goodput {100 * summary['goodput']:.0f} %"
    if summary.get("culprit"):
        lines.append(f"  {summary['culprit']}")
    if summary.get("stopped_early"):
        where = (f"last checkpoint {summary['last_checkpoint']}" if summary.get("last_checkpoint")
                 else "no checkpoint written (train.checkpoint.enabled = false)")
        lines.append(f"stopped after step {steps} of {total} (train.stop_after); {where}; to continue: "
                     f"{summary['continue_command']}")
    return lines


def verify_line(index: dict, shard_dir: str) -> str:
    """``labkit verify``: one line on a verified shard set (``labkit.data.shards.verify_shards``)."""
    held = (index.get("heldout") or {}).get("n_sequences")
    return (f"verified {shard_dir}: {len(index['shards'])} shards, {index['n_sequences']:,} sequences of "
            f"{index['seq_len']} tokens" + (f", held-out {held:,} sequences" if held else ", no held-out split")
            + f" (sha256 and ids < vocab_size {index['vocab_size']})")


def export_lines(out: str, files: list[str], step: int | None, run_dir: str) -> list[str]:
    """``labkit export``: where the export went and what it holds."""
    return [f"exported {run_dir}" + (f" (checkpoint step {step})" if step is not None else "") + f" to {out}: "
            + ", ".join(files)]
