"""bucket_cap_mb="auto" (labkit/train/buckets.py): the bucket that hides the link's latency and
bandwidth behind backward, chosen by the queue model, against its closed forms in the two regimes
(a link that keeps up with backward, and one that cannot). The 2-rank run with "auto" is in
tests/train/test_compression.py (one spawn with the compression runs)."""

from __future__ import annotations

import math

import pytest

from labkit.train import buckets

MIB = 2**20


def test_the_queue_exposes_what_is_left_on_the_link_after_backward():
    assert buckets.queue_exposed_s([0.1, 0.1], [0.2, 1.0], 1.0) == pytest.approx(0.1)  # the last bucket alone
    assert buckets.queue_exposed_s([0.6, 0.1], [0.5, 1.0], 1.0) == pytest.approx(0.2)  # the first delays the last
    assert buckets.queue_exposed_s([], [], 1.0) == 0.0
    # one bucket holding every gradient: the whole all-reduce is exposed
    assert buckets.exposed_s(64 * MIB, grad_bytes=10 * MIB, last_bytes=0, backward_s=0.1, latency_s=1e-3,
                             s_per_byte=1e-9) == pytest.approx(1e-3 + 1e-9 * 10 * MIB)


def test_a_link_that_keeps_up_exposes_only_the_last_bucket_from_the_smallest_bucket_that_keeps_up():
    """b < backward_s / G: from S1 = a / (backward_s/G - b) every bucket finishes before the next is
    full, and at most the last two are on the link when backward ends (the last full one, then the
    bytes left after the full buckets with the embedding's); below S1 the latencies pile up."""
    g, backward, a, b = 64 * MIB, 0.2, 2e-3, 1e-9  # the link: 1 GB/s; backward fills 335 MB/s
    s1 = a / (backward / g - b)
    assert 0.5 * MIB < s1 < 1 * MIB
    for emb in (0, 2 * MIB):
        kw = dict(grad_bytes=g, last_bytes=emb, backward_s=backward, latency_s=a, s_per_byte=b)
        assert buckets.exposed_s(s1 * 1.05, **kw) <= 2 * (a + b * s1 * 1.05) + b * emb + 1e-12
        assert buckets.exposed_s(s1 / 2, **kw) > 3 * (a + b * (s1 + emb))  # below S1 the queue builds up
        got = buckets.bucket_bytes(**kw)
        assert s1 / 1.2 <= got["bytes"] <= 1.5 * s1 + emb, (got["bytes"] / MIB, s1 / MIB)  # up to S1 + the embedding
        assert got["exposed_s"] <= 2 * (a + b * 1.5 * s1) + b * emb
        assert got["exposed_s"] < got["exposed_s_at_25mib"] / 3


def test_a_link_slower_than_backward_takes_about_the_square_root_rule():
    """b > backward_s / G: the link is busy from the first bucket to the end; exposed ~ the first
    bucket's wait backward_s·S/G plus G/S latencies plus G·b - backward_s, least at S = G·sqrt(a /
    backward_s)."""
    g, backward, a, b = 64 * MIB, 0.2, 5e-3, 2e-8  # 50 MB/s against 335 MB/s of gradients
    best = g * math.sqrt(a / backward)
    kw = dict(grad_bytes=g, last_bytes=0, backward_s=backward, latency_s=a, s_per_byte=b)
    got = buckets.bucket_bytes(**kw)
    assert best / 2 <= got["bytes"] <= best * 2, (got["bytes"] / MIB, best / MIB)  # a flat optimum
    assert got["exposed_s"] <= 1.01 * buckets.exposed_s(best, **kw)
    assert got["exposed_s"] < min(buckets.exposed_s(best / 8, **kw), buckets.exposed_s(best * 4, **kw))
    assert got["exposed_s"] == pytest.approx(g * b - backward + 2 * math.sqrt(a * backward), rel=0.1)
    with pytest.raises(ValueError, match="backward_s must be positive"):
        buckets.bucket_bytes(grad_bytes=g, last_bytes=0, backward_s=0, latency_s=a, s_per_byte=b)


def test_the_embedding_bytes_are_labkits_embedding_side_parameters():
    import torch

    from labkit.model import BertMLM, model_config

    cfg = model_config("small", 1024)
    h = cfg.hidden_size
    assert buckets.embedding_bytes(BertMLM(cfg)) == 4 * ((1024 + cfg.max_position_embeddings
                                                           + cfg.type_vocab_size) * h + 2 * h)
    assert buckets.embedding_bytes(torch.nn.Linear(4, 4)) == 0
