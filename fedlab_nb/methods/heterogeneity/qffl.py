"""q-FFL / q-FedAvg — Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020.
Paper: https://openreview.net/forum?id=ByexElSYDr · official code: https://github.com/litian96/fair_flearn

q-FFL minimises f_q(w) = Σ_k p_k F_k(w)^{q+1} / (q + 1): a larger q puts more weight on the clients with a
high loss, pushing towards more uniform accuracy across clients (q = 0 is the usual average loss).
q-FedAvg solves it with local SGD and a step size from an estimate L of the Lipschitz constant of ∇F_k
(the paper sets L = 1/η, η the local learning rate):

    client k:  F_k = F_k(w^t) on its training data (before training),  w̄_k = E epochs of SGD from w^t
               Δ_k = L (w^t − w̄_k),   h_k = q F_k^{q−1} ‖Δ_k‖² + L F_k^q
    server:    w^{t+1} = w^t − Σ_k F_k^q Δ_k / Σ_k h_k

With q = 0, h_k = L and the step is the uniform mean of the clients' updates (FedAvg with p_k = 1/m; the
paper samples clients ∝ n_k and averages uniformly, here the run's sampler picks the clients).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.registry import register
from ...core.method import LocalObjective, Method, OwnTraining, ServerSGD, UniformWeighting

EPS = 1e-10  # F_k + ε, as the official code does, so F_k^{q−1} exists for a zero loss


@dataclass
class LossAtBroadcast(OwnTraining):
    """The usual local SGD from θ, plus the client's training loss F_k(θ) in the message entry "loss"
    (q-FedAvg's server needs it). `on="data"`: on all its training rows at the broadcast θ (the paper's F_k);
    "batch": the mean loss of its local steps' batches, i.e. with one local step the batch loss at θ (what the
    official q-FedSGD and AFL code send; no extra pass over the data)."""
    on: str = "data"

    def local_train(self, method, ctx, jobs, down, cstate):
        theta = down["theta"]
        W, losses = ctx.train(theta, jobs, method.objective)
        if self.on == "batch":
            return {"delta": W - theta, "loss": losses.to(theta.dtype)}, cstate, losses
        with torch.no_grad():
            f = torch.stack([ctx.loss_fn(theta, j.x.to(theta.device), j.y.to(theta.device)) for j in jobs])
        return {"delta": W - theta, "loss": f.to(theta.dtype)}, cstate, losses


def _finite_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_loss_on(where: str, loss_on) -> str:
    if loss_on not in ("data", "batch"):
        raise ValueError(f"{where}: loss_on must be 'data' (F_k on the client's training rows) or 'batch' (the "
                         f"local steps' batch losses), got {loss_on!r}")
    return loss_on


def qffl_step(deltas: torch.Tensor, losses: torch.Tensor, q: float, lipschitz: float) -> torch.Tensor:
    """The q-FedAvg server update to add to w^t, from the clients' w̄_k − w^t (rows of `deltas`) and F_k(w^t)."""
    f = losses.to(deltas.dtype).clamp_min(0) + EPS
    grads = -lipschitz * deltas                                  # Δ_k = L (w − w̄_k)
    h = q * f ** (q - 1) * (grads ** 2).sum(1) + lipschitz * f ** q
    return -(f ** q) @ grads / h.sum()


@dataclass
class QFFLRule:
    """Server side of q-FedAvg (reads each client's F_k from the round's messages). `lipschitz=None`: L = 1/η."""
    q: float = 1.0
    lipschitz: float | None = None
    uses_context = True

    def init_state(self, theta, num_clients):
        return {}

    def aggregate(self, state, deltas, weights, info):
        if info.messages is None or "loss" not in info.messages.tensors:
            raise ValueError("q-FFL needs each client's loss F_k(θ) in its message; build the method with "
                             "fedlab_nb.methods.heterogeneity.qffl.qffl() (its client sends it)")
        lipschitz = self.lipschitz if self.lipschitz is not None else 1.0 / info.lr
        return qffl_step(deltas, info.messages["loss"], self.q, lipschitz), state


@register("qffl", claims="natural_partitions")
def qffl(q: float = 1.0, lipschitz: float | None = None, loss_on: str = "data") -> Method:
    """q-FedAvg: q = 0 is FedAvg with uniform weights; larger q, fairer accuracy across clients. With one local
    step and `loss_on="batch"` it is the official q-FedSGD (gradient and loss of one batch)."""
    if not _finite_number(q) or q < 0:
        raise ValueError(f"qffl: q must be a finite number >= 0 (0 = FedAvg, the paper uses 0.001 … 15), got {q!r}")
    if lipschitz is not None and not (_finite_number(lipschitz) and lipschitz > 0):
        raise ValueError(f"qffl: lipschitz must be a finite number > 0 or None (None: L = 1/lr, as in the paper), "
                         f"got {lipschitz!r}")
    return Method(f"qffl(q={q:g})", LocalObjective(), UniformWeighting(), QFFLRule(float(q), None if lipschitz is None else float(lipschitz)),
                  ServerSGD(lr=1.0), client=LossAtBroadcast(check_loss_on("qffl", loss_on)))
