"""PGFed — Luo, Mendieta, Chen, Wu, "PGFed: Personalize Each Client's Global Objective for Federated
Learning", ICCV 2023 (arXiv:2212.01448). Official code: https://github.com/ljaiverson/pgfed
(system/flcore/clients/clientpgfed.py, system/flcore/servers/serverpgfed.py).

Client i minimises its *personalised global objective*

    F_i(θ) = f_i(θ) + μ Σ_j a_ij f̃_j(θ),   f̃_j(θ) = f_j(θ_j) + ⟨∇f_j(θ_j), θ − θ_j⟩ = c_j + ⟨g_j, θ⟩,

the other clients' risks replaced by their first-order (Taylor) expansions around the models θ_j they
uploaded last round, so no client ever sees another's data or model: each uploads its full-batch gradient
g_j = ∇f_j(θ_j) and the scalar c_j = f_j(θ_j) − ⟨g_j, θ_j⟩. The gradient of the extra ("auxiliary") risk
is the constant μ Σ_j a_ij g_j, added to every local mini-batch gradient (PGFedMo: its momentum
β·old + (1 − β)·new across rounds). The weights a_ij ≥ 0 (start 1/M, M = clients per round) take a
projected gradient step with step size λ at every local step:

    a_ij ← max(0, a_ij − λ (μ c_j + ⟨θ_i, ḡ⟩)),   ḡ = (μ/M) Σ_j g_j      (the official code: "mean"),

the official code's shortcut ⟨θ_i, ḡ⟩ for the exact ∂F_i/∂a_ij = μ f̃_j(θ_i) = μ(c_j + ⟨θ_i, g_j⟩)
(`a_grad="exact"`). Each round clients start from the sample-weighted global model (FedAvg's θ), train
with the auxiliary gradient, and their trained model is their personal model (kept in the store,
evaluated on their own test split). μ = 0 removes the approximation term: FedAvg whose clients keep
their last local model.

In this library: the server's part (the last round's g_j, c_j and ids, and the K × K matrix a) lives in
the objective's server state and is broadcast; each client's personal model and PGFedMo buffer live in
the client store. Local training (`PGFedClient.local_train`) runs the engine's kernel one mini-batch step
at a time for all the round's clients together, so the a update sees θ_i at every step, as in the code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad_and_value

from ...core.method import DataSizeWeighting, LocalObjective, Method, OwnTraining, RoundInfo, ServerSGD, weighted_mean
from ...core.registry import register
from ...core.round import LocalJob


# --- the core computation --------------------------------------------------------------------------
def taylor_risk(c: torch.Tensor, grads: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """f̃_j(θ) = c_j + ⟨g_j, θ⟩ for every uploaded j ([M]; θ may be a batch [m, d] → [m, M])."""
    return c + theta @ grads.T


def auxiliary_gradient(a: torch.Tensor, grads: torch.Tensor, mu: float) -> torch.Tensor:
    """∇_θ of μ Σ_j a_ij f̃_j(θ): the constant μ Σ_j a_ij g_j, one row per client ([m, M] @ [M, d])."""
    return mu * a @ grads


def weight_step(a: torch.Tensor, c: torch.Tensor, grads: torch.Tensor, W: torch.Tensor, mu: float, lam: float,
                exact: bool = False) -> torch.Tensor:
    """One projected gradient step on a [m, M] at the clients' current models W [m, d]: the exact
    ∂F_i/∂a_ij = μ f̃_j(θ_i), or the official code's μ c_j + ⟨θ_i, (μ/M) Σ_k g_k⟩ (`exact=False`)."""
    if exact:
        slope = mu * taylor_risk(c, grads, W)
    else:
        slope = mu * c + (W @ (mu * grads.mean(0)))[:, None]
    return (a - lam * slope).clamp_min(0.0)


def full_gradients(loss_fn, W: torch.Tensor, jobs) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_j = ∇f_j(θ_j) [m, d], c_j = f_j(θ_j) − ⟨g_j, θ_j⟩ [m]) on each client's whole training set."""
    grad_fn = grad_and_value(loss_fn)
    out = [grad_fn(w, j.x, j.y) for w, j in zip(W, jobs)]
    G = torch.stack([g for g, _ in out])
    c = torch.stack([loss for _, loss in out]) - (G * W).sum(1)
    return G, c


# --- the parts -------------------------------------------------------------------------------------
@dataclass
class AuxiliaryRisk(LocalObjective):
    """The local step direction ∇f̂_i(w; B) + μ Σ_j a_ij g_j: the client's context row is the auxiliary
    gradient (a constant during the round). Also the server's bookkeeping: the matrix a (K × K) and the
    last round's uploads (g_j, c_j, ids), broadcast to the next round's clients."""

    def init_state(self, theta, num_clients):
        return {"a": theta.new_full((num_clients, num_clients), float("nan")),   # nan: not yet 1/M
                "grads": theta.new_zeros(0, theta.numel()), "c": theta.new_zeros(0),
                "ids": torch.zeros(0, dtype=torch.long, device=theta.device)}

    def broadcast(self, state):
        return {"pgfed.a": state["a"], "pgfed.grads": state["grads"], "pgfed.c": state["c"], "pgfed.ids": state["ids"]}

    def correction(self, w, anchor, ctx):
        return ctx

    def server_update(self, state, msgs, info: RoundInfo):
        a = state["a"].clone()
        if torch.isnan(a).all():  # a_ij⁰ = 1/M, M the clients of a round (the official code's join_clients)
            a.fill_(1.0 / len(info.client_ids))
        ids = torch.as_tensor(info.client_ids, device=a.device)
        rows = msgs["a"].to(a.dtype)
        a[ids] = torch.where(torch.isnan(rows), a[ids], rows)  # first-round rows carry no a yet
        return {"a": a, "grads": msgs["grad"], "c": msgs["c"], "ids": ids}


