"""AFL — Zhuang, He, Tong, Fang, Sun, Li, Chen, Zeng, "Analytic Federated Learning", arXiv 2405.16240 (2024).
Official code: https://github.com/ZHUANGHP/Analytic-federated-learning

A frozen backbone maps inputs to features X_k; the head is a linear map W (features → one-hot labels Y_k)
found in closed form, so there is nothing to iterate:

    client k  (one pass over its data):  C_k = X_kᵀX_k + γI,   W_k = C_k⁻¹ X_kᵀY_k        (upload W_k, C_k)
    server, AA law (two clients u, v):   W = (I − R_u C_v + R_u C_v (C_u + C_v)⁻¹ C_v) W_u
                                           + (I − R_v C_u + R_v C_u (C_u + C_v)⁻¹ C_u) W_v,   C = C_u + C_v
                                         (R = C⁻¹), folded over the K clients one at a time
    regularisation removal (RI):         W* = W + Kγ (C − KγI)⁻¹ W   = (XᵀX)⁻¹ XᵀY

The AA law is the ridge solution on the union of the two clients' data, so after K clients the merged
W solves the ridge problem with penalty Kγ; removing Kγ leaves the least-squares solution of the pooled
data: the same matrix however the rows were split among clients ("weight invariance"). γ only makes the
local inverses exist (a client with n_k < d has a singular X_kᵀX_k); it does not survive into W*.

Everything here is a small pure function on float64 tensors (float32 cannot reach 1e-6 agreement).
"""
from __future__ import annotations

import torch

from ...core.registry import register

DTYPE = torch.float64


