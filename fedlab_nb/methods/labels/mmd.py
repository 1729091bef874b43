"""Maximum mean discrepancy (MMD) with Gaussian kernels, differentiable in torch.

For samples X = {x_i}_{i≤n} ~ P and Y = {y_j}_{j≤m} ~ Q and a kernel k, the unbiased estimator of
MMD²(P, Q) = E k(x, x') + E k(y, y') − 2 E k(x, y) (Gretton, Borgwardt, Rasch, Schölkopf, Smola, "A Kernel
Two-Sample Test", JMLR 2012, Eq. 3) is

    MMD²_u = 1/(n(n−1)) Σ_{i≠i'} k(x_i, x_i') + 1/(m(m−1)) Σ_{j≠j'} k(y_j, y_j') − 2/(nm) Σ_{i,j} k(x_i, y_j).

The multi-kernel version (MK-MMD, Long, Cao, Wang, Jordan, "Learning Transferable Features with Deep
Adaptation Networks", ICML 2015) averages Gaussian kernels k_σ(a, b) = exp(−‖a − b‖² / (2σ²)) over several
bandwidths; here σ = s · (median pairwise distance of the pooled sample), s ∈ `scales` (default {0.5, 1, 2}).
The median is taken without gradient (a bandwidth, not a feature), which keeps MMD²_u exactly unbiased
(zero mean) when P = Q: the pooled sample is exchangeable, so every pair type has the same expected kernel.

`gaussian_mmd2_closed_form` gives MMD² between two isotropic Gaussians for a fixed bandwidth (the unit test's
reference). FedKA (`fedlab_nb.methods.labels.fedka`) uses `mk_mmd2` to match client features to target embeddings.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

DEFAULT_SCALES = (0.5, 1.0, 2.0)


def _check_samples(x: torch.Tensor, y: torch.Tensor) -> None:
    if not (torch.is_tensor(x) and torch.is_tensor(y)) or x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"x and y must be 2-d tensors [n, d] and [m, d], got {getattr(x, 'shape', x)} and "
                         f"{getattr(y, 'shape', y)}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same feature width, got {x.shape[1]} and {y.shape[1]}")
    if len(x) < 2 or len(y) < 2:
        raise ValueError(f"the unbiased MMD² needs at least 2 rows in each sample, got {len(x)} and {len(y)}")


def median_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The median Euclidean distance between distinct rows of the pooled sample [x; y] (no gradient)."""
    z = torch.cat([x, y]).detach()
    d = torch.cdist(z, z)
    off = ~torch.eye(len(z), dtype=torch.bool, device=z.device)
    return d[off].median()


def _sigmas(x, y, sigmas, scales) -> torch.Tensor:
    if sigmas is not None:
        s = torch.as_tensor(sigmas, dtype=x.dtype, device=x.device).reshape(-1)
        if len(s) == 0 or not bool((s > 0).all()):
            raise ValueError(f"sigmas must be positive bandwidths, got {sigmas!r}")
        return s
    sc = torch.as_tensor(scales, dtype=x.dtype, device=x.device).reshape(-1)
    if len(sc) == 0 or not bool((sc > 0).all()):
        raise ValueError(f"scales must be positive multiples of the median distance, e.g. (0.5, 1, 2), got {scales!r}")
    med = median_distance(x, y)
    return sc * med.clamp_min(torch.finfo(x.dtype).eps)  # identical points: a tiny bandwidth, not 0/0


def mk_mmd2(x: torch.Tensor, y: torch.Tensor, *, scales: Sequence[float] = DEFAULT_SCALES,
            sigmas: Sequence[float] | None = None, unbiased: bool = True) -> torch.Tensor:
    """MMD² between the rows of x [n, d] and y [m, d] with the mean of Gaussian kernels exp(−‖a−b‖²/(2σ²)).

    `sigmas`: fixed bandwidths; otherwise σ = scale × the median pairwise distance of [x; y] for each of
    `scales`. `unbiased=True`: the U-statistic MMD²_u (can be negative); False: the biased V-statistic
    (diagonals kept, ≥ 0). Differentiable in x and y (a scalar tensor)."""
    _check_samples(x, y)
    sig = _sigmas(x, y, sigmas, scales)
    n, m = len(x), len(y)
    z = torch.cat([x, y])
    d2 = (z[:, None, :] - z[None, :, :]).pow(2).sum(-1)  # exact zeros on the diagonal (cdist's are not)
    k = torch.exp(-d2[None] / (2 * sig[:, None, None] ** 2)).mean(0)
    kxx, kyy, kxy = k[:n, :n], k[n:, n:], k[:n, n:]
    if unbiased:
        return ((kxx.sum() - kxx.diagonal().sum()) / (n * (n - 1)) + (kyy.sum() - kyy.diagonal().sum()) / (m * (m - 1))
                - 2 * kxy.mean())
    return kxx.mean() + kyy.mean() - 2 * kxy.mean()


def gaussian_mmd2_closed_form(mu_p, std_p: float, mu_q, std_q: float, sigmas: Sequence[float]) -> float:
    """MMD² between N(μ_p, std_p² I) and N(μ_q, std_q² I) in d dimensions for the mean of Gaussian kernels
    with bandwidths `sigmas`: with a − b ~ N(δ, v I), E exp(−‖a−b‖²/(2σ²)) = (σ²/(σ²+v))^{d/2}
    · exp(−‖δ‖²/(2(σ²+v))), for the pairs (p, p) v = 2std_p², (q, q) v = 2std_q², (p, q) v = std_p² + std_q²."""
    mu_p, mu_q = torch.as_tensor(mu_p, dtype=torch.float64), torch.as_tensor(mu_q, dtype=torch.float64)
    if mu_p.shape != mu_q.shape or mu_p.ndim != 1:
        raise ValueError(f"mu_p and mu_q must be 1-d means of the same length, got {tuple(mu_p.shape)}, {tuple(mu_q.shape)}")
    if not (std_p > 0 and std_q > 0) or len(sigmas) == 0 or min(sigmas) <= 0:
        raise ValueError("std_p, std_q and every bandwidth in sigmas must be > 0")
    d, delta2 = mu_p.numel(), float((mu_p - mu_q).pow(2).sum())

    def expected_kernel(var, dist2, s):
        return (s ** 2 / (s ** 2 + var)) ** (d / 2) * math.exp(-dist2 / (2 * (s ** 2 + var)))

    vals = [expected_kernel(2 * std_p ** 2, 0.0, s) + expected_kernel(2 * std_q ** 2, 0.0, s)
            - 2 * expected_kernel(std_p ** 2 + std_q ** 2, delta2, s) for s in sigmas]
    return float(sum(vals) / len(vals))
