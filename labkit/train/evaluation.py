"""Held-out evaluation of an MLM run: the loss on a fixed masked set, the same on every call.

The set: the first ``max_sequences`` sequences of the shard set's held-out split
(``labkit.data.heldout``: whole documents never in the training shards). Each sequence is
masked once, on its own, by ``labkit.data.mlm.MLMCollator`` with seed 0 (not the run's seed,
so runs of different seeds are scored on the same masks) and the run's masking probability
(the collator seeds from the sequence's ids), so positions and replacements are the same at
every evaluation and for any number of ranks. Rank r evaluates sequences r,
r + world, ...; every rank runs the same number of forwards (a rank out of sequences repeats
its first batch, or with none of its own the set's first sequence, and discards it), which
FSDP's per-forward all-gathers need: with fewer held-out sequences than ranks the empty ranks
would otherwise wait in the final all-reduce while the others wait in an all-gather.

eval_loss = (sum over all ranks of the cross-entropy at every masked position) / (global
number of masked positions), the same normalisation as the training loss, in nats;
perplexity = exp(eval_loss). The model runs in ``eval()`` mode (no dropout) under
``torch.no_grad`` and the run's autocast precision; its train/eval mode is restored after.
"""

from __future__ import annotations

import math
import os

import torch

from labkit.data.shards import ShardSet
from labkit.train import dist

__all__ = ["evaluate", "HeldoutSet"]


class HeldoutSet:
    """The fixed masked held-out set of one rank. ``batches``: list of dicts input_ids int64
    [b, T], labels int64 [b, T] (-100 = not masked), attention_mask bool [b, T], on ``device``;
    every rank runs ``n_batches`` forwards (the same number on all ranks; ``filler`` is the batch
    a rank runs and discards once its own are done). ``n_sequences``: sequences of the whole set
    (all ranks). ``data``: the shard set's directory, or the ``labkit.data.shards.ShardSet`` the
    run opened (``open_shards``; nothing is read again but the held-out rows); its vocabulary (the
    masks' random replacements) is its index's ``vocab_size``, the model's. Raises
    ``labkit.data.heldout.HeldoutError`` when the shard set has no held-out split, ``ShardError``
    when its file changed since the set was opened."""

    def __init__(self, data: str | os.PathLike | ShardSet, *, rank: int, world_size: int, mlm_probability: float,
                 max_sequences: int, batch_size: int, device: torch.device, seed: int = 0) -> None:
        from labkit.data.heldout import read_heldout
        from labkit.data.mlm import MLMCollator, index_special_ids

        shards = data if isinstance(data, ShardSet) else ShardSet(data)  # opened by the run: index read once
        rows = read_heldout(shards, max_sequences)
        collate = MLMCollator(vocab_size=int(shards.index["vocab_size"]), mlm_probability=mlm_probability, seed=seed,
                              special_ids=index_special_ids(shards.index))
        self.n_sequences = len(rows)
        mine = [collate(rows[i:i + 1]) for i in range(rank, len(rows), world_size)]
        per_rank = math.ceil(len(rows) / world_size)
        self.n_batches = math.ceil(per_rank / batch_size)
        self.batches = []
        for k in range(0, len(mine), batch_size):
            group = mine[k:k + batch_size]
            self.batches.append({key: torch.cat([m[key] for m in group]).to(device) for key in group[0]})
        first = self.batches[0] if self.batches else \
            ({key: v.to(device) for key, v in collate(rows[:1]).items()} if len(rows) else None)
        self.filler = first


@torch.no_grad()
def evaluate(model: torch.nn.Module, heldout: HeldoutSet, *, precision: str = "fp32") -> dict[str, float]:
    """Collective (every rank calls): {"eval_loss" (nats per masked token), "perplexity",
    "eval_masked" (global masked positions), "eval_sequences"} of ``model`` on ``heldout``.
    ``model``: the run's ``labkit.train.parallel.ModelParts`` (its forward calls the stages without
    DDP, so no gradient collective runs per forward, and returns the loss on one rank per replica),
    or a plain or FSDP-sharded ``BertMLM``. ``precision``: "fp32", "bf16" or "fp16" autocast, as in
    training."""
    module = model
    was_training = module.training
    module.eval()
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]  # as the training step
    device = next(module.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, masked count]
    try:
        for k in range(heldout.n_batches):
            real = k < len(heldout.batches)
            batch = heldout.batches[k] if real else heldout.filler  # every rank runs n_batches forwards
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = module(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
            if real:
                total += torch.stack([out.loss_sum.double(), out.n_masked.double()])
    finally:
        module.train(was_training)
    dist.all_reduce_sum(total)
    loss = total[0].item() / max(1.0, total[1].item())
    return {"eval_loss": loss, "perplexity": math.exp(loss) if loss < 700 else float("inf"),
            "eval_masked": int(total[1].item()), "eval_sequences": heldout.n_sequences}
