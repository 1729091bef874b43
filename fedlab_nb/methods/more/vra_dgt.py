"""VRA-DGT / VRA-DSGT — Zhao & Liu, "Efficient Gradient Tracking Algorithms for Distributed Optimization
Problems with Inexact Communication", arXiv 2501.05737 (2025; v3 accepted by Computational Optimization and
Applications). No official code is given.

Decentralised gradient tracking (DGT; Qu & Li, "Harnessing Smoothness to Accelerate Distributed
Optimization", IEEE TCNS 2018) on m nodes with a doubly stochastic mixing matrix W (fedlab_nb.gossip):

    x⁺ = W x − α y,     y⁺ = W y + ∇F(x⁺) − ∇F(x),     y⁰ = ∇F(x⁰)

keeps Σᵢ yᵢ = Σᵢ ∇fᵢ(xᵢ) at every step, so y tracks the average gradient. Over an inexact link node i
receives xⱼ + ξᵢⱼ instead of xⱼ; then e = Σᵢ yᵢ − Σᵢ ∇fᵢ(xᵢ) gains Σᵢ Σ_{j≠i} wᵢⱼ ξᵢⱼ every step and is a
random walk (Var eᵏ = k σ² Σ_{i≠j} wᵢⱼ²): plain DGT cannot converge under noise.

The noise-suppressed update used here damps every received aggregate with one sequence γₖ:

    x⁺ = x + γₖ (W̃x − x) − αₖ y,     y⁺ = y + γₖ (W̃y − y) + d(x⁺) − d(x)

where W̃u is the noisy aggregate node i forms from its neighbours' messages. With γₖ ≡ 1 and exact links it
is DGT bit for bit; with exact links Σᵢ yᵢ = Σᵢ dᵢ for every γ.
**Flagged simplification.** The paper's VRA mechanism (its algorithm box) could not be read from the
sources available offline; `vra_dgt` is our single-timescale stand-in (γₖ and αₖ both ∝ 1/(k + b)), not
the paper's exact update. The two-timescale baseline is the same recursion with γₖ decaying more slowly than
αₖ. The stochastic variant (VRA-DSGT) replaces ∇F by the hybrid variance-reduced (STORM-type) estimator
dᵏ = ∇f(xᵏ; Sᵏ) + (1 − γₖ)(dᵏ⁻¹ − ∇f(xᵏ⁻¹; Sᵏ)) on a fresh minibatch Sᵏ, with the same γₖ.

Everything is float64 and vectorised over R independent runs: states are [R, m, d].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...core.registry import register
from ...gossip import check_mixing, mix
from ...utils import check_positive_int
from ...utils import loglog_slope as utils_loglog_slope

DTYPE = torch.float64
CHANNELS = ("exact", "gaussian", "laplace")


# --- the problem: L2-regularised logistic regression split over nodes --------------------------------
@dataclass
class Problem:
    """Node i holds rows a[i] [n, d] with labels b[i] ∈ {0, 1}; fᵢ(x) = mean log-loss + (lam/2)‖x‖²."""
    a: torch.Tensor
    b: torch.Tensor
    lam: float

    @property
    def nodes(self) -> int:
        return self.a.shape[0]

    @property
    def dim(self) -> int:
        return self.a.shape[2]


def split_problem(x: np.ndarray, y: np.ndarray, nodes: int, lam: float, seed: int = 0) -> Problem:
    """Standardise x, add a bias column, shuffle and deal the rows evenly to `nodes` nodes (remainder dropped)."""
    nodes = check_positive_int("nodes", nodes, 2)
    if not lam > 0:
        raise ValueError(f"lam (L2 strength) must be > 0 so the problem is strongly convex, got {lam}")
    if not np.isin(np.unique(y), (0, 1)).all():
        raise ValueError("labels y must be 0/1 for logistic regression; map a multiclass label, e.g. y = (y % 2)")
    x = (x - x.mean(0)) / (x.std(0) + 1e-12)
    x = np.hstack([x, np.ones((len(x), 1))])
    order = np.random.default_rng(seed).permutation(len(x))
    per = len(x) // nodes
    if per < 1:
        raise ValueError(f"{len(x)} rows cannot be split over {nodes} nodes; use fewer nodes")
    keep = order[: per * nodes]
    a = torch.tensor(x[keep], dtype=DTYPE).reshape(nodes, per, -1)
    b = torch.tensor(np.asarray(y)[keep], dtype=DTYPE).reshape(nodes, per)
    return Problem(a, b, float(lam))


def local_gradients(p: Problem, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """∇fᵢ(xᵢ) for x [R, m, d]; with rows [R, m, B] (indices) the minibatch gradient on those rows."""
    if rows is None:
        a = p.a.expand(x.shape[0], *p.a.shape)
        b = p.b.expand(x.shape[0], *p.b.shape)
    else:
        node = torch.arange(p.nodes)[None, :, None]
        a, b = p.a[node, rows], p.b[node, rows]
    resid = torch.sigmoid(torch.einsum("rmnd,rmd->rmn", a, x)) - b
    return torch.einsum("rmnd,rmn->rmd", a, resid) / a.shape[2] + p.lam * x


def optimum(p: Problem, iters: int = 50) -> torch.Tensor:
    """x* of (1/m) Σᵢ fᵢ by Newton's method in float64 (the problem is strongly convex)."""
    a, b = p.a.reshape(-1, p.dim), p.b.reshape(-1)
    x = torch.zeros(p.dim, dtype=DTYPE)
    for _ in range(iters):
        s = torch.sigmoid(a @ x)
        grad = a.T @ (s - b) / len(b) + p.lam * x
        hess = (a.T * (s * (1 - s))) @ a / len(b) + p.lam * torch.eye(p.dim, dtype=DTYPE)
        x = x - torch.linalg.solve(hess, grad)
    return x


