"""APFL — Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, 2020
(Algorithm 1). Official code: https://github.com/MLOPTPSU/FedTorch (`comms/trainings/federated/apfl.py`).

Client k keeps a local model v_k and a mixing weight α_k; its personalised model is the mixture

    v̄_k = α_k v_k + (1 − α_k) w.

In a round each sampled client takes τ local steps, all on the same mini-batch ξ per step:

    w   ← w − η ∇f_k(w; ξ)                                   (its copy of the global model: FedAvg)
    v_k ← v_k − η ∇_v f_k(v̄_k; ξ) = v_k − η α_k ∇f_k(v̄_k; ξ)   (the local model, through the mixture)
    α_k ← Π_[0,1](α_k − η_α ⟨v_k − w, ∇f_k(v̄_k; ξ)⟩)           (∂f_k(v̄_k)/∂α_k, projected on [0, 1])

and the server averages the w's (data-size weights). α = 0 is FedAvg's global model, α = 1 is local
training alone. Taken from the paper: the parameter-space mixture and the per-step α update. The official
code (`comms/utils/flow_utils.alpha_update`) differs, and is not followed here: it mixes the two models'
*outputs* (logits), and updates α once per round, on the first batch, with the gradient
⟨v − w, α∇_v + (1 − α)∇_w⟩ + 0.02·α (the two models' own gradients and a small penalty on α).
v_k and α_k live in the client store (all K clients); v_k⁰ = w⁰ and α_k⁰ = `alpha` (default 0.5).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad, grad_and_value

from ...core.method import DataSizeWeighting, Method, OwnTraining, ServerSGD, weighted_mean
from ...core.registry import register


def mixture(v: torch.Tensor, w: torch.Tensor, alpha) -> torch.Tensor:
    """The personalised model v̄ = α v + (1 − α) w (α a scalar or a [m, 1] column)."""
    return alpha * v + (1 - alpha) * w


def apfl_step(loss_fn, w, v, alpha, x, y, lr: float, alpha_lr: float, adaptive: bool):
    """One APFL local step on batch (x, y): (w, v, α, loss of the mixture), every update from the old iterate."""
    g_w = grad(loss_fn)(w, x, y)
    g_bar, value = grad_and_value(loss_fn)(mixture(v, w, alpha), x, y)
    new_alpha = alpha
    if adaptive:  # ∂f(α v + (1 − α) w)/∂α = ⟨v − w, ∇f(v̄)⟩
        new_alpha = (alpha - alpha_lr * torch.dot(v - w, g_bar)).clamp(0.0, 1.0)
    return w - lr * g_w, v - lr * alpha * g_bar, new_alpha, value


def apfl_client(loss_fn, w0, v0, alpha0, x, y, batches, lr, alpha_lr, adaptive):
    """One client's round from the broadcast w0 and its stored (v0, α0): (w, v, α, mean mixture loss)."""
    w, v, alpha, losses = w0.clone(), v0.clone(), alpha0.clone(), []
    for idx in batches:
        w, v, alpha, value = apfl_step(loss_fn, w, v, alpha, x[idx], y[idx], lr, alpha_lr, adaptive)
        losses.append(value.detach())
    return w, v, alpha, torch.stack(losses).mean() if losses else w0.new_zeros(())


@dataclass
class APFLClient(OwnTraining):
    """Client state: v (the local model) and alpha (α_k); `adaptive=False` keeps α fixed (the α sweep).
    `alpha_lr`: η_α (None: the run's lr). `trace`: an optional list that gets (round, client ids, α after
    the round) for each round — a probe for plotting α's trajectory, not part of the method."""
    alpha: float = 0.5
    adaptive: bool = True
    alpha_lr: float | None = None
    trace: list | None = None

    def client_state(self, method, theta, groups):
        return {"v": theta.clone(), "alpha": theta.new_tensor(self.alpha)}

    def local_train(self, method, ctx, jobs, down, cstate):
        theta, lr = down["theta"], ctx.lr
        alpha_lr = lr if self.alpha_lr is None else self.alpha_lr
        out = [apfl_client(ctx.loss_fn, theta, cstate["v"][i], cstate["alpha"][i], j.x, j.y, j.batches, lr,
                           alpha_lr, self.adaptive) for i, j in enumerate(jobs)]
        W, V, A, losses = (torch.stack(t) for t in zip(*out))
        if self.trace is not None:
            self.trace.append((ctx.round, [j.client_id for j in jobs], A.tolist()))
        return {"delta": W - theta}, {"v": V, "alpha": A}, losses

    def personal(self, method, theta, cstate, groups):
        """Each client's mixture v̄_k = α_k v_k + (1 − α_k) θ with the current global θ, [K, d]."""
        return mixture(cstate["v"], theta, cstate["alpha"].unsqueeze(1))


@register("apfl", claims="apfl")
def apfl(alpha: float = 0.5, adaptive: bool = True, alpha_lr: float | None = None, server_lr: float = 1.0,
         trace: list | None = None) -> Method:
    """`alpha`: α_k⁰ (the fixed α when `adaptive=False`); `alpha_lr`: η_α (None: the client lr)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"APFL's alpha (α) must be in [0, 1] (0 = FedAvg, 1 = local only), got {alpha}")
    if alpha_lr is not None and not alpha_lr > 0:
        raise ValueError(f"APFL's alpha_lr (η_α) must be > 0 (or None for the client lr), got {alpha_lr}")
    return Method("apfl", weighting=DataSizeWeighting(), rule=weighted_mean, server_opt=ServerSGD(lr=server_lr),
                  client=APFLClient(float(alpha), bool(adaptive), alpha_lr, trace))
