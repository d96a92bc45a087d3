"""Benchmark `loader`: MLM batches per second through a DataLoader with ONE worker process,
labkit.data.mlm.make_loader vs the usual transformers path on the same token ids.

Data (real): functions disassembled (capstone) from this machine's shared libraries, a WordPiece
tokenizer trained on them (labkit.data.tokenize) and packed into seq_len 512 shards
(labkit.data.shards). Both loaders read the same shard files in a seeded random order, batch 32:
- labkit: make_loader(num_workers=1): one memmap gather per batch, vectorised masking, numpy
  arrays across the worker pipe (yielded as tensors);
- baseline: DataLoader(per-sample dataset over the same memmaps, batch_size=32, num_workers=1,
  persistent, forkserver) + transformers DataCollatorForLanguageModeling (mlm_probability 0.15)
  with a PreTrainedTokenizerFast loading the same tokenizer.json.
After one warm-up pass each, the two alternate REPEATS times, N_BATCHES batches a time; medians.
ratio = ours / baseline samples/s (goal 3).

Derived (printed before the JSON line): loader workers needed to feed one H100 SXM training the
bert-120m preset at 40 % MFU at seq_len 512, from the measured one-worker rate:
    samples/s needed = 0.4 * 989e12 FLOP/s / (flops_per_token(bert-120m, 512) * 512)
    workers = ceil(samples/s needed / samples/s of one worker)
and a loader sweep (labkit.study.loader_sweep) for that GPU's planned step time at batch 32.
Run from the repository root: python benchmarks/bench_loader.py
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.config import ShardConfig, TokenizerConfig  # noqa: E402
from labkit.study.loader_sweep import planned_step_time, sweep_loader, workers_needed  # noqa: E402
from labkit.data.mlm import make_loader  # noqa: E402
from labkit.data.shards import SequenceReader, write_shards  # noqa: E402
from labkit.data.tokenize import train_tokenizer  # noqa: E402
from labkit.model import flops_per_token, model_config  # noqa: E402

BATCH, SEQ_LEN, N_BATCHES, REPEATS, MAX_FUNCTIONS = 32, 512, 150, 5, 12_000
H100_PEAK, MFU = 989e12, 0.4  # H100 SXM dense bf16 (docs/references.md C2), target MFU


def disassemble(max_functions: int) -> list[str]:
    """'mnemonic operands' lines of exported x86-64 functions of this machine's libraries."""
    import capstone
    from elftools.elf.elffile import ELFFile

    docs: list[str] = []
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    libs = sorted(glob.glob("/usr/lib/x86_64-linux-gnu/lib*.so*"), key=lambda p: ("libc.so" not in p, p))
    for path in libs:
        try:
            with open(path, "rb") as f:
                elf = ELFFile(f)
                text, sym = elf.get_section_by_name(".text"), elf.get_section_by_name(".dynsym")
                if elf["e_machine"] != "EM_X86_64" or text is None or sym is None:
                    continue
                lo, data = text["sh_addr"], text.data()
                funcs = sorted({(s["st_value"], s["st_size"]) for s in sym.iter_symbols()
                                if s["st_info"]["type"] == "STT_FUNC" and s["st_size"] > 0
                                and lo <= s["st_value"] < lo + text["sh_size"]})
                docs += ["\n".join(f"{i.mnemonic} {i.op_str}".strip() for i in md.disasm(data[a - lo:a - lo + n], a))
                         for a, n in funcs]
        except Exception:  # not an ELF we can read: skip
            continue
        if len(docs) >= max_functions:
            break
    return docs[:max_functions]


def build_shards(tmp: Path) -> tuple[Path, Path]:
    import polars as pl

    docs = disassemble(MAX_FUNCTIONS)
    pl.DataFrame({"text": docs}).write_parquet(tmp / "docs.parquet")
    train_tokenizer(str(tmp / "docs.parquet"), TokenizerConfig(vocab_size=8192), str(tmp / "tokenizer.json"))
    index = write_shards(str(tmp / "docs.parquet"), str(tmp / "tokenizer.json"), str(tmp / "shards"),
                         ShardConfig(seq_len=SEQ_LEN, sequences_per_shard=1024), progress=False)
    print(f"data: {len(docs)} functions -> {index['n_sequences']} sequences x {SEQ_LEN}, "
          f"{index['n_tokens']} real tokens, vocab {index['vocab_size']}")
    return tmp / "shards", tmp / "tokenizer.json"