# --- the inexact channel ------------------------------------------------------------------------------
def noisy_mix(w: torch.Tensor, u: torch.Tensor, channel: str, sigma: float, g: torch.Generator | None):
    """Σⱼ wᵢⱼ ũᵢⱼ with ũᵢⱼ = uⱼ + ξᵢⱼ for j ≠ i (a node knows its own value exactly), ξ i.i.d. with std σ.
    The sum of independent link noises is drawn in one go: Σ_{j≠i} wᵢⱼ ξᵢⱼ has std σ·(Σ_{j≠i} wᵢⱼ²)^½
    (exact for Gaussian links; for Laplace links it matches the variance, a flagged approximation)."""
    exact = mix(w, u.transpose(0, 1)).transpose(0, 1)  # gossip.mix works on node-major rows
    if channel == "exact" or sigma == 0:
        return exact
    scale = sigma * ((w ** 2).sum(1) - torch.diagonal(w) ** 2).sqrt()[None, :, None]
    if channel == "gaussian":
        z = torch.randn(u.shape, generator=g, dtype=DTYPE)
    else:  # laplace with unit variance
        uni = torch.rand(u.shape, generator=g, dtype=DTYPE) - 0.5
        z = -torch.sign(uni) * torch.log1p(-2 * uni.abs()) / 2 ** 0.5
    return exact + scale * z


def _schedule(value, k: int) -> float:
    return float(value(k)) if callable(value) else float(value)


def _check(w, channel, sigma, steps, runs, batch, p):
    w = check_mixing(w)
    if w.shape[0] != p.nodes:
        raise ValueError(f"W is {w.shape[0]}×{w.shape[0]} but the problem has {p.nodes} nodes; build W for {p.nodes}")
    if channel not in CHANNELS:
        raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
    if sigma < 0:
        raise ValueError(f"sigma (link-noise std) must be >= 0, got {sigma}")
    if batch is not None and not 1 <= batch <= p.a.shape[1]:
        raise ValueError(f"batch must be in [1, {p.a.shape[1]}] (rows per node), got {batch}; None = full gradients")
    return torch.as_tensor(w, dtype=DTYPE), check_positive_int("steps", steps), check_positive_int("runs", runs)