# --- the frozen backbone -------------------------------------------------------------------------
def random_fourier_features(x: torch.Tensor, num_features: int, bandwidth: float = 3.0, seed: int = 0) -> torch.Tensor:
    """φ(x) = cos(x A · bandwidth/√D + b), A ~ N(0, 1), b ~ U(0, 2π), seeded: a frozen random backbone shared by
    every client (Rahimi & Recht's random features). Unlike random ReLU features, none is ever dead, so the
    pooled XᵀX is invertible and the least-squares head exists."""
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
        raise ValueError(f"num_features must be a positive integer, got {num_features!r}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    g = torch.Generator().manual_seed(int(seed))
    d = x.shape[1]
    a = torch.randn(d, num_features, generator=g, dtype=DTYPE).to(x.device)
    b = (2 * torch.pi * torch.rand(num_features, generator=g, dtype=DTYPE)).to(x.device)
    return torch.cos(x.to(DTYPE) @ a * (bandwidth / d ** 0.5) + b)


def one_hot(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(y.long(), num_classes).to(DTYPE)


def _check_xy(x: torch.Tensor, y: torch.Tensor):
    if x.ndim != 2:
        raise ValueError(f"features x must be a 2-D [n, d] tensor, got shape {tuple(x.shape)}")
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"labels y must be a 1-D tensor with one label per row of x ({len(x)}), "
                         f"got shape {tuple(y.shape)}")


def _check_gamma(gamma: float, allow_zero: bool = False):
    if not (gamma > 0 or (allow_zero and gamma == 0)):
        need = ">= 0" if allow_zero else "> 0 (it makes each client's C_k invertible)"
        raise ValueError(f"gamma must be {need}, got {gamma}")


def spd_solve(c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C⁻¹ B for a symmetric positive-definite C, by Cholesky (half the work of a general solve)."""
    chol, info = torch.linalg.cholesky_ex(c)
    if int(info.max()) > 0:
        raise ValueError("matrix is not positive definite: raise gamma, or give the pooled data more rows "
                         "than features (XᵀX must be invertible)")
    return torch.cholesky_solve(b, chol)


# --- sufficient statistics and the ridge solve ---------------------------------------------------
def local_statistics(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(G_k, Q_k) = (X_kᵀX_k, X_kᵀY_k) in float64: everything the closed form needs from a client."""
    _check_xy(x, y)
    x = x.to(DTYPE)
    return x.T @ x, x.T @ one_hot(y, num_classes)


def ridge_solve(gram: torch.Tensor, xty: torch.Tensor, gamma: float = 0.0) -> torch.Tensor:
    """W = (G + γI)⁻¹ Q (γ = 0: plain least squares; needs G to be invertible)."""
    _check_gamma(gamma, allow_zero=True)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + gamma * eye, xty)


def centralised_solution(x: torch.Tensor, y: torch.Tensor, num_classes: int, gamma: float = 0.0) -> torch.Tensor:
    """The reference: the ridge (γ > 0) or least-squares (γ = 0) head fitted on all the data in one place."""
    return ridge_solve(*local_statistics(x, y, num_classes), gamma)


# --- AFL: client, AA law, regularisation removal -------------------------------------------------
def local_solution(x: torch.Tensor, y: torch.Tensor, num_classes: int, gamma: float = 1.0):
    """Client k's one-epoch analytic training: (W_k, C_k) with C_k = X_kᵀX_k + γI, W_k = C_k⁻¹ X_kᵀY_k."""
    _check_gamma(gamma)
    gram, xty = local_statistics(x, y, num_classes)
    c = gram + gamma * torch.eye(gram.shape[0], dtype=DTYPE, device=gram.device)
    return spd_solve(c, xty), c


def aa_law(w_u: torch.Tensor, c_u: torch.Tensor, w_v: torch.Tensor, c_v: torch.Tensor):
    """Absolute aggregation of two (W, C) pairs: (C_u + C_v)⁻¹ (C_u W_u + C_v W_v), C_u + C_v.

    This is the paper's AA law written with one solve instead of four inverses: its coefficient of W_u,
    I − R_u C_v + R_u C_v (C_u + C_v)⁻¹ C_v, equals (C_u + C_v)⁻¹ C_u (multiply both by C_u); see
    `aa_law_paper_form` for the literal formula."""
    if c_u.shape != c_v.shape or w_u.shape != w_v.shape:
        raise ValueError(f"aa_law: shapes differ (W {tuple(w_u.shape)} vs {tuple(w_v.shape)}, "
                         f"C {tuple(c_u.shape)} vs {tuple(c_v.shape)}); all clients must share the backbone")
    c = c_u + c_v
    return spd_solve(c, c_u @ w_u + c_v @ w_v), c


def aa_law_paper_form(w_u, c_u, w_v, c_v):
    """The AA law exactly as written in the paper (with R = C⁻¹); slower and less accurate, for reading."""
    eye = torch.eye(c_u.shape[0], dtype=c_u.dtype, device=c_u.device)
    r_u, r_v, s = torch.linalg.inv(c_u), torch.linalg.inv(c_v), torch.linalg.inv(c_u + c_v)
    w = (eye - r_u @ c_v + r_u @ c_v @ s @ c_v) @ w_u + (eye - r_v @ c_u + r_v @ c_u @ s @ c_u) @ w_v
    return w, c_u + c_v


def aggregate(solutions) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the AA law over the clients' (W_k, C_k): a single round, in any order."""
    solutions = list(solutions)
    if not solutions:
        raise ValueError("aggregate needs at least one client's (W_k, C_k)")
    w, c = solutions[0]
    for w_k, c_k in solutions[1:]:
        w, c = aa_law(w, c, w_k, c_k)
    return w, c


def remove_regularisation(w: torch.Tensor, c: torch.Tensor, total_gamma: float) -> torch.Tensor:
    """RI step: W + Kγ (C − KγI)⁻¹ W, which turns the Kγ-ridge solution into the least-squares one
    (C − KγI = XᵀX must be invertible, i.e. the pooled data have at least d independent feature rows)."""
    _check_gamma(total_gamma, allow_zero=True)
    eye = torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
    return w + total_gamma * spd_solve(c - total_gamma * eye, w)


@register("afl", claims="afl", kind="module")
def afl(client_data, num_classes: int, gamma: float = 1.0) -> torch.Tensor:
    """The whole method: local analytic solutions → AA law → regularisation removal. `client_data` is a
    list of (features, labels); clients with no rows still count (they upload C_k = γI, W_k = 0)."""
    solutions = [local_solution(x, y, num_classes, gamma) for x, y in client_data]
    w, c = aggregate(solutions)
    return remove_regularisation(w, c, gamma * len(solutions))


def afl_from_statistics(client_data, num_classes: int) -> torch.Tensor:
    """The equivalent sufficient-statistics form: W = (Σ_k G_k)⁻¹ Σ_k Q_k (no γ needed at all)."""
    stats = [local_statistics(x, y, num_classes) for x, y in client_data]
    return ridge_solve(sum(g for g, _ in stats), sum(q for _, q in stats))


# --- the baseline AFL is compared with -----------------------------------------------------------
def one_shot_average(solutions, sizes) -> torch.Tensor:
    """Σ_k (n_k / N) W_k: averaging the local ridge heads once, as FedAvg would (not weight-invariant)."""
    sizes = torch.as_tensor(sizes, dtype=DTYPE)
    if sizes.sum() <= 0 or (sizes < 0).any():
        raise ValueError("sizes must be non-negative client sizes with a positive sum")
    ws = torch.stack([w for w, _ in solutions])
    return torch.einsum("k,kdc->dc", sizes.to(ws.device) / sizes.sum(), ws)


def accuracy(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy of the linear head W on features x."""
    return float(((x.to(w.dtype) @ w).argmax(1) == y.to(w.device)).double().mean())
