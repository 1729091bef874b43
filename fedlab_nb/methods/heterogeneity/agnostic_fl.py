"""AFL — Mohri, Sivek, Suresh, "Agnostic Federated Learning", ICML 2019 (https://arxiv.org/abs/1902.00146),
the baseline q-FFL is compared with in Li et al. (ICLR 2020, Table 2; https://github.com/litian96/fair_flearn).

AFL minimises the loss of the worst mixture of the clients' distributions, min_w max_{λ ∈ Δ} Σ_k λ_k F_k(w),
by stochastic gradient descent on w and projected gradient ascent on λ; the model it returns is the average of
the iterates (Stochastic-AFL):

    client k:  F_k = F_k(w^t) on its training data, w̄_k = local SGD from w^t (one batch step in the paper)
    server:    w^{t+1} = w^t + Σ_k λ_k (w̄_k − w^t)         (= w^t − η Σ_k λ_k ∇F_k for one step)
               λ ← Proj_Δ(λ + γ F),  w_avg = mean of w^1 … w^{t+1}

Read fair_flearn's afl.py to understand the comparison script: it weights the clients' gradients by λ only when
clients are not sampled ∝ n_k (its `aggregate` sets every weight to 1 under `--sampling=2`, the setting its README
runs); here λ always weights them, as the AFL paper defines it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.method import LocalObjective, Method, ServerSGD, UniformWeighting
from ...core.registry import register
from .qffl import LossAtBroadcast, check_loss_on


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection onto {λ ≥ 0, Σ λ = 1} (sort and threshold, Duchi et al. 2008)."""
    if not torch.isfinite(v).all():
        raise ValueError(f"project_simplex: the vector must be finite, got {v.tolist()[:8]}; a NaN or inf λ step "
                         "comes from a too large lr_lambda or a non-finite loss")
    u, _ = torch.sort(v, descending=True)
    css = torch.cumsum(u, 0) - 1
    k = torch.arange(1, len(v) + 1, dtype=v.dtype, device=v.device)
    rho = int(torch.nonzero(u - css / k > 0).max())
    return (v - css[rho] / (rho + 1)).clamp_min(0)


@dataclass
class AgnosticRule:
    """Server side of Stochastic-AFL: λ-weighted client updates, projected ascent on λ with the clients' F_k,
    and the running average of the iterates (`state["average"]`, the model AFL returns)."""
    lr_lambda: float = 0.1
    uses_context = True

    def init_state(self, theta, num_clients):
        return {"lambda": torch.full((num_clients,), 1.0 / num_clients, dtype=theta.dtype, device=theta.device),
                "average": torch.zeros_like(theta), "rounds": 0}

    def aggregate(self, state, deltas, weights, info):
        if info.messages is None or "loss" not in info.messages.tensors:
            raise ValueError("AFL needs each client's loss F_k(θ) in its message; build the method with "
                             "fedlab_nb.methods.heterogeneity.agnostic_fl.agnostic_fl() (its client sends it)")
        ids = torch.as_tensor(info.client_ids, device=deltas.device)
        lam = state["lambda"][ids]
        total = float(lam.sum())
        # Σ_k λ_k Δ_k over the sampled clients: when the projection has set all their λ_k to 0 they carry no
        # weight in the objective, so θ does not move (not 0/0)
        agg = (lam / total).to(deltas.dtype) @ deltas if total > 0 else deltas.new_zeros(deltas.shape[1])
        ascent = state["lambda"].clone()
        ascent[ids] += self.lr_lambda * info.messages["loss"].to(ascent.dtype)
        if not torch.isfinite(ascent).all():
            raise ValueError(f"AFL: the λ ascent step λ + lr_lambda·F_k overflows (lr_lambda={self.lr_lambda:g}, "
                             f"largest F_k {float(info.messages['loss'].max()):.3g}); use a smaller lr_lambda "
                             "(the comparison script uses 0.1)")
        t = state["rounds"]
        new_theta = info.theta + agg  # the server step is plain SGD with lr 1 (agnostic_fl() builds it so)
        return agg, {"lambda": project_simplex(ascent), "rounds": t + 1,
                     "average": (state["average"] * t + new_theta) / (t + 1)}

    def metrics(self, state):
        return {"afl_lambda_max": float(state["lambda"].max())}


@register("agnostic_fl", claims="natural_partitions")
def agnostic_fl(lr_lambda: float = 0.1, loss_on: str = "data") -> Method:
    """AFL (agnostic FL): minimax over mixtures of clients; evaluate `History.state["rule"]["average"]`.
    `loss_on`: the F_k the λ step uses (as in q-FFL's `LossAtBroadcast`; "batch" with one local step is
    Stochastic-AFL's stochastic loss)."""
    if isinstance(lr_lambda, bool) or not isinstance(lr_lambda, (int, float)) or not 0 < lr_lambda < math.inf:
        raise ValueError(f"agnostic_fl: lr_lambda must be a finite number > 0 (the comparison script uses 0.1), "
                         f"got {lr_lambda!r}")
    return Method(f"agnostic_fl(lr_lambda={lr_lambda:g})", LocalObjective(), UniformWeighting(),
                  AgnosticRule(float(lr_lambda)), ServerSGD(lr=1.0),
                  client=LossAtBroadcast(check_loss_on("agnostic_fl", loss_on)))
