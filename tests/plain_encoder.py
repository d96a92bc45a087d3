"""A BERT-like encoder written in plain PyTorch, as a user of labkit might write their own.

Nothing here comes from labkit: pre-LN blocks, one module per attention head (its own query, key
and value projections, ``torch.bmm`` scores, softmax, no attention dropout), a GELU FFN, dropout
on the residual branches, learned positions, and an untied decoder that computes logits at
every position (the loss is the mean over masked ones, ``ignore_index=-100``). Used by
tests/study/test_memory.py, benchmarks/bench_planner.py and as the example of
``labkit plan --model-module tests/plain_encoder.py:factory``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Head(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(hidden, width), nn.Linear(hidden, width), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, width]
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])  # [B, T, T]
        return torch.bmm(scores.softmax(dim=-1), v)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.heads = nn.ModuleList(Head(hidden, hidden // heads) for _ in range(heads))
        self.out = nn.Linear(hidden, hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.drop(self.out(torch.cat([head(h) for head in self.heads], dim=-1)))
        return x + self.drop(self.ffn(self.norm2(x)))


class PlainEncoder(nn.Module):
    def __init__(self, vocab: int = 5000, hidden: int = 256, layers: int = 4, heads: int = 4, ffn: int = 1024,
                 max_len: int = 512, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(max_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.decoder = nn.Linear(hidden, vocab)  # untied

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.decoder(self.norm(x))  # [B, T, V] at every position
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def factory(seq_len: int = 512, vocab: int = 5000, **model_kw):
    """(make_model, make_batch) for ``labkit.study.memory.plan_model``: 15 % of each row masked."""
    def make_model() -> nn.Module:
        return PlainEncoder(vocab=vocab, max_len=max(512, seq_len), **model_kw)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, vocab, (b, seq_len), generator=g)
        labels = torch.full_like(ids, -100)
        k = max(1, round(0.15 * seq_len))
        labels[:, 1:1 + k] = ids[:, 1:1 + k]
        return {"input_ids": ids, "labels": labels}

    return make_model, make_batch
