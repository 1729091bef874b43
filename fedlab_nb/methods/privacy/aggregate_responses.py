"""Learning from aggregate responses — Javanmard, Chen, Mirrokni, Badanidiyuru, Fu, "Learning from Aggregate
responses: Instance Level versus Bag Level Loss Functions", ICLR 2024 (arXiv:2401.11081,
https://openreview.net/forum?id=E60SIDItyT). No official code.

The n samples are split into m = n/k disjoint bags of size k; the learner sees every feature vector x_i but
only each bag's mean response ȳ_b. For a linear model f_i = x_iᵀθ and squared loss (all losses are means
over the n instances):

    bag-level       L_bag(θ)  = (1/m)  Σ_b (ȳ_b − f̄_b)²              (fit the bag's mean prediction)
    instance-level  L_inst(θ) = (1/n)  Σ_b Σ_{i∈b} (ȳ_b − f_i)²      (fit every prediction to ȳ_b)
    within-bag variance R(θ) = (1/n)  Σ_b Σ_{i∈b} (f_i − f̄_b)²

and per bag Σ_{i∈b}(ȳ_b − f_i)² = k(ȳ_b − f̄_b)² + Σ_{i∈b}(f_i − f̄_b)², so L_inst = L_bag + R: the
instance-level loss is the bag-level loss plus a regulariser that shrinks predictions towards their bag mean.
The paper's interpolating loss is L_int(ρ) = L_bag + ρ R, ρ ∈ [0, 1] (ρ = 0 bag-level, ρ = 1 instance-level).
With S the n×n bag-averaging projection, XᵀSX = k X̄ᵀX̄ and XᵀSy = k X̄ᵀȳ, so its minimiser is

    θ̂(ρ) = ((1 − ρ) XᵀSX + ρ XᵀX)⁻¹ XᵀS y,

a linear function of the responses: E[θ̂ | X] = M⁻¹XᵀSX θ*, Cov = σ² M⁻¹XᵀSX M⁻¹ for y = Xθ* + ε
(M = the matrix above), which gives the exact (conditional) bias² / variance split used here.

Label DP (the paper's mechanism): clip each response to [−B, B] (the paper takes B = C√log n), publish each
bag's mean plus Laplace noise. One changed response moves its bag mean by at most 2B/k, so the Laplace scale
2B/(kε) gives ε-label-DP (the noise per bag falls as 1/k; the price is the bagging bias). NOTE: two published
reviews of the paper report its Algorithm 1 uses scale B/(kε); we use the standard sensitivity 2B/k.

All arithmetic is float64 numpy; the asymptotic (proportional-regime) risk formulas of the paper are not
implemented (their text could not be checked here).
"""
from __future__ import annotations

import numpy as np

from ...core.registry import register
from ...utils import check_draws, check_number

BAGGINGS = ("random", "feature")


# --- bagging ---------------------------------------------------------------------------------------
def _check_bag_size(n: int, k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"bag size k must be a positive integer, got {k!r}")
    if n % k:
        raise ValueError(f"bag size k={k} must divide the number of samples n={n} (drop n % k samples first)")


