"""A client's work in one round: its data and its mini-batch schedule.

The schedule is a list of index arrays drawn from a generator keyed by (seed, round, client), so every
backend (loop, vmap, Flower) replays exactly the same steps."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LocalJob:
    client_id: int
    x: torch.Tensor
    y: torch.Tensor
    batches: list            # list of int64 index arrays into (x, y); len = the client's local steps τ_k
    ctx: torch.Tensor | None = None  # the objective's per-client context row (SCAFFOLD: c − c_k)


def batch_schedule(n: int, batch_size: int, epochs: int, steps: int | None, g: np.random.Generator) -> list:
    """Index arrays of each local step: `epochs` passes over a fresh permutation, cut into batches of
    `batch_size` (the last one of a pass may be smaller); with `steps`, exactly that many batches,
    drawn the same way and cycling over passes."""
    batches = []
    while True:
        perm = g.permutation(n)
        for i in range(0, n, batch_size):
            batches.append(perm[i:i + batch_size])
            if steps is not None and len(batches) == steps:
                return batches
        if steps is None and len(batches) >= epochs * -(-n // batch_size):
            return batches
