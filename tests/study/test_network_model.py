"""labkit.study.scaling.link_step_time: DDP's buckets queued on one link, against closed forms."""

from __future__ import annotations

import pytest

from labkit.study.scaling import link_step_time, ring_allreduce_time


def test_one_bucket_is_exposed_whole():
    """One bucket (mini's 14.5 MB under a 25 MiB cap) is ready at the end of backward: its whole
    ring all-reduce, S/B at 2 ranks, is exposed."""
    p = link_step_time(compute_s=1.0, bucket_bytes=[14.5e6], bandwidth=50e6 / 8)
    assert p["exposed_s"] == pytest.approx(14.5e6 / (50e6 / 8))
    assert p["step_s"] == pytest.approx(1.0 + p["exposed_s"])


def test_fast_link_hides_all_but_the_last_bucket():
    b = 1e9
    p = link_step_time(compute_s=3.0, bucket_bytes=[26e6, 29e6, 24e6], bandwidth=b, latency=1e-4)
    assert p["exposed_s"] == pytest.approx(ring_allreduce_time(24e6, 2, bandwidth=b, latency=1e-4))


def test_slow_link_queues_the_buckets():
    """The first bucket is ready a third into backward (2 s of 3 s compute); on a link too slow
    for any of them they run back to back from then: exposed = 2/3 s + sum(S)/B - 2 s."""
    b = 6e6
    p = link_step_time(compute_s=3.0, bucket_bytes=[26e6, 29e6, 24e6], bandwidth=b, wire_ratio=1.0)
    assert p["exposed_s"] == pytest.approx(2 / 3 + 79e6 / b - 2.0)
    assert link_step_time(compute_s=3.0, bucket_bytes=[26e6, 29e6, 24e6], bandwidth=b, wire_ratio=1.01)["comm_s"] \
        == pytest.approx(1.01 * 79e6 / b)


def test_the_cpu_cost_of_the_collective_sets_the_pace_on_a_fast_link_only():
    """With gloo's one-host all-reduce rate R: an all-reduce takes max(S/B, S/R). On a 21 Gbit/s
    link at R = 0.7 GB/s (the unshaped veth and the CPU measured in docs/measurement.md) mini's one
    14.5 MB bucket takes S/R, B/R = 3.75 x its wire time; at 50 Mbit/s the wire time, unchanged."""
    fast, rate = 21e9 / 8, 0.7e9
    p = link_step_time(compute_s=0.1, bucket_bytes=[14.5e6], bandwidth=fast, collective_rate=rate)
    assert p["exposed_s"] == pytest.approx(14.5e6 / rate)
    assert p["exposed_s"] == pytest.approx(3.75 * link_step_time(compute_s=0.1, bucket_bytes=[14.5e6],
                                                                 bandwidth=fast)["exposed_s"], rel=1e-2)
    slow = 50e6 / 8
    assert link_step_time(compute_s=1.0, bucket_bytes=[14.5e6], bandwidth=slow, collective_rate=rate) \
        == link_step_time(compute_s=1.0, bucket_bytes=[14.5e6], bandwidth=slow)
    # the CPU rate applies to the gradient bytes, not gloo's wire bytes
    q = link_step_time(compute_s=0.1, bucket_bytes=[14.5e6], bandwidth=fast, wire_ratio=1.5, collective_rate=rate)
    assert q["comm_s"] == pytest.approx(14.5e6 / rate)
    with pytest.raises(ValueError, match="collective_rate"):
        link_step_time(compute_s=1, bucket_bytes=[1], bandwidth=1, collective_rate=0)


def test_refusals():
    with pytest.raises(ValueError, match="compute_s"):
        link_step_time(compute_s=0, bucket_bytes=[1], bandwidth=1)
    with pytest.raises(ValueError, match="bandwidth"):
        link_step_time(compute_s=1, bucket_bytes=[1], bandwidth=0)
