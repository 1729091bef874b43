"""Distributed mixtures by reduction — Chamroukhi & Pham, "Distributed Learning of Mixtures of Experts",
arXiv 2312.09877 (v1 2023; v2 2026 retitled "Optimal Transport Aggregation for Distributed Mixture-of-Experts").
Official Matlab code: https://github.com/nhat-thien/Distributed-Mixture-Of-Experts. The Gaussian-mixture
predecessor: Zhang & Chen, "Distributed Learning of Finite Gaussian Mixtures", JMLR 23 (2022).

M machines each fit a K-component mixture to their own data. The server stacks the M·K local components,
each weighted by n_m/N, into a *large mixture*, and reduces it to K components by minimising a transportation
divergence: every large component sends its mass to the reduced component it is cheapest to move to
(cost = KL(local component ‖ reduced component)), and every reduced component is the KL barycenter of the
mass it receives. Alternating the two steps is a majorisation–minimisation (MM) algorithm: both steps lower
the same objective, so it never increases.

    Gaussian mixtures:  assign i → k = argmin_k KL(N_i ‖ N_k);   N_k = moment match of {w_i N_i : i → k}
                        μ = Σw_iμ_i / Σw_i,   Σ = Σw_i(Σ_i + (μ_i − μ)(μ_i − μ)ᵀ) / Σw_i,   π_k = Σ_{i→k} w_i
    MoE (linear Gaussian experts, softmax gate), on a server sample x_1..x_S (official code):
        mass of local component l=(m,k) at x_s:  w_m · π_{mk}(x_s)
        plan:     l → argmin_k KL(N(x_sᵀβ_l, σ_l²) ‖ N(x_sᵀβ_k, σ_k²)), separately at every x_s
        experts:  β_k = weighted least squares of the transported means x_sᵀβ_l on x_s;
                  σ_k² = Σ plan·(σ_l² + (x_sᵀ(β_k − β_l))²) / Σ plan          (exact minimiser of the cost)
        gate:     after convergence, refit by IRLS to the posterior of the server sample under the reduced
                  experts with prior = the transported mass at each x_s (as the official code does).

Why not average parameters coordinate-wise (FedAvg)? Components are exchangeable: machine m may call its
"first" component what machine m' calls its third, so the average mixes unrelated components (label switching).
The reduction matches components instead, and is invariant to how each machine orders them.

Differences from the official code, on purpose: the MM starts from each machine's own local estimate in turn
(M starts, the lowest transport cost kept) instead of k-means of the experts — an order-invariant start, so
permuting local components provably cannot change the result; σ_k² is the exact minimiser of the transported KL
(the official `argmin_mixture` uses a different quadratic term); local and global EM are our own numpy code
(GMMs: scikit-learn's GaussianMixture).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
from sklearn.cluster import KMeans
from sklearn.mixture import GaussianMixture

from ...core.registry import register


# --- Gaussian mixtures --------------------------------------------------------------------------------
@dataclass
class GMM:
    """weights [K], means [K, d], covariances [K, d, d] (float64)."""
    weights: np.ndarray
    means: np.ndarray
    covs: np.ndarray

    def permuted(self, order) -> "GMM":
        order = np.asarray(order)
        return GMM(self.weights[order], self.means[order], self.covs[order])


def _check_weights(w) -> np.ndarray:
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or not w.sum() > 0:
        raise ValueError(f"weights must be a non-empty 1-D array of non-negative numbers with a positive sum, "
                         f"got shape {w.shape}")
    return w


def moment_match(weights, means, covs) -> tuple[np.ndarray, np.ndarray]:
    """The Gaussian N(μ, Σ) minimising Σ_i w_i KL(N(μ_i, Σ_i) ‖ N(μ, Σ)): the weighted mean and the weighted
    within + between covariance."""
    w = _check_weights(weights)
    means, covs = np.asarray(means, np.float64), np.asarray(covs, np.float64)
    w = w / w.sum()
    mu = w @ means
    dev = means - mu
    cov = np.einsum("i,ijk->jk", w, covs) + np.einsum("i,ij,ik->jk", w, dev, dev)
    return mu, cov


def gaussian_kl(mu0, cov0, mu1, cov1) -> np.ndarray:
    """KL(N(μ0, Σ0) ‖ N(μ1, Σ1)), broadcast over leading axes."""
    d = mu0.shape[-1]
    inv1 = np.linalg.inv(cov1)
    diff = mu1 - mu0
    trace = np.einsum("...ij,...ji->...", inv1, cov0)
    maha = np.einsum("...i,...ij,...j->...", diff, inv1, diff)
    logdet = np.linalg.slogdet(cov1)[1] - np.linalg.slogdet(cov0)[1]
    return 0.5 * (trace + maha - d + logdet)


def weighted_kl(weights, means, covs, mu, cov) -> float:
    """Σ_i w_i KL(N_i ‖ N(μ, Σ)) / Σ w_i (the barycenter objective)."""
    w = _check_weights(weights)
    return float(w @ gaussian_kl(np.asarray(means), np.asarray(covs), mu, cov) / w.sum())


def large_mixture(locals_: list[GMM], sizes) -> GMM:
    """Stack the M local mixtures into one M·K mixture, machine m's weights scaled by n_m/N."""
    sizes = _check_weights(sizes)
    if len(locals_) != len(sizes):
        raise ValueError(f"need one size per local mixture, got {len(locals_)} mixtures and {len(sizes)} sizes")
    share = sizes / sizes.sum()
    return GMM(np.concatenate([s * g.weights for s, g in zip(share, locals_)]),
               np.concatenate([g.means for g in locals_]), np.concatenate([g.covs for g in locals_]))


