"""FedDyn — Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning Based on Dynamic
Regularization", ICLR 2021 (Algorithm 1). Official code: https://github.com/alpemreacar/FedDyn

Each client k keeps a linear term g_k = ∇L_k(θ_k^{t−1}) (0 before it first trains) and minimises

    L_k(w) − ⟨g_k, w⟩ + (α/2)‖w − θ^{t−1}‖²        (step direction ∇f̂_k(w) − g_k + α(w − θ))

then updates g_k ← g_k − α(θ_k^t − θ^{t−1}). The server keeps h (0 at the start) over all m clients
(m = K, the whole federation, not the round's |P_t|):

    h ← h − α (1/K) Σ_{k∈P_t} (θ_k^t − θ^{t−1}),     θ^t = (1/|P_t|) Σ_{k∈P_t} θ_k^t − h/α.

Checked against the official code (`utils_methods.train_FedDyn`): its `local_param_list[k]` is −g_k/α,
the server model is the participants' mean plus the mean of `local_param_list` over all clients, which is
the step above. Not reproduced here: the official code's per-client α_k = α·n̄/n_k (`alpha_coef /
weight_list[clnt]`, n̄ the mean client size) and its gradient-norm clipping at 10 — plain α, no clipping,
as in the paper's Algorithm 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.method import LocalObjective, Method, RoundInfo, ServerSGD, UniformWeighting
from ...core.registry import register


@dataclass
class DynamicRegulariser(LocalObjective):
    """Client side: g_k in the store; ctx = −g_k; correction = −g_k + α(w − θ); g_k ← g_k − αΔ_k."""
    alpha: float = 0.01

    def client_state(self, theta):
        return {"g": torch.zeros_like(theta)}

    def context(self, down, cstate):
        return -cstate["g"]

    def correction(self, w, anchor, ctx):
        return ctx + self.alpha * (w - anchor)

    def finish(self, deltas, down, cstate, steps, lr):
        return {}, {"g": cstate["g"] - self.alpha * deltas}


@dataclass
class FedDynAggregate:
    """Server side as a stateful rule: h ← h − (α/K) Σ_k Δ_k; returns mean_k Δ_k − h/α, so that with
    a unit server step θ ← θ + mean Δ − h/α = mean_k θ_k − h/α."""
    alpha: float = 0.01
    uses_context = True

    def init_state(self, theta, num_clients):
        return {"h": torch.zeros_like(theta)}

    def aggregate(self, state, deltas, weights, info: RoundInfo):
        h = state["h"] - (self.alpha / info.num_clients) * deltas.sum(0)
        return deltas.mean(0) - h / self.alpha, {"h": h}


@register("feddyn", claims="moon_feddyn")
def feddyn(alpha: float = 0.01) -> Method:
    if not alpha > 0:
        raise ValueError(f"FedDyn's alpha (α) must be > 0, got {alpha}")
    return Method("feddyn", DynamicRegulariser(float(alpha)), UniformWeighting(), FedDynAggregate(float(alpha)),
                  ServerSGD(lr=1.0))
