"""Jacobian descent (JD) and the UPGrad aggregator, after Pierre Quinton and Valérian Rey, "Jacobian Descent
for Multi-Objective Optimization", arXiv 2406.16232 (2024), https://arxiv.org/abs/2406.16232; reference
implementation: TorchJD, https://github.com/TorchJD/torchjd (`torchjd.aggregation.UPGrad`).

JD stacks one gradient per objective into a Jacobian J ∈ R^{m×d} and an *aggregator* maps J to the update.
UPGrad projects every row g_i onto the dual cone of the rows, C(J) = {x : Jx ≥ 0}, and averages:

    A(J) = (1/m) Σ_i π_J(g_i),   π_J(g_i) = argmin_{x ∈ C(J)} ‖x − g_i‖².

By the paper's Proposition 1, π_J(Jᵀu) = Jᵀw with w = argmin_{v ≥ u} vᵀGv, G = JJᵀ: a QP in m variables.
Here it is solved exactly as a non-negative least-squares problem: with v = u + z, z ≥ 0 and any factor R with
RᵀR = G, vᵀGv = ‖R(u + z)‖², so z = NNLS(R, −Ru) (`scipy.optimize.nnls`). TorchJD solves the same QP with
quadprog after dividing G by its trace and adding 1e-4·I; `reg_eps` / `norm_eps` reproduce that choice, and
the default (0, 0) is the paper's unregularised definition.

The aggregator properties of the paper: *non-conflicting* (J·A(J) ≥ 0), *linear under scaling*
(c ↦ A(diag(c)J) is linear on c > 0, because positive row scales leave C(J) unchanged) and *weighted*
(A(J) = Jᵀw). Instance-wise risk minimisation (IWRM) takes every training example's loss as one objective:
J is the per-example gradient matrix of a mini-batch (`per_example_jacobian`, `torch.func`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from scipy.optimize import minimize, nnls
from torch import Tensor
from torch.func import functional_call, grad, vmap

from ...core.registry import register
from ...models import param_spec, unflatten


def _check_jacobian(J: Tensor) -> Tensor:
    if not torch.is_tensor(J) or J.ndim != 2 or J.shape[0] == 0:
        raise ValueError(f"J must be an [m, d] tensor with m >= 1 rows (one gradient per objective), got "
                         f"{tuple(J.shape) if torch.is_tensor(J) else type(J).__name__}")
    if not torch.isfinite(J).all():
        raise ValueError("J holds NaN or inf entries; drop those objectives first")
    return J


def gramian(J: Tensor, norm_eps: float = 0.0, reg_eps: float = 0.0) -> np.ndarray:
    """G = JJᵀ in float64; with norm_eps > 0 divided by its trace (0 if the trace is below norm_eps), then
    + reg_eps·I (TorchJD's normalisation and regularisation)."""
    if norm_eps < 0 or reg_eps < 0:
        raise ValueError(f"norm_eps and reg_eps must be >= 0, got {norm_eps} and {reg_eps}")
    Jd = _check_jacobian(J).detach().double().cpu()
    G = (Jd @ Jd.T).numpy()
    if norm_eps > 0:
        trace = np.trace(G)
        G = np.zeros_like(G) if trace < norm_eps else G / trace
    return G + reg_eps * np.eye(len(G))


def _factor(G: np.ndarray) -> np.ndarray:
    """R with RᵀR = G for a PSD G (eigenvalues below 0 from round-off are clipped)."""
    lam, V = np.linalg.eigh((G + G.T) / 2)
    return np.sqrt(np.clip(lam, 0, None))[:, None] * V.T


def dual_cone_weights(G: np.ndarray, U: np.ndarray) -> np.ndarray:
    """For each row u of U, w = argmin_{v ≥ u} vᵀGv (Proposition 1 of the paper): the weights with
    π_J(Jᵀu) = Jᵀw. Solved as w = u + NNLS(R, −Ru)."""
    R = _factor(G)
    return np.stack([u + nnls(R, -R @ u, maxiter=50 * len(u))[0] for u in np.atleast_2d(U)])


def upgrad_weights(J: Tensor, pref: Tensor | None = None, *, norm_eps: float = 0.0, reg_eps: float = 0.0) -> Tensor:
    """The m weights w of A(J) = Jᵀw: Σ_i pref_i · argmin_{v ≥ e_i} vᵀGv (pref = 1/m by default)."""
    m = _check_jacobian(J).shape[0]
    p = np.full(m, 1.0 / m) if pref is None else torch.as_tensor(pref, dtype=torch.float64).numpy()
    if p.shape != (m,) or (p < 0).any():
        raise ValueError(f"pref must be {m} non-negative numbers (one per row of J), got shape {p.shape}")
    W = dual_cone_weights(gramian(J, norm_eps, reg_eps), np.diag(p))
    return torch.as_tensor(W.sum(0), dtype=J.dtype, device=J.device)


@register("jacobian_descent", claims="jacobian_descent", kind="module")
def upgrad(J: Tensor, pref: Tensor | None = None, *, norm_eps: float = 0.0, reg_eps: float = 0.0) -> Tensor:
    """UPGrad: the mean of the projections of the rows of J onto their dual cone {x : Jx ≥ 0}, as Jᵀw."""
    return J.T @ upgrad_weights(J, pref, norm_eps=norm_eps, reg_eps=reg_eps)


def project_rows(J: Tensor) -> Tensor:
    """[m, d]: row i is π_J(g_i), the projection of g_i onto the dual cone of the rows (unregularised)."""
    W = dual_cone_weights(gramian(J), np.eye(len(J)))
    return torch.as_tensor(W, dtype=J.dtype) @ J


def mean_aggregate(J: Tensor) -> Tensor:
    """The plain mean of the rows (FedSGD's / the average loss's update)."""
    return _check_jacobian(J).mean(0)


def min_norm(J: Tensor) -> Tensor:
    """MGDA's update (Désidéri 2012; Sener & Koltun, NeurIPS 2018): the minimum-norm point of the convex
    hull of the rows, Jᵀλ with λ = argmin_{λ ∈ simplex} λᵀGλ (SLSQP, tolerance 1e-14)."""
    G = gramian(J)
    m = len(G)
    res = minimize(lambda l: l @ G @ l, np.full(m, 1.0 / m), jac=lambda l: 2 * G @ l, method="SLSQP",
                   bounds=[(0, None)] * m, constraints=[{"type": "eq", "fun": lambda l: l.sum() - 1}],
                   options={"ftol": 1e-14, "maxiter": 500})
    return J.T @ torch.as_tensor(res.x, dtype=J.dtype)


def conflict(J: Tensor, update: Tensor) -> float:
    """min_i g_i·update: below 0 means the update increases some objective to first order."""
    return float((J @ update).min())


# --- Jacobians of models ---------------------------------------------------------------------------
def per_example_jacobian(model: torch.nn.Module, theta: Tensor, x: Tensor, y: Tensor,
                         loss_fn: Callable = torch.nn.functional.cross_entropy) -> Tensor:
    """[n, d]: row i is ∇_θ loss(model_θ(x_i), y_i), by `torch.func.vmap(grad(...))` (IWRM's Jacobian)."""
    spec = param_spec(model)

    def one_loss(t, xi, yi):
        return loss_fn(functional_call(model, unflatten(t, spec), (xi[None],)), yi[None])

    return vmap(grad(one_loss), in_dims=(None, 0, 0))(theta, x, y)


def client_jacobian(model: torch.nn.Module, theta: Tensor, clients, loss_fn: Callable = torch.nn.functional.cross_entropy):
    """([K, d] full-batch gradients, [K] losses) of K clients' mean losses at θ: the Jacobian a server sees
    when every client sends its gradient (FedSGD)."""
    spec = param_spec(model)

    def client_loss(t, x, y):
        return loss_fn(functional_call(model, unflatten(t, spec), (x,)), y)

    rows, losses = [], []
    for x, y in clients:
        t = theta.detach().requires_grad_(True)
        loss = client_loss(t, x, y)
        rows.append(torch.autograd.grad(loss, t)[0])
        losses.append(float(loss.detach()))
    return torch.stack(rows), torch.tensor(losses, dtype=torch.float64)
