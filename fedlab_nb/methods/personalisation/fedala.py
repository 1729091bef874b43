"""FedALA — Zhang, Hua, Wang, Song, Xue, Ma, Guan, "FedALA: Adaptive Local Aggregation for Personalized
Federated Learning", AAAI 2023. Official code: https://github.com/TsingZ0/FedALA (`system/utils/ALA.py`)

Before local training, a client does not overwrite its local model w with the global θ but blends them
element-wise with learned weights W ∈ [0, 1]^d on the top p parameter tensors (the lower ones take θ):

    ŵ = w + (θ − w) ⊙ W,      W ← clip(W − η ∇_ŵ L(ŵ; B) ⊙ (θ − w), 0, 1)   per batch B

W is learned on a random contiguous s% slice of the local training data: until the std of the last 10
epoch losses is below a threshold in the client's first ALA round, one epoch in later rounds. W is kept
(per client, in the store) across rounds, starting at all ones. In the client's first round (w = θ) ALA is
skipped. Then the client trains ŵ with local SGD and sends it; the server averages as FedAvg. The local
model (after training) is the client's personal model.

Checked against the official `ALA.adaptive_local_aggregation`: `layer_idx` = p (0: every tensor), the
skip test `sum(θ[0] − w[0]) == 0`, the loss recorded per epoch as the last batch's loss. Added: an epoch
cap for the first phase (`max_epochs`), since the official loop has none.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.func import grad_and_value

from ...core.method import DataSizeWeighting, LocalObjective, Method, OwnTraining, ServerSGD, weighted_mean
from ...core.registry import register
from ...core.streams import register_stream
from ...models import param_spec
from ...utils import rng

ALA_SLICE = register_stream("fedala_slice", 12)   # where each client's s% weight-learning slice starts


def top_mask(spec, p: int, device=None) -> torch.Tensor:
    """Bool [d]: the flat positions of the last p parameter tensors (p = 0: all of them)."""
    sizes = [int(np.prod(s)) for _, s in spec]
    chosen = [i >= len(sizes) - p for i in range(len(sizes))] if p else [True] * len(sizes)
    return torch.cat([torch.full((n,), c, dtype=torch.bool) for n, c in zip(sizes, chosen)]).to(device)


def learn_weights(loss_fn, w, theta, weights, top, x, y, batch_size, eta, first, threshold, max_epochs):
    """The ALA weight learning on (x, y): (W [d], ŵ [d]) with ŵ = θ below `top`, w + (θ − w) ⊙ W on it."""
    diff = torch.where(top, theta - w, torch.zeros_like(w))
    base = torch.where(top, w, theta)
    W, losses = weights.clone(), []
    grad_fn = grad_and_value(loss_fn)
    for _ in range(max_epochs if first else 1):
        for i in range(0, len(y), batch_size):
            g, value = grad_fn(base + diff * W, x[i:i + batch_size], y[i:i + batch_size])
            W = torch.where(top, (W - eta * g * diff).clamp(0, 1), W)
        losses.append(float(value))
        if len(losses) > 10 and np.std(losses[-10:]) < threshold:
            break
    return W, base + diff * W


@dataclass
class FedALAClient(OwnTraining):
    eta: float = 1.0
    rand_percent: int = 80
    layer_idx: int = 2
    threshold: float = 0.1
    max_epochs: int = 100

    def client_state(self, method, theta, groups):
        return {"model": theta.clone(), "weights": torch.ones_like(theta), "learned": torch.zeros(())}

    def local_train(self, method, ctx, jobs, down, cstate):
        theta = down["theta"]
        top = top_mask(param_spec(ctx.model), self.layer_idx, theta.device)
        starts, weights, ran = [], [], []
        for i, job in enumerate(jobs):
            w, W = cstate["model"][i], cstate["weights"][i]
            ran.append(float(torch.sum(theta - w) != 0))
            if not ran[-1]:                          # first round of this client: ALA is off, ŵ = θ
                starts.append(theta.clone())
                weights.append(W)
                continue
            x, y = self._slice(job, ctx.seed, ctx.round)
            W, start = learn_weights(ctx.loss_fn, w, theta, W, top, x, y, ctx.batch_size, self.eta,
                                     not bool(cstate["learned"][i]), self.threshold, self.max_epochs)
            starts.append(start)
            weights.append(W)
        W_out, losses = ctx.train(theta, jobs, LocalObjective(), start=torch.stack(starts))
        ran = torch.tensor(ran, device=theta.device, dtype=cstate["learned"].dtype)
        new = {"model": W_out.clone(), "weights": torch.stack(weights), "learned": torch.maximum(cstate["learned"], ran)}
        return {"delta": W_out - theta}, new, losses

    def _slice(self, job, seed, r):
        """A random contiguous s% slice of the client's training rows (keyed by seed, round, client)."""
        n = len(job.y)
        take = max(1, int(self.rand_percent / 100 * n))
        a = int(rng(seed, ALA_SLICE, r, job.client_id).integers(0, n - take + 1))
        return job.x[a:a + take], job.y[a:a + take]

    def personal(self, method, theta, cstate, groups):
        return cstate["model"]


@register("fedala", claims="personalisation_more")
def fedala(eta: float = 1.0, rand_percent: int = 80, layer_idx: int = 2, threshold: float = 0.1,
           max_epochs: int = 100, server_lr: float = 1.0) -> Method:
    """Defaults η = 1, s = 80%, p = 2 (the last layer's weight and bias), threshold 0.1: the official code's (system/main.py)."""
    if not 0 < rand_percent <= 100 or layer_idx < 0 or not eta > 0:
        raise ValueError(f"FedALA needs 0 < rand_percent <= 100, layer_idx >= 0 and eta > 0; got {rand_percent}, "
                         f"{layer_idx}, {eta}")
    return Method("fedala", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  client=FedALAClient(float(eta), int(rand_percent), int(layer_idx), float(threshold), int(max_epochs)))
