"""Timeline rows of data-parallel steps in closed form, for the analyses' tests: what every rank
of a DDP step records (``labkit.train.timeline``) when each rank's own data wait and compute are
given and the collectives behave as DDP's do: the step's first all-reduce ends when the last
rank arrives, the gradient collectives end ``tail`` seconds after the last rank's gradients are
ready (one rank's later when its incoming link is slow), the loss all-reduce ends when the last
rank's collectives have."""

from __future__ import annotations

import random

SMALL = 0.001  # seconds a small all-reduce takes once every rank is in it


def simulate(steps: int, *, data: list[float], compute: list[float], tail: float = 0.01,
             late_done: tuple[int, float] | None = None, optimizer: float = 0.005, other: float = 0.002,
             jitter: float = 0.0, seed: int = 0, segment_start: float = 1000.0, first_step: int = 1,
             resumed_from: int = 0, start_delay: float = 1.0, hosts: list[str] | None = None) -> list[dict]:
    """Rows of ``steps`` steps of len(data) ranks (seconds; ``jitter``: each own time times
    1 + uniform(-jitter, jitter)). The segment begins at ``segment_start`` and its first step
    ``start_delay`` later; every step starts when the previous one's rows end."""
    rng = random.Random(seed)
    n = len(data)
    hosts = hosts or ["h1"] * n
    t = segment_start + start_delay
    rows = []

    def j(x: float) -> float:
        return x * (1 + rng.uniform(-jitter, jitter))

    for step in range(first_step, first_step + steps):
        arrive = [j(d) for d in data]
        own = [j(c) for c in compute]
        s1_end = max(arrive) + SMALL
        ready = [s1_end + c for c in own]
        done_all = max(ready) + j(tail)
        done = [done_all + (late_done[1] if late_done and r == late_done[0] else 0.0) for r in range(n)]
        s2_end = max(done) + SMALL
        step_s = s2_end + optimizer
        for r in range(n):
            forward = own[r] / 3
            rows.append({
                "step": step, "rank": r, "host": hosts[r], "world_size": n, "segment_start": segment_start,
                "resumed_from": resumed_from, "t_start": t, "t_end": t + step_s + other, "step_s": step_s,
                "data_s": arrive[r], "sync_s": (s1_end - arrive[r]) + (s2_end - done[r]), "forward_s": forward,
                "backward_s": done[r] - s1_end - forward, "optimizer_s": optimizer, "other_s": other, "eval_s": 0.0,
                "checkpoint_s": 0.0, "sync_first_s": s1_end - arrive[r], "sync_end_s": s1_end,
                "comm_exposed_s": done[r] - ready[r], "bucket_ready_s": [ready[r] - own[r] / 2, ready[r]],
                "bucket_done_s": [done[r] - j(tail) / 2, done[r]]})
        t += step_s + other
    return rows