def random_bags(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[m, k] indices: a uniformly random partition of range(n) into m = n/k bags (the paper's setting)."""
    _check_bag_size(n, k)
    return rng.permutation(n).reshape(n // k, k)


def feature_bags(x: np.ndarray, k: int) -> np.ndarray:
    """[m, k] indices: samples sorted along the top principal direction of x and cut into consecutive bags,
    so a bag holds similar feature vectors (label-free 'feature-clustered' bags)."""
    n = len(x)
    _check_bag_size(n, k)
    xc = x - x.mean(0)
    direction = np.linalg.svd(xc, full_matrices=False)[2][0]
    return np.argsort(xc @ direction, kind="stable").reshape(n // k, k)


def make_bags(kind: str, x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    if kind not in BAGGINGS:
        raise ValueError(f"bagging must be one of {BAGGINGS}, got {kind!r}")
    return random_bags(len(x), k, rng) if kind == "random" else feature_bags(x, k)


def _check_bags(bags: np.ndarray, n: int) -> np.ndarray:
    bags = np.asarray(bags)
    if bags.dtype.kind not in "iu":  # float indices (0.0, 1.0 ...) would index nothing numpy accepts
        raise ValueError(f"bags must hold integer row indices, got dtype {bags.dtype}; use bags.astype(int)")
    if bags.ndim != 2 or bags.size != n or not np.array_equal(np.sort(bags.ravel()), np.arange(n)):
        raise ValueError(f"bags must be an [m, k] array holding every index 0..{n - 1} exactly once "
                         f"(use random_bags or feature_bags), got shape {bags.shape}")
    return bags


def bag_means(values: np.ndarray, bags: np.ndarray) -> np.ndarray:
    """Mean of `values` (n or [n, d]) over each bag: [m] or [m, d]."""
    return np.asarray(values)[_check_bags(bags, len(values))].mean(1)


# --- losses (the per-bag identity) -----------------------------------------------------------------
def bag_loss(theta, x, ybar, bags) -> float:
    """L_bag = (1/m) Σ_b (ȳ_b − x̄_bᵀθ)²."""
    return float(np.mean((ybar - bag_means(x, bags) @ theta) ** 2))


def instance_loss(theta, x, ybar, bags) -> float:
    """L_inst = (1/n) Σ_b Σ_{i∈b} (ȳ_b − x_iᵀθ)²."""
    f = (x @ theta)[_check_bags(bags, len(x))]
    return float(np.mean((ybar[:, None] - f) ** 2))


def within_bag_variance(theta, x, bags) -> float:
    """R = (1/n) Σ_b Σ_{i∈b} (x_iᵀθ − f̄_b)²: the regulariser that turns L_bag into L_inst."""
    f = (x @ theta)[_check_bags(bags, len(x))]
    return float(np.mean((f - f.mean(1, keepdims=True)) ** 2))


def interpolating_loss(theta, x, ybar, bags, rho: float) -> float:
    """L_int(ρ) = L_bag + ρ R."""
    return bag_loss(theta, x, ybar, bags) + rho * within_bag_variance(theta, x, bags)


def identity_residual(ybar_b: float, f_b: np.ndarray) -> float:
    """Σ(ȳ − f_i)² − [k(ȳ − f̄)² + Σ(f_i − f̄)²] for one bag: zero up to rounding."""
    f_b = np.asarray(f_b, dtype=float)
    fbar = f_b.mean()
    return float(np.sum((ybar_b - f_b) ** 2) - (len(f_b) * (ybar_b - fbar) ** 2 + np.sum((f_b - fbar) ** 2)))


# --- closed-form estimators ------------------------------------------------------------------------
def _check_rho(rho: float) -> None:
    if not 0 <= rho <= 1:
        raise ValueError(f"rho must be in [0, 1] (0: bag-level loss, 1: instance-level loss), got {rho!r}")


def normal_matrices(x: np.ndarray, ybar: np.ndarray, bags: np.ndarray):
    """(XᵀSX, XᵀX, XᵀSy) from the features and the bags' mean responses: XᵀSX = k X̄ᵀX̄, XᵀSy = k X̄ᵀȳ."""
    bags = _check_bags(bags, len(x))
    k = bags.shape[1]
    if len(ybar) != len(bags):
        raise ValueError(f"ybar must hold one mean response per bag ({len(bags)}), got {len(ybar)}")
    xbar = bag_means(x, bags)
    return k * xbar.T @ xbar, x.T @ x, k * xbar.T @ ybar


@register("aggregate_responses", claims="aggregate_responses", kind="module")
def interpolating_estimator(x: np.ndarray, ybar: np.ndarray, bags: np.ndarray, rho: float) -> np.ndarray:
    """argmin_θ L_bag + ρ R = ((1 − ρ) XᵀSX + ρ XᵀX)⁻¹ XᵀSy (needs m ≥ d bags at ρ = 0, n ≥ d otherwise)."""
    _check_rho(rho)
    g_bag, g, b = normal_matrices(x, ybar, bags)
    return np.linalg.solve((1 - rho) * g_bag + rho * g, b)


def bag_level_estimator(x: np.ndarray, ybar: np.ndarray, bags: np.ndarray) -> np.ndarray:
    """Least squares of the bag means on the mean features: argmin (1/m) Σ_b (ȳ_b − x̄_bᵀθ)²."""
    xbar = bag_means(x, bags)
    if len(xbar) < x.shape[1]:
        raise ValueError(f"the bag-level estimator needs at least d={x.shape[1]} bags, got m={len(xbar)}; "
                         "use smaller bags or rho > 0")
    return np.linalg.lstsq(xbar, ybar, rcond=None)[0]


def instance_level_estimator(x: np.ndarray, ybar: np.ndarray, bags: np.ndarray) -> np.ndarray:
    """Least squares of every instance on its bag's mean response: argmin (1/n) Σ_i (ȳ_{b(i)} − x_iᵀθ)²."""
    bags = _check_bags(bags, len(x))
    target = np.empty(len(x))
    target[bags] = np.asarray(ybar)[:, None]
    return np.linalg.lstsq(x, target, rcond=None)[0]


# --- exact conditional bias / variance for y = Xθ* + ε, ε ~ N(0, σ²I) --------------------------------
class RhoPath:
    """Bias² and variance of θ̂(ρ) given X and the bags, for many ρ from one generalised eigen-decomposition
    XᵀSX v = λ XᵀX v (V ᵀXᵀX V = I), so M(ρ)⁻¹ = V diag(1 / ((1 − ρ)λ + ρ)) Vᵀ."""

    def __init__(self, x: np.ndarray, bags: np.ndarray):
        from scipy.linalg import eigh
        g_bag, g, _ = normal_matrices(x, np.zeros(len(bags)), bags)
        self.lam, self.v = eigh(g_bag, g)
        self.lam = np.clip(self.lam, 0.0, None)          # XᵀSX is PSD; tiny negative rounding only
        self.g = g
        self.col_norm2 = np.sum(self.v ** 2, axis=0)

    def _singular(self, denom: np.ndarray) -> bool:
        return bool(np.any(denom <= 1e-12 * max(1.0, self.lam.max())))

    def bias2(self, rho: float, theta_star: np.ndarray) -> float:
        """‖E[θ̂ | X] − θ*‖² = ‖(M⁻¹XᵀSX − I)θ*‖² (nan when M is singular)."""
        _check_rho(rho)
        denom = (1 - rho) * self.lam + rho
        if self._singular(denom):
            return float("nan")                           # no unique minimiser: bias undefined
        mean = self.v @ (self.lam / denom * (self.v.T @ (self.g @ theta_star)))
        return float(np.sum((mean - theta_star) ** 2))

    def variance(self, rho: float, noise_var: float = 1.0) -> float:
        """E‖θ̂ − E θ̂‖² = σ² tr(M⁻¹ XᵀSX M⁻¹) (inf when M is singular: ρ = 0 with fewer bags than features)."""
        _check_rho(rho)
        denom = (1 - rho) * self.lam + rho
        if self._singular(denom):
            return float("inf")
        return float(noise_var * np.sum(self.lam / denom ** 2 * self.col_norm2))


def bias_variance(x, bags, rho: float, theta_star, sigma: float) -> tuple[float, float]:
    """(bias², variance) of θ̂(ρ) given X and the bags; excess prediction risk = bias² + variance for x ~ N(0, I)."""
    path = RhoPath(x, bags)
    return path.bias2(rho, theta_star), path.variance(rho, sigma ** 2)


# --- label-DP aggregate responses ------------------------------------------------------------------
def dp_noise_scale(k: int, epsilon: float, clip: float) -> float:
    """Laplace scale for ε-label-DP bag means of responses clipped to [−clip, clip]: sensitivity 2·clip/k."""
    epsilon = check_number("epsilon", epsilon, 0)  # ε = inf: a Laplace scale of 0, the bag means released bare
    clip = check_number("clip (the response bound B)", clip, 0)  # clip = inf: every release ±inf
    _check_bag_size(k, k)
    scale = 2.0 * clip / (k * epsilon)
    if not np.isfinite(scale):  # a subnormal ε: the scale overflows and every release is ±inf or NaN
        raise ValueError(f"epsilon = {epsilon!r} is too small: the Laplace scale 2·clip/(k·ε) overflows to {scale}; "
                         "use an epsilon the release can carry (e.g. 0.01 or more)")
    return scale


def default_clip(n: int, c: float) -> float:
    """The paper's response bound B = C √(log n)."""
    if not c > 0 or n < 2:
        raise ValueError(f"need c > 0 and n >= 2 for B = c·sqrt(log n), got c={c!r}, n={n!r}")
    return c * float(np.sqrt(np.log(n)))


def _responses(y) -> np.ndarray:
    """y as one real response per row: a [n, d] y would get Laplace(2B/(kε)) per coordinate, a (d·ε)-DP release."""
    y = np.asarray(y)
    if y.dtype.kind not in "biuf":  # object (None), text, complex: not real responses
        raise ValueError(f"y must be real numbers, one response per row, got dtype {y.dtype} (None or text is not a "
                         "response: drop or impute those rows)")
    if y.ndim != 1:
        raise ValueError(f"y must be one response per row, shape [n], got shape {y.shape}; the release is ε-DP "
                         "for one response per row (release each column with its own share of ε)")
    return y


def dp_bag_responses(y: np.ndarray, bags: np.ndarray, epsilon: float, clip: float,
                     rng: np.random.Generator, draws: int | None = None) -> np.ndarray:
    """Clip responses to [−clip, clip], average per bag, add Laplace(2·clip/(kε)) to each bag mean:
    [m] (or [draws, m] independent releases)."""
    y = _responses(y)
    bags = _check_bags(bags, len(y))
    draws = None if draws is None else check_draws(draws, len(bags))
    scale = dp_noise_scale(bags.shape[1], epsilon, clip)
    if np.isnan(y).any():  # np.clip keeps NaN: the release would show which bag holds it
        raise ValueError(f"y holds {int(np.isnan(y).sum())} NaN response(s); drop or impute those rows before the "
                         "release (±inf are clipped to ±clip, NaN cannot be)")
    means = np.clip(y, -clip, clip)[bags].mean(1)
    shape = means.shape if draws is None else (draws, len(means))
    return means + rng.laplace(0.0, scale, size=shape)


def solve_many(x: np.ndarray, bags: np.ndarray, rho: float, ybars: np.ndarray) -> np.ndarray:
    """θ̂(ρ) for several releases ȳ at once ([r, m] → [r, d]): one factorisation, r right-hand sides."""
    _check_rho(rho)
    g_bag, g, _ = normal_matrices(x, ybars[0], bags)
    k = bags.shape[1]
    rhs = k * bag_means(x, bags).T @ ybars.T
    return np.linalg.solve((1 - rho) * g_bag + rho * g, rhs).T
