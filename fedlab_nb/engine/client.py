"""Local training, one client after another (the `loop` backend), as a pure function of flat parameters.

A client's work is a `LocalJob`: its data and its mini-batch schedule (a list of index arrays drawn from
a generator keyed by (seed, round, client)), so the `vmap` backend can replay exactly the same steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

from ..models import param_spec, unflatten


@dataclass
class LocalJob:
    client_id: int
    x: torch.Tensor
    y: torch.Tensor
    batches: list            # list of int64 index arrays into (x, y); len = the client's local steps τ_k
    ctx: torch.Tensor | None  # the objective's per-client context (SCAFFOLD: c − c_k)


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


def make_loss(model: torch.nn.Module):
    """loss(θ_flat, x, y) = mean cross-entropy of `model` with parameters θ (stateless, vmappable)."""
    spec = param_spec(model)

    def loss(theta, x, y):
        return F.cross_entropy(functional_call(model, unflatten(theta, spec), (x,)), y)
    loss.model = model  # the vmap backend builds its masked, per-tensor loss from the same module
    return loss


def train_clients_loop(loss_fn, theta: torch.Tensor, jobs: list[LocalJob], lr: float, objective):
    """Run every job's local SGD from θ; returns (Δ [m, d], mean local loss [m])."""
    step = grad_and_value(loss_fn)
    deltas, losses = [], []
    for job in jobs:
        w, total = theta.clone(), theta.new_zeros(())
        for idx in job.batches:
            idx = torch.as_tensor(idx, device=theta.device)
            g, loss = step(w, job.x[idx], job.y[idx])
            corr = objective.correction(w, theta, job.ctx)
            w = w - lr * (g if corr is None else g + corr)
            total += loss.detach()
        deltas.append(w - theta)
        losses.append(total / len(job.batches))
    return torch.stack(deltas), torch.stack(losses)