class PerSample(torch.utils.data.Dataset):
    """The baseline's dataset: one memmap row (np.uint16 [seq_len]) per __getitem__."""

    def __init__(self, data_dir: str) -> None:
        self.reader = SequenceReader(data_dir)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.reader[i]


def hf_loader(data_dir: Path, tokenizer_path: Path) -> torch.utils.data.DataLoader:
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), pad_token="[PAD]", unk_token="[UNK]",
                                  cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    ds = PerSample(str(data_dir))
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True, num_workers=1,
                                       collate_fn=DataCollatorForLanguageModeling(tok, mlm_probability=0.15),
                                       persistent_workers=True, multiprocessing_context="forkserver")


def rate(loader, n: int) -> float:
    """Samples/s over n batches, rolling over epochs (a new epoch's first batch included)."""
    got, t0 = 0, time.perf_counter()
    while got < n:
        for batch in loader:
            assert batch["input_ids"].shape == (BATCH, SEQ_LEN) and batch["labels"].dtype == torch.int64
            got += 1
            if got == n:
                break
    return n * BATCH / (time.perf_counter() - t0)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-loader-", dir="/tmp") as tmp:
        data_dir, tok_path = build_shards(Path(tmp))
        vocab = SequenceReader(data_dir).vocab_size
        ours = make_loader(data_dir, batch_size=BATCH, rank=0, world_size=1, seed=0, mlm_probability=0.15,
                           vocab_size=vocab, num_workers=1)
        base = hf_loader(data_dir, tok_path)
        rate(ours, 20), rate(base, 20)  # warm-up: worker start, page cache
        r_ours, r_base = [], []
        for r in range(REPEATS):
            r_ours.append(rate(ours, N_BATCHES))
            r_base.append(rate(base, N_BATCHES))
            print(f"repeat {r}: labkit {r_ours[-1]:,.0f} samples/s, HF collator {r_base[-1]:,.0f} samples/s")
        del ours, base
        v_ours, v_base = statistics.median(r_ours), statistics.median(r_base)

        cfg = model_config("bert-120m", vocab)
        fpt = flops_per_token(cfg, SEQ_LEN)
        need = MFU * H100_PEAK / (fpt * SEQ_LEN)
        print(f"derived: one H100 SXM, bert-120m, {MFU:.0%} MFU, seq {SEQ_LEN}: flops/token {fpt:.3e}; "
              f"samples/s needed = {MFU} * {H100_PEAK:.0e} / ({fpt:.3e} * {SEQ_LEN}) = {need:,.0f}; "
              f"one worker gives {v_ours:,.0f} samples/s on this CPU -> workers = ceil({need:,.0f} / {v_ours:,.0f}) "
              f"= {workers_needed(need, v_ours)} (HF collator path: {workers_needed(need, v_base)})")
        step = planned_step_time(fpt, seq_len=SEQ_LEN, batch_size=BATCH, peak_flops=H100_PEAK, mfu=MFU)
        table = sweep_loader(data_dir, batch_size=BATCH, step_time_s=step, workers=(0, 1, 2), n_batches=60,
                             threshold=0.05, gpu_index=None)
        print(f"loader sweep: consumer step {step * 1e3:.1f} ms (the planned H100 step at batch {BATCH}), "
              f"knee threshold 5 % data wait")
        with __import__("polars").Config(tbl_rows=10, tbl_cols=12, tbl_width_chars=200):
            print(table.select("num_workers", "samples_per_s", "data_wait_s", "step_time_s",
                               "data_wait_fraction", "gpu_util_mean", "knee"))
    print(json.dumps({"benchmark": "loader", "metric": "samples/s", "value": round(v_ours, 1),
                      "baseline": "transformers DataCollatorForLanguageModeling, 1 worker",
                      "baseline_value": round(v_base, 1), "ratio": round(v_ours / v_base, 3), "goal": 3.0,
                      "higher_is_better": True}))


if __name__ == "__main__":
    main()
