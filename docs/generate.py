"""Regenerate the derived figures in docs/ from the functions and files that produce them.

Each generated block in a Markdown file sits between ``<!-- generated:NAME -->`` and
``<!-- /generated:NAME -->``; this script rewrites the text between the markers and nothing
else. ``python docs/generate.py`` writes the files; ``python docs/generate.py --check`` exits 1
naming each file whose committed text differs from what the script produces
(tests/test_docs_generated.py runs the same check).

Blocks so far (the planner's, deterministic functions of labkit's code):

- ``lesson3-planner`` (docs/results.md): ``scaling.compute_time`` of the study's two models at
  their reported micro-batches, seq 512, 40 % MFU, H100 NVL, FLOPs per token with the dense
  MLM head (``labkit.model.flops_per_token``).
- ``lesson4-planner`` (docs/results.md): ``scaling.study_scaling`` efficiency at 256 GPUs per
  network and gradient-accumulation count, same settings.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ_LEN = 512
MFU = 0.4
NETWORKS = ("25GbE", "100GbE", "IB-HDR", "IB-NDR")
NETWORK_NAMES = {"25GbE": "25 GbE", "100GbE": "100 GbE", "IB-HDR": "IB HDR 200", "IB-NDR": "IB NDR 400"}


def _eff_256(name: str, micro_batch: int, **kw) -> float:
    import polars as pl

    from labkit import scaling

    t = scaling.study_scaling(name, micro_batch=micro_batch, seq_len=kw.pop("seq_len", SEQ_LEN), mfu=MFU,
                              sparse_head=False, **kw)
    return t.filter(pl.col("n_gpus") == 256)["efficiency"].item()


def lesson3_planner() -> str:
    """Planned compute per step and the samples/s the loaders must supply, both study models."""
    from labkit import plan, scaling

    lines = []
    for name, b in plan.STUDY_MICRO_BATCH.items():
        t = scaling.study_scaling(name, micro_batch=b, seq_len=SEQ_LEN, mfu=MFU, sparse_head=False)
        s = t["compute_s"][0]
        lines.append(f"{name} at micro-batch {b}: {s:.3f} s per step, {b / s:,.0f} sequences/s "
                     f"({b * SEQ_LEN / s / 1e3:,.0f}k tokens/s) per GPU")
    return ("Planner (`scaling.compute_time`, 40 % MFU, seq 512, FLOPs per token with the dense MLM head:\n"
            "6N + 12·L·H·T + 6·V·H, `model.flops_per_token`), one H100 NVL; the loaders must supply\n"
            "each GPU at this rate:\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")


def lesson4_planner() -> str:
    """Efficiency at 128 nodes per network and accumulation, plus the figures the prose quotes."""
    from labkit import plan
    from labkit.model import count_parameters, model_config

    rows = ["| model, micro-batch | grad. accumulation | " + " | ".join(NETWORK_NAMES[n] for n in NETWORKS) + " |",
            "| --- | --- | " + " | ".join("---" for _ in NETWORKS) + " |"]
    for name, b in plan.STUDY_MICRO_BATCH.items():
        for accum in ((1, 4, 16) if name == "bert-120m" else (1, 16)):
            cells = [f"{_eff_256(name, b, network=n, grad_accum=accum):.0%}" for n in NETWORKS]
            rows.append(f"| {name}, {b} | {accum} | " + " | ".join(cells) + " |")
    grad_mb = 4 * count_parameters(model_config("bert-120m", plan.STUDY_VOCAB))["total"] / 1e6
    bf16 = _eff_256("bert-120m", 184, grad_dtype_bytes=2)
    long = _eff_256("bert-350m", 20, seq_len=2048)
    return ("\n".join(rows) + "\n\n"
            f"A 120M step all-reduces {grad_mb:.0f} MB of fp32 gradients. With bf16 gradient compression\n"
            f"(`grad_dtype_bytes=2`) the 120M efficiency on 25 GbE becomes {bf16:.0%}; 350M at seq 2048\n"
            f"gives {long:.0%}.\n").replace("%", " %")


BLOCKS = {("docs/results.md", "lesson3-planner"): lesson3_planner,
          ("docs/results.md", "lesson4-planner"): lesson4_planner}


def render(text: str, name: str, body: str) -> str:
    """``text`` with the block ``name`` replaced by ``body``; ValueError if its markers are missing."""
    pattern = re.compile(rf"(<!-- generated:{re.escape(name)} -->\n).*?(<!-- /generated:{re.escape(name)} -->)",
                         re.S)
    if not pattern.search(text):
        raise ValueError(f"{name}: markers <!-- generated:{name} --> ... <!-- /generated:{name} --> not found")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def generate() -> dict[str, str]:
    """{relative path: regenerated text} for every file with a generated block."""
    out: dict[str, str] = {}
    for (path, name), fn in BLOCKS.items():
        text = out.get(path) or (ROOT / path).read_text()
        out[path] = render(text, name, fn())
    return out


def main(argv: list[str]) -> int:
    stale = []
    for path, text in generate().items():
        if (ROOT / path).read_text() != text:
            stale.append(path)
            if "--check" not in argv:
                (ROOT / path).write_text(text)
    if "--check" in argv and stale:
        print(f"stale generated docs: {', '.join(stale)} (run python docs/generate.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
