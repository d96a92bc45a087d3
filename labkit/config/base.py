"""What every config module shares: the special tokens, field validation, and dicts both ways."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable

__all__ = ["LEGACY_SPECIAL_TOKENS", "SPECIAL_TOKENS", "did_you_mean", "from_dict", "to_dict"]


SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[NEXT]")
"""Special tokens of every labkit tokenizer, in id order: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3,
[MASK]=4 (BERT's names, arXiv:1810.04805 section 3) and [NEXT]=5, the instruction separator of
the study's tokenizer and position embeddings (undertale-re/undertale be7ec98,
undertale/models/item/tokenizer.py, where it is id 5 too). Tokenizers and shards written before
[NEXT] was added have the first five only (``LEGACY_SPECIAL_TOKENS``) and stay readable: a shard
index records the special ids its tokenizer had."""

LEGACY_SPECIAL_TOKENS: tuple[str, ...] = SPECIAL_TOKENS[:5]
"""The special tokens of labkit tokenizers from before [NEXT]: ids 0..4."""


def _require(ok: bool, name: str, message: str) -> None:
    """Raise ``ValueError("<name>: <message>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}: {message}")


def _one_of(value: Any, name: str, allowed: tuple) -> None:
    _require(value in allowed, name, f"got {value!r}; allowed values are {', '.join(map(repr, allowed))}")


def did_you_mean(key: str, known: Iterable[str], listing: str) -> str:
    """The end of an unknown-key message: ``"did you mean 'max_steps'?"`` naming the closest
    known key (``difflib.get_close_matches``, ratio >= 0.6: Ratcliff-Obershelp similarity), else
    ``listing`` (the caller's list of the known keys) when none is close."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else listing


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-serialisable dict of a config dataclass (tuples become lists)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build ``cls`` from ``to_dict`` output; unknown keys raise ``ValueError`` naming them."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    _require(not unknown, cls.__name__, "unknown fields {}; {}".format(
        unknown, did_you_mean(unknown[0], names, f"known fields are {sorted(names)}") if unknown else ""))
    kwargs = {}
    for key, value in data.items():
        if isinstance(value, list) and "tuple" in str(names[key].type):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)