def canonical(g: GMM) -> GMM:
    """Components sorted by their mean's coordinates (a fixed labelling for comparisons)."""
    return g.permuted(np.lexsort(g.means.T[::-1]))


def _transport_cost(big: GMM, red: GMM) -> np.ndarray:
    """[L, K]: KL(large component i ‖ reduced component k)."""
    return gaussian_kl(big.means[:, None], big.covs[:, None], red.means[None], red.covs[None])


def _barycenters(big: GMM, assign: np.ndarray, red: GMM) -> GMM:
    """Each reduced component = the moment match of the mass assigned to it (kept in place if it got none)."""
    weights, means, covs = np.zeros(len(red.weights)), red.means.copy(), red.covs.copy()
    for k in range(len(red.weights)):
        mine = assign == k
        if mine.any():
            weights[k] = big.weights[mine].sum()
            means[k], covs[k] = moment_match(big.weights[mine], big.means[mine], big.covs[mine])
    return GMM(weights, means, covs)


def _reduce_from(big: GMM, start: GMM, max_iter: int, tol: float) -> tuple[GMM, float, list[float]]:
    """MM from one start: plan (each large component to its KL-nearest reduced one), then barycenters."""
    red, costs = start, []
    for _ in range(max_iter):
        cost = _transport_cost(big, red)
        assign = cost.argmin(1)
        costs.append(float(big.weights @ cost[np.arange(len(assign)), assign]))
        red = _barycenters(big, assign, red)
        if len(costs) > 1 and costs[-2] - costs[-1] <= tol * max(abs(costs[-2]), 1e-300):
            break
    costs.append(float(big.weights @ _transport_cost(big, red).min(1)))
    return red, costs[-1], costs


