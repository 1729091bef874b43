"""Combining sub-posteriors into their product: the Gaussian product, Consensus Monte Carlo, flat importance
sampling and a divide-and-conquer tree-SMC **analogue** of Fusion (it is not Fusion).

Paper: Ryan S.Y. Chan, Murray Pollock, Adam M. Johansen, Gareth O. Roberts, "Divide-and-Conquer Fusion", JMLR
2023 (arXiv 2110.07265, "Divide-and-Conquer Monte Carlo Fusion", https://arxiv.org/abs/2110.07265); code: the R
package DCFusion, https://github.com/rchan26/DCFusion (formerly hierarchicalFusion).

The target is f(θ) ∝ ∏_c f_c(θ), with sub-posteriors f_c ∝ p(θ)^{1/C} ∏_{i∈D_c} p(x_i | θ), so that the
product is the full-data posterior. Fusion samples it exactly by rejection / SMC on a path space of Brownian or
Ornstein-Uhlenbeck bridges, and divide-and-conquer Fusion fuses sub-posteriors in small groups up a tree. Here:

- `gaussian_product`: the exact product of Gaussian sub-posteriors (precision-weighted); with Laplace
  approximations of the f_c it is the "Gaussian product" baseline;
- `consensus_monte_carlo` (Scott et al., "Bayes and big data: the consensus Monte Carlo algorithm", 2016):
  precision-weighted averages of the parties' draws — exact for Gaussian sub-posteriors only;
- `flat_importance`: one party's draws, weighted by every other party's density;
- `tree_smc`: the analogue — fuse two groups at each node of a binary tree by importance weighting one child's
  particles with the other child's density, resampling and a few random-walk Metropolis moves on the node's
  product (resample-move SMC). It keeps each weight step between two groups of similar size, the statistical
  reason for the paper's tree, but it replaces the path-space construction and needs the parties to evaluate
  each other's sub-posterior densities (communication and privacy cost that Fusion avoids);
- `rwm`: a vectorised random-walk Metropolis sampler (numpy) for the parties' own draws and the reference.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ...core.registry import register


# --- exact and approximate products ----------------------------------------------------------------
def gaussian_product(means, covs) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of ∏_c N(μ_c, Σ_c) (normalised): Λ = Σ_c Σ_c⁻¹, μ = Λ⁻¹ Σ_c Σ_c⁻¹ μ_c (float64)."""
    mu, cov = np.asarray(means, dtype=np.float64), np.asarray(covs, dtype=np.float64)
    if mu.ndim != 2 or cov.shape != mu.shape + mu.shape[1:]:
        raise ValueError(f"means must be [C, d] and covs [C, d, d], got {mu.shape} and {cov.shape}")
    precisions = np.linalg.inv(cov)
    cov_out = np.linalg.inv(precisions.sum(0))
    return cov_out @ np.einsum("cij,cj->i", precisions, mu), cov_out


def consensus_monte_carlo(samples, precisions=None) -> np.ndarray:
    """Consensus Monte Carlo: θ_s = (Σ_c W_c)⁻¹ Σ_c W_c θ_{c,s} for party c's draws [C, n, d]; returns the n
    combined draws [n, d]. W_c: `precisions` [C, d, d] when known, else the inverse sample covariance of party
    c's draws (Scott et al.'s practical choice; its estimation noise biases the combined mean slightly)."""
    s = np.asarray(samples, dtype=np.float64)
    if s.ndim != 3 or s.shape[1] < s.shape[2] + 1:
        raise ValueError(f"samples must be [C, n, d] with n > d draws per party, got shape {s.shape}")
    if precisions is None:
        d = s.shape[2]
        weights = np.linalg.inv(np.stack([np.cov(c, rowvar=False).reshape(d, d) for c in s]))
    else:
        weights = np.asarray(precisions, dtype=np.float64)
        if weights.shape != (s.shape[0], s.shape[2], s.shape[2]):
            raise ValueError(f"precisions must be [C, d, d] = {(s.shape[0], s.shape[2], s.shape[2])}, got {weights.shape}")
    return np.linalg.solve(weights.sum(0), np.einsum("cij,cnj->ni", weights, s).T).T


