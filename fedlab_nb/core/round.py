"""A client's work in one round: its data and its mini-batch schedule.

The schedule is a list of index arrays drawn from a generator keyed by (seed, round, client), so every
backend (loop, vmap, Flower) replays exactly the same steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@dataclass
class LocalJob:
    client_id: int
    x: torch.Tensor
    y: torch.Tensor
    batches: list            # list of int64 index arrays into (x, y); len = the client's local steps τ_k
    ctx: torch.Tensor | None = None  # the objective's per-client context row (SCAFFOLD: c − c_k)


@runtime_checkable
class DataPoison(Protocol):
    """Data poisoning, a part of the run (`simulate(poison=...)`; LabelFlip, PixelTrigger in
    fedlab_nb.methods.robustness.poison): the engine calls it on the training rows of each of `clients` every
    time one of their jobs is built, and the client trains on what it returns."""
    clients: tuple

    def __call__(self, client: int, round: int, x: torch.Tensor, y: torch.Tensor,
                 generator: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's (x, y) in this round; draws come from `generator`, keyed by (seed, POISON, round, client)."""


@runtime_checkable
class ScoredPoison(DataPoison, Protocol):
    """A data poison that also measures itself at every evaluation (the backdoor's attack success rate)."""

    def evaluate(self, model: torch.nn.Module, theta: torch.Tensor, fed) -> dict:
        """{column: float} added to the History row, for the global model θ."""


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