@dataclass
class PGFedClient(OwnTraining):
    """Local training from θ with the auxiliary gradient and the per-step a update; the message is
    Δ = θ_i − θ, g_i, c_i and the new row a_i; the store keeps θ_i (the personal model) and PGFedMo's
    momentum buffer."""
    nan_marker_entries = ("a",)  # round 1's a rows are NaN: "no a yet", the server fills in 1/M (not a fault)
    mu: float = 0.1
    lam: float = 0.01
    beta: float = 0.0
    a_grad: str = "mean"

    def client_state(self, method, theta, groups):
        return {"v": theta.clone(), "aux": torch.zeros_like(theta), "has_aux": theta.new_zeros(1)}

    def round_start(self, down, cstate, ids):
        """(a rows [m, M] over last round's uploaders, their (g, c), auxiliary gradients [m, d] or None)."""
        grads, c, prev = down["pgfed.grads"], down["pgfed.c"], down["pgfed.ids"]
        if not len(prev):   # the first round: nothing uploaded yet, plain local training
            return None, grads, c, None
        a = down["pgfed.a"][ids][:, prev]
        new = auxiliary_gradient(a, grads, self.mu)
        seen = cstate["has_aux"].to(new.dtype)  # PGFedMo: the first buffer is the new gradient itself
        aux = seen * (self.beta * cstate["aux"].to(new.dtype) + (1 - self.beta) * new) + (1 - seen) * new
        return a, grads, c, aux

    def local_train(self, method, ctx, jobs, down, cstate):
        theta = down["theta"]
        ids = torch.as_tensor([j.client_id for j in jobs], device=theta.device)
        a, grads, c, aux = self.round_start(down, cstate, ids)
        objective = LocalObjective() if aux is None else AuxiliaryRisk()
        W = theta.repeat(len(jobs), 1)
        loss_sum = theta.new_zeros(len(jobs))
        for s in range(max(len(j.batches) for j in jobs)):
            live = [i for i, j in enumerate(jobs) if len(j.batches) > s]  # clients with fewer steps are done
            if a is not None:   # the a step sees θ_i before this mini-batch step, as in the official code
                a[live] = weight_step(a[live], c, grads, W[live], self.mu, self.lam, self.a_grad == "exact")
            step = [LocalJob(jobs[i].client_id, jobs[i].x, jobs[i].y, [jobs[i].batches[s]],
                             None if aux is None else aux[i]) for i in live]
            W[live], losses = ctx.train(theta, step, objective, start=W[live])
            loss_sum[live] += losses
        G, c_new = full_gradients(ctx.loss_fn, W, jobs)
        a_rows = down["pgfed.a"][ids].clone()
        if a is None:
            a_rows.fill_(float("nan"))  # the server fills in 1/M after the first round
        else:
            a_rows[:, down["pgfed.ids"]] = a
        steps = torch.tensor([float(max(len(j.batches), 1)) for j in jobs], device=theta.device)
        new = {"v": W.clone(), "aux": aux if aux is not None else cstate["aux"],
               "has_aux": cstate["has_aux"] if aux is None else torch.ones_like(cstate["has_aux"])}
        return {"delta": W - theta, "grad": G, "c": c_new, "a": a_rows}, new, loss_sum / steps

    def personal(self, method, theta, cstate, groups):
        return cstate["v"]


@register("pgfed", claims="pgfed")
def pgfed(mu: float = 0.1, lam: float = 0.01, beta: float = 0.0, a_grad: str = "mean") -> Method:
    """`mu`: weight of the other clients' approximated risks (0: no approximation term); `lam`: step size of
    the a_ij (the paper's η₂; the code's -lam); `beta`: PGFedMo's momentum on the auxiliary gradient (0:
    PGFed); `a_grad`: "mean" (the official code) or "exact" (∂F_i/∂a_ij of the stated objective).
    Defaults: the official README's CIFAR-10 command (-mu 0.1 -lam 0.01 -bt 0.0)."""
    if not mu >= 0:
        raise ValueError(f"PGFed's mu (μ) must be >= 0 (0 = no approximation term), got {mu}")
    if not lam >= 0:
        raise ValueError(f"PGFed's lam (λ, the step size of a_ij) must be >= 0, got {lam}")
    if not 0 <= beta < 1:
        raise ValueError(f"PGFed's beta (PGFedMo's momentum) must be in [0, 1) (0 = PGFed), got {beta}")
    if a_grad not in ("mean", "exact"):
        raise ValueError(f"PGFed's a_grad must be 'mean' (the official code) or 'exact', got {a_grad!r}")
    name = "pgfedmo" if beta else "pgfed"
    return Method(name, AuxiliaryRisk(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=1.0),
                  client=PGFedClient(float(mu), float(lam), float(beta), a_grad))