# --- the algorithm ------------------------------------------------------------------------------------
@register("vra_dgt", claims="vra_dgt", kind="module")
def gradient_tracking(p: Problem, w, steps: int, alpha, gamma=1.0, *, channel: str = "exact",
                      sigma: float = 0.0, runs: int = 1, seed: int = 0, batch: int | None = None,
                      x_star: torch.Tensor | None = None, record_every: int = 1, x0: torch.Tensor | None = None):
    """Run (noise-suppressed) gradient tracking for `steps` iterations, R = `runs` independent runs at once.

    alpha, gamma: numbers or functions k ↦ value (k = 0, 1, ...). gamma ≡ 1 with channel="exact" is DGT.
    batch: None = full local gradients (VRA-DGT); an int = minibatch of that size per node with the
    STORM-type hybrid estimator (VRA-DSGT). Returns a dict of per-record tensors:
    k [T], mse [R, T] = (1/m)Σᵢ‖xᵢ − x*‖², track [R, T] = ‖Σᵢ yᵢ − Σᵢ dᵢ‖² / d, consensus [R, T];
    plus the final x, y.
    """
    w, steps, runs = _check(w, channel, sigma, steps, runs, batch, p)
    g = torch.Generator().manual_seed(int(seed))
    x = torch.zeros(runs, p.nodes, p.dim, dtype=DTYPE) if x0 is None else x0.clone().to(DTYPE)
    rows_of = (lambda: torch.randint(p.a.shape[1], (runs, p.nodes, batch), generator=g)) if batch else (lambda: None)
    d = local_gradients(p, x, rows_of())
    y = d.clone()
    x_star = optimum(p) if x_star is None else x_star
    out = {"k": [], "mse": [], "track": [], "consensus": []}
    for k in range(steps):
        if k % record_every == 0:
            _record(out, k, x, y, d, x_star)
        a_k, g_k = _schedule(alpha, k), _schedule(gamma, k)
        mixed_x = noisy_mix(w, x, channel, sigma, g)
        mixed_y = noisy_mix(w, y, channel, sigma, g)
        # γ = 1 is the DGT step W̃x exactly (no 1·x − 1·x round-off)
        x_new = (mixed_x if g_k == 1.0 else x + g_k * (mixed_x - x)) - a_k * y
        d_new = _estimate(p, x, x_new, d, g_k, rows_of())
        y = (mixed_y if g_k == 1.0 else y + g_k * (mixed_y - y)) + d_new - d
        x, d = x_new, d_new
    _record(out, steps, x, y, d, x_star)
    res = {key: torch.tensor(v) if key == "k" else torch.stack(v, 1) for key, v in out.items()}
    res.update(x=x, y=y)
    return res


def _estimate(p, x_old, x_new, d_old, g_k, rows):
    """Full gradient, or the STORM-type estimator on one fresh minibatch at both points (VRA-DSGT)."""
    if rows is None:
        return local_gradients(p, x_new)
    return local_gradients(p, x_new, rows) + (1 - g_k) * (d_old - local_gradients(p, x_old, rows))


def _record(out, k, x, y, d, x_star):
    out["k"].append(k)
    out["mse"].append((x - x_star).pow(2).sum(2).mean(1))
    out["track"].append((y.sum(1) - d.sum(1)).pow(2).mean(1))
    out["consensus"].append((x - x.mean(1, keepdim=True)).pow(2).sum(2).mean(1))


def harmonic(c: float, b: float, power: float = 1.0):
    """k ↦ c / (k + b)^power: the decaying step / suppression sequence."""
    if not c > 0 or not b > 0:
        raise ValueError(f"harmonic(c, b) needs c > 0 and b > 0, got c={c}, b={b}")
    return lambda k: c / (k + b) ** power


def loglog_slope(k, values, k_min: float, k_max: float) -> float:
    """Least-squares slope of log(values) against log(k) on k ∈ [k_min, k_max] (values [T] or mean of [R, T])."""
    k = torch.as_tensor(k, dtype=DTYPE)
    v = torch.as_tensor(values, dtype=DTYPE)
    keep = (k >= k_min) & (k <= k_max) & (v > 0)
    if keep.sum() < 3:
        raise ValueError(f"fewer than 3 recorded points in k ∈ [{k_min}, {k_max}]; widen the window or record more often")
    return utils_loglog_slope(k[keep], v[keep])