@register("moe_reduction", claims="moe_reduction", kind="module")
def reduce_gmm(locals_: list[GMM], sizes, max_iter: int = 100, tol: float = 1e-12) -> tuple[GMM, dict]:
    """The reduction estimator of M local K-component GMMs: MM on the transportation divergence (KL cost),
    started from each local estimate in turn, the lowest final cost kept. Returns (reduced GMM in canonical
    order, {"cost", "costs" (the best run's objective per iteration), "seconds"})."""
    if not locals_:
        raise ValueError("reduce_gmm: locals_ must hold at least one local GMM")
    K = len(locals_[0].weights)
    if any(len(g.weights) != K for g in locals_):
        raise ValueError("reduce_gmm: every local GMM must have the same number of components K")
    t0 = time.process_time()
    big = large_mixture(locals_, sizes)
    best = None
    for start in locals_:
        red, cost, costs = _reduce_from(big, start, max_iter, tol)
        if best is None or cost < best[1] - 1e-12:
            best = (red, cost, costs)
    red, cost, costs = best
    return canonical(red), {"cost": cost, "costs": costs, "seconds": time.process_time() - t0}


def naive_average(locals_: list[GMM], sizes) -> GMM:
    """FedAvg of the parameters, component i with component i in each machine's own order."""
    w = _check_weights(sizes)
    w = w / w.sum()
    avg = lambda a: np.einsum("m,m...->...", w, np.stack(a))
    weights = avg([g.weights for g in locals_])
    return GMM(weights / weights.sum(), avg([g.means for g in locals_]), avg([g.covs for g in locals_]))


def fit_gmm(x: np.ndarray, K: int, seed: int, n_init: int = 3) -> tuple[GMM, float]:
    """scikit-learn EM (full covariances, k-means starts, tol 1e-6: the default 1e-3 stops EM well before the
    maximum-likelihood point); returns (GMM, CPU seconds)."""
    t0 = time.process_time()
    gm = GaussianMixture(K, covariance_type="full", n_init=n_init, random_state=seed, tol=1e-6, max_iter=2000).fit(x)
    return GMM(gm.weights_.astype(np.float64), gm.means_.astype(np.float64), gm.covariances_.astype(np.float64)), \
        time.process_time() - t0


def sample_gmm(g: GMM, n: int, rng: np.random.Generator) -> np.ndarray:
    z = rng.choice(len(g.weights), size=n, p=g.weights)
    chol = np.linalg.cholesky(g.covs)
    return g.means[z] + np.einsum("nij,nj->ni", chol[z], rng.standard_normal((n, g.means.shape[1])))


def gmm_error(est: GMM, truth: GMM) -> float:
    """Parameter error after the best matching of components to the truth:
    √(Σ_k ‖μ̂−μ‖² + ‖Σ̂−Σ‖_F² + (π̂−π)²), minimised over the K! permutations."""
    K = len(truth.weights)
    def err(order):
        e = est.permuted(order)
        return np.sqrt(np.sum((e.means - truth.means) ** 2) + np.sum((e.covs - truth.covs) ** 2)
                       + np.sum((e.weights - truth.weights) ** 2))
    return float(min(err(p) for p in itertools.permutations(range(K))))


def distributed_gmm(x: np.ndarray, K: int, M: int, seed: int, n_init: int = 3) -> dict:
    """Split x into M equal random parts, fit each, reduce; also naive averaging. Times are CPU seconds;
    the parallel-equivalent time is max_m t_m + t_reduce."""
    rng = np.random.default_rng(seed)
    parts = np.array_split(rng.permutation(len(x)), M)
    fits = [fit_gmm(x[p], K, seed + 1 + m, n_init) for m, p in enumerate(parts)]
    locals_ = [f[0] for f in fits]
    sizes = [len(p) for p in parts]
    red, info = reduce_gmm(locals_, sizes)
    return {"locals": locals_, "sizes": sizes, "reduction": red, "naive": naive_average(locals_, sizes),
            "local_seconds": [f[1] for f in fits], "reduce_seconds": info["seconds"],
            "parallel_seconds": max(f[1] for f in fits) + info["seconds"], "cost": info["cost"]}


# --- mixtures of experts: 1-D linear Gaussian experts, softmax gate -------------------------------------
@dataclass
class MoE:
    """gates [d+1, K] (last column 0), experts [d+1, K] (row 0 = intercept), variances [K]."""
    gates: np.ndarray
    experts: np.ndarray
    variances: np.ndarray

    def permuted(self, order) -> "MoE":
        order = np.asarray(order)
        g = self.gates[:, order]
        return MoE(g - g[:, -1:], self.experts[:, order], self.variances[order])