# --- samplers --------------------------------------------------------------------------------------
def rwm(log_density: Callable[[np.ndarray], np.ndarray], x0, n: int, chol, rng: np.random.Generator,
        burn: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random-walk Metropolis for B independent chains at once: `log_density` maps [B, d] → [B], `chol` is a
    [B, d, d] (or [d, d]) Cholesky factor of each chain's proposal covariance. Returns the draws [B, n, d] after
    `burn` discarded steps, and each chain's acceptance rate."""
    x = np.array(x0, dtype=np.float64)
    if x.ndim != 2 or n < 1 or burn < 0:
        raise ValueError(f"x0 must be [B, d] starting points and n >= 1, burn >= 0; got {x.shape}, {n}, {burn}")
    chol = np.broadcast_to(np.asarray(chol, dtype=np.float64), (len(x), x.shape[1], x.shape[1]))
    lp, out, accepted = log_density(x), np.empty((len(x), n, x.shape[1])), np.zeros(len(x))
    for t in range(burn + n):
        y = x + np.einsum("bij,bj->bi", chol, rng.standard_normal(x.shape))
        lq = log_density(y)
        accept = np.log(rng.random(len(x))) < lq - lp
        x[accept], lp[accept] = y[accept], lq[accept]
        if t >= burn:
            out[:, t - burn], accepted = x, accepted + accept
    return out, accepted / n


def ess(log_weights) -> float:
    """Effective sample size (Σw)² / Σw² of unnormalised log-weights."""
    lw = np.asarray(log_weights, dtype=np.float64)
    w = np.exp(lw - lw.max())
    return float(w.sum() ** 2 / (w ** 2).sum())


def _resample(log_weights: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Systematic resampling: n indices drawn in proportion to exp(log_weights)."""
    w = np.exp(log_weights - log_weights.max())
    cum = np.cumsum(w / w.sum())
    return np.minimum(np.searchsorted(cum, (rng.random() + np.arange(n)) / n), len(w) - 1)


def flat_importance(proposal_draws: np.ndarray, log_others: Callable[[np.ndarray], np.ndarray]) -> tuple:
    """Flat importance sampling: party 1's draws θ ~ f_1 weighted by ∏_{c≥2} f_c(θ) (`log_others`). Returns
    (draws, log-weights); the target ∏_c f_c is f_1 × the weight, so no normaliser is needed."""
    return proposal_draws, log_others(proposal_draws)


# --- the tree-SMC analogue -------------------------------------------------------------------------
@register("smc_fusion", claims="smc_fusion", kind="module")
def tree_smc(leaf_draws: Sequence[np.ndarray], log_group: Callable[[tuple, np.ndarray], np.ndarray],
             rng: np.random.Generator, n_moves: int = 5, n_particles: int | None = None,
             ess_fraction: float = 0.5) -> tuple[np.ndarray, list]:
    """Fuse C sub-posteriors up a binary tree (a divide-and-conquer SMC analogue of Fusion, not Fusion).

    `leaf_draws[c]`: party c's draws from f_c [n_c, d]. `log_group(leaves, θ)`: Σ_{c∈leaves} log f_c(θ) for
    θ [n, d] (the density of a group of parties). A node with children a, b starts from a's particles
    (θ ~ f_a) and moves them to f_a f_b through tempered targets f_a f_b^β, β: 0 → 1, each β chosen so that the
    incremental weights f_b^{Δβ} keep an ESS of `ess_fraction` × n (adaptive tempering), followed by systematic
    resampling to `n_particles` and `n_moves` random-walk Metropolis steps on f_a f_b^β (resample-move SMC).
    Returns the root particles and, per node, a dict: level, leaves, `ess_direct` (the ESS fraction of the
    one-step weights f_b, as flat importance sampling would use them) and `steps` (tempering steps)."""
    if len(leaf_draws) < 1 or n_moves < 0 or not 0 < ess_fraction < 1:
        raise ValueError("need at least one sub-posterior, n_moves >= 0 and 0 < ess_fraction < 1, got "
                         f"{len(leaf_draws)}, {n_moves}, {ess_fraction}")
    n = n_particles or min(len(d) for d in leaf_draws)
    nodes = [((c,), np.asarray(d, dtype=np.float64)) for c, d in enumerate(leaf_draws)]
    log, level = [], 0
    while len(nodes) > 1:
        level += 1
        merged = []
        for i in range(0, len(nodes) - 1, 2):
            (la, xa), (lb, _) = nodes[i], nodes[i + 1]
            x, steps, direct = _fuse_pair(xa, la, lb, log_group, n, n_moves, ess_fraction, rng)
            log.append({"level": level, "leaves": la + lb, "ess_direct": direct, "steps": steps})
            merged.append((la + lb, x))
        if len(nodes) % 2:  # an odd group out waits for the next level
            merged.append(nodes[-1])
        nodes = merged
    return nodes[0][1], log


def _fuse_pair(x, la, lb, log_group, n, n_moves, ess_fraction, rng):
    """One node: tempered resample-move from f_a (particles x) to f_a f_b."""
    beta, steps, lb_x = 0.0, 0, log_group(lb, x)
    direct = ess(lb_x) / len(x)
    while beta < 1:
        step = _next_increment(lb_x, 1 - beta, ess_fraction * len(x))
        idx = _resample(step * lb_x, n, rng)
        beta, steps = (1.0 if step >= 1 - beta - 1e-12 else beta + step), steps + 1
        x = _move(x[idx], lambda t, b=beta: log_group(la, t) + b * log_group(lb, t), n_moves, rng)
        lb_x = log_group(lb, x)
    return x, steps, direct


def _next_increment(log_fb: np.ndarray, room: float, target_ess: float) -> float:
    """The largest Δβ <= room whose weights exp(Δβ log f_b) keep ESS >= target_ess (bisection)."""
    if ess(room * log_fb) >= target_ess:
        return room
    lo, hi = 0.0, room
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ess(mid * log_fb) >= target_ess else (lo, mid)
    return max(lo, 1e-6 * room)


def _move(x: np.ndarray, log_target: Callable, n_moves: int, rng: np.random.Generator) -> np.ndarray:
    """`n_moves` random-walk Metropolis steps for every particle, invariant for `log_target`; the proposal is
    2.38²/d × the particles' covariance (the usual adaptive choice in SMC samplers)."""
    if n_moves == 0:
        return x
    d = x.shape[1]
    chol = np.linalg.cholesky(np.atleast_2d(np.cov(x, rowvar=False)) * 2.38 ** 2 / d + 1e-12 * np.eye(d))
    draws, _ = rwm(log_target, x, 1, chol, rng, burn=n_moves - 1)
    return draws[:, -1]


# --- diagnostics -----------------------------------------------------------------------------------
def split_rhat(chains) -> np.ndarray:
    """Split-R̂ (Gelman et al., BDA3 §11.4) of each coordinate from chains [m, n, d]: near 1 when they agree."""
    c = np.asarray(chains, dtype=np.float64)
    half = c.shape[1] // 2
    s = np.concatenate([c[:, :half], c[:, half:2 * half]])
    within = s.var(1, ddof=1).mean(0)
    between = half * s.mean(1).var(0, ddof=1)
    return np.sqrt(((half - 1) / half * within + between / half) / within)


def marginal_w1(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over coordinates of the 1-Wasserstein distance between the marginals of draws a and b."""
    from scipy.stats import wasserstein_distance
    a, b = np.atleast_2d(np.asarray(a).T).T, np.atleast_2d(np.asarray(b).T).T
    return float(np.mean([wasserstein_distance(a[:, j], b[:, j]) for j in range(a.shape[1])]))