def design(x: np.ndarray) -> np.ndarray:
    """[n] or [n, d] inputs → [n, d+1] with an intercept column."""
    x = np.asarray(x, np.float64)
    x = x[:, None] if x.ndim == 1 else x
    return np.hstack([np.ones((len(x), 1)), x])


def softmax_rows(a: np.ndarray) -> np.ndarray:
    a = a - a.max(1, keepdims=True)
    e = np.exp(a)
    return e / e.sum(1, keepdims=True)


def gate_probs(moe: MoE, X: np.ndarray) -> np.ndarray:
    return softmax_rows(X @ moe.gates)


def log_component_densities(moe: MoE, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[n, K]: log π_k(x) + log N(y; xᵀβ_k, σ_k²)."""
    resid = y[:, None] - X @ moe.experts
    logn = -0.5 * (np.log(2 * np.pi * moe.variances) + resid ** 2 / moe.variances)
    return np.log(np.clip(gate_probs(moe, X), 1e-300, None)) + logn


def moe_loglik(moe: MoE, X: np.ndarray, y: np.ndarray) -> float:
    """Mean log-likelihood per point."""
    lp = log_component_densities(moe, X, y)
    top = lp.max(1, keepdims=True)
    return float(np.mean(top[:, 0] + np.log(np.exp(lp - top).sum(1))))


def moe_predict(moe: MoE, X: np.ndarray) -> np.ndarray:
    """E[y | x] = Σ_k π_k(x) xᵀβ_k."""
    return np.sum(gate_probs(moe, X) * (X @ moe.experts), 1)


def fit_gate(X: np.ndarray, targets: np.ndarray, gates: np.ndarray, weights=None, iters: int = 20,
             ridge: float = 1e-8) -> np.ndarray:
    """Multinomial logistic regression with soft targets by Newton/IRLS (last class = reference, its column 0).
    Parameters are handled class by class: block j of the vector is column j of the gate matrix."""
    n, p = X.shape
    K = targets.shape[1]
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    A = np.array(gates[:, :-1], dtype=np.float64)
    for _ in range(iters):
        P = softmax_rows(np.hstack([X @ A, np.zeros((n, 1))]))
        grad = (X.T @ (w[:, None] * (targets - P)))[:, :-1].T.reshape(-1)
        H = np.zeros(((K - 1) * p, (K - 1) * p))
        for j in range(K - 1):
            for l in range(K - 1):
                c = w * P[:, j] * ((j == l) - P[:, l])
                H[j * p:(j + 1) * p, l * p:(l + 1) * p] = (X * c[:, None]).T @ X
        step = np.linalg.solve(H + ridge * np.eye(len(grad)), grad)
        A = A + step.reshape(K - 1, p).T
        if np.max(np.abs(step)) < 1e-10:
            break
    return np.hstack([A, np.zeros((p, 1))])


def weighted_lstsq(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    Xw = X * w[:, None]
    return np.linalg.solve(X.T @ Xw + 1e-10 * np.eye(X.shape[1]), Xw.T @ y)


def _em(X, y, tau, max_iter: int, tol: float) -> tuple[MoE, float]:
    K = tau.shape[1]
    moe = MoE(np.zeros((X.shape[1], K)), np.zeros((X.shape[1], K)), np.ones(K))
    prev = -np.inf
    for _ in range(max_iter):
        Nk = tau.sum(0) + 1e-12
        experts = np.stack([weighted_lstsq(X, y, tau[:, k]) for k in range(K)], 1)
        var = np.maximum(np.sum(tau * (y[:, None] - X @ experts) ** 2, 0) / Nk, 1e-6)
        moe = MoE(fit_gate(X, tau, moe.gates, iters=5), experts, var)
        lp = log_component_densities(moe, X, y)
        top = lp.max(1, keepdims=True)
        norm = top + np.log(np.exp(lp - top).sum(1, keepdims=True))
        tau = np.exp(lp - norm)
        ll = float(norm.mean())
        if ll - prev < tol:
            break
        prev = ll
    return moe, ll


def fit_moe(x, y, K: int, seed: int, n_init: int = 3, max_iter: int = 300, tol: float = 1e-8) -> tuple[MoE, float]:
    """EM for a MoE with linear Gaussian experts and a softmax gate (E-step responsibilities; M-step weighted
    least squares, weighted variances, IRLS for the gate); n_init starts from k-means of (x, y); the highest
    log-likelihood kept. Returns (MoE, CPU seconds)."""
    t0 = time.process_time()
    X, y = design(x), np.asarray(y, np.float64)
    Z = np.hstack([X[:, 1:], y[:, None]])
    Z = (Z - Z.mean(0)) / Z.std(0)
    best = None
    for r in range(n_init):
        labels = KMeans(K, n_init=1, random_state=seed * 1000 + r).fit_predict(Z)
        tau = np.eye(K)[labels] * 0.9 + 0.1 / K
        moe, ll = _em(X, y, tau, max_iter, tol)
        if best is None or ll > best[1]:
            best = (moe, ll)
    return best[0], time.process_time() - t0


def expert_kl(big: MoE, red: MoE, X: np.ndarray) -> np.ndarray:
    """[L, K, S]: KL(N(x_sᵀβ_l, σ_l²) ‖ N(x_sᵀβ_k, σ_k²))."""
    m_big, m_red = X @ big.experts, X @ red.experts            # [S, L], [S, K]
    v_big, v_red = big.variances[:, None, None], red.variances[None, :, None]
    diff2 = (m_red.T[None, :, :] - m_big.T[:, None, :]) ** 2
    return 0.5 * (np.log(v_red / v_big) + v_big / v_red + diff2 / v_red - 1)


def local_masses(locals_: list[MoE], sizes, X: np.ndarray) -> np.ndarray:
    """[L, S]: w_m π_{mk}(x_s) for the large mixture's component l = (m, k)."""
    share = _check_weights(sizes) / np.sum(sizes)
    return np.concatenate([s * gate_probs(g, X).T for s, g in zip(share, locals_)])


def stack_experts(locals_: list[MoE]) -> MoE:
    """The large mixture's experts (its gates are the per-machine ones, see local_masses)."""
    return MoE(np.zeros((locals_[0].gates.shape[0], 1)), np.hstack([g.experts for g in locals_]),
               np.concatenate([g.variances for g in locals_]))


def transport_plan(big: MoE, mass: np.ndarray, red: MoE, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(plan [L, K, S], cost [L, K, S]): at each x_s, each local expert's mass goes to its KL-nearest reduced expert."""
    cost = expert_kl(big, red, X)
    plan = mass[:, None, :] * (cost.argmin(1)[:, None, :] == np.arange(cost.shape[1])[None, :, None])
    return plan, cost


def update_experts(big: MoE, plan: np.ndarray, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reduced experts minimising Σ plan·KL given the plan: β_k by weighted least squares of the transported
    means, σ_k² = Σ plan (σ_l² + (x_sᵀ(β_k − β_l))²) / Σ plan (the per-x moment match, pooled over x)."""
    means = X @ big.experts                                     # [S, L]
    K = plan.shape[1]
    experts, variances = np.zeros((X.shape[1], K)), np.zeros(K)
    for k in range(K):
        W = plan[:, k, :]                                       # [L, S]
        D = W.sum(0)
        if D.sum() <= 0:
            raise ValueError("update_experts: a reduced expert received no mass; start from another estimate")
        target = np.sum(W.T * means, 1) / np.maximum(D, 1e-300)  # transported mean at each x_s
        beta = weighted_lstsq(X, target, D)
        dev2 = (X @ beta)[None, :] - means.T                   # [L, S]
        variances[k] = np.sum(W * (big.variances[:, None] + dev2 ** 2)) / D.sum()
        experts[:, k] = beta
    return experts, variances


def _moe_mm(big, mass, start: MoE, X, max_iter: int, tol: float):
    red, costs = MoE(start.gates, start.experts.copy(), start.variances.copy()), []
    for _ in range(max_iter):
        plan, cost = transport_plan(big, mass, red, X)
        costs.append(float(np.sum(plan * cost)))
        red = MoE(red.gates, *update_experts(big, plan, X))
        if len(costs) > 1 and costs[-2] - costs[-1] <= tol * max(abs(costs[-2]), 1e-300):
            break
    plan, cost = transport_plan(big, mass, red, X)
    costs.append(float(np.sum(plan * cost)))
    return red, plan, costs


def reduce_moe(locals_: list[MoE], sizes, X_server: np.ndarray, y_server: np.ndarray, max_iter: int = 100,
               tol: float = 1e-10) -> tuple[MoE, dict]:
    """The MoE reduction estimator (official code's algorithm, see the module docstring): MM over experts on the
    server sample, started from each local estimate, the lowest transport cost kept; then the gate is fitted
    by IRLS to the posterior of (x_s, y_s) under the reduced experts with prior = transported mass."""
    if not locals_:
        raise ValueError("reduce_moe: locals_ must hold at least one local MoE")
    t0 = time.process_time()
    X = design(X_server)
    big, mass = stack_experts(locals_), local_masses(locals_, sizes, X)
    best = None
    for start in locals_:
        red, plan, costs = _moe_mm(big, mass, start, X, max_iter, tol)
        if best is None or costs[-1] < best[2][-1] - 1e-12:
            best = (red, plan, costs)
    red, plan, costs = best
    prior = plan.sum(0).T                                       # [S, K] transported mass at each x_s
    prior = prior / prior.sum(1, keepdims=True)
    resid = np.asarray(y_server)[:, None] - X @ red.experts
    logp = np.log(np.clip(prior, 1e-300, None)) - 0.5 * (np.log(2 * np.pi * red.variances) + resid ** 2 / red.variances)
    post = softmax_rows(logp)
    gates = fit_gate(X, post, np.mean([g.gates for g in locals_], 0), iters=50)
    red = MoE(gates, red.experts, red.variances)
    return red, {"cost": costs[-1], "costs": costs, "seconds": time.process_time() - t0}


def naive_average_moe(locals_: list[MoE], sizes) -> MoE:
    """FedAvg of every MoE parameter, expert k with expert k in each machine's own order."""
    w = _check_weights(sizes)
    w = w / w.sum()
    avg = lambda a: np.einsum("m,m...->...", w, np.stack(a))
    return MoE(avg([g.gates for g in locals_]), avg([g.experts for g in locals_]), avg([g.variances for g in locals_]))


def moe_error(est: MoE, truth: MoE) -> float:
    """√(‖B̂−B‖² + ‖σ̂²−σ²‖² + ‖Â−A‖²) after the best permutation of experts (gates re-referenced)."""
    K = len(truth.variances)
    def err(order):
        e = est.permuted(order)
        return np.sqrt(np.sum((e.experts - truth.experts) ** 2) + np.sum((e.variances - truth.variances) ** 2)
                       + np.sum((e.gates - truth.gates) ** 2))
    return float(min(err(p) for p in itertools.permutations(range(K))))


def sample_moe(moe: MoE, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """x ~ U(−1, 1) (1-D), z ~ gate(x), y ~ N(xᵀβ_z, σ_z²)."""
    x = rng.uniform(-1, 1, size=n)
    X = design(x)
    P = gate_probs(moe, X)
    z = (rng.random(n)[:, None] > np.cumsum(P, 1)).sum(1)
    y = np.sum(X * moe.experts[:, z].T, 1) + np.sqrt(moe.variances[z]) * rng.standard_normal(n)
    return x, y
