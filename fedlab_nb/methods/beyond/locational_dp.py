"""Locational local DP — Priyanshu, Maurya, Ganesh, Tran, "Unified Locational Differential Privacy Framework",
arXiv 2405.03903 (2024). Code: https://github.com/Privacy-Engineering-CMU/location-dp-framework

Every user of a region randomises their own record before it leaves the device (local DP); the server adds
the noisy reports up per region and debiases. The paper's framework pairs data types with mechanisms:

    categorical / boolean:  randomized response (k-ary: keep the true value w.p. p = e^ε/(e^ε+k−1), else report
                            each other value w.p. q = 1/(e^ε+k−1); p/q = e^ε, so exactly ε-LDP)
    one-hot (official code): flip every bit independently w.p. f = 1/(1+e^ε) — two one-hot vectors differ in two
                            bits, so this is 2ε-LDP per vector, not ε (`unary_flip_log_ratio` computes it exactly)
    float:                  clip to [0, B], add N(0, σ²) with σ calibrated to (ε, δ) for sensitivity B
    rankings / integers:    a noisy argmax ("exponential mechanism"; the official code adds Laplace(1/ε) to the
                            0/1 indicator of the true item and reports the argmax)

Debiasing (standard, Wang et al. USENIX Security 2017): with n users of whom c_v hold v and n̂_v reports of v,

    ĉ_v = (n̂_v − n q)/(p − q)          E ĉ_v = c_v,    Var ĉ_v = n q(1−q)/(p−q)² + c_v (1−p−q)/(p−q)

and, for any mechanism with a known channel P[in, out], the expected report histogram is cᵀP, so ĉ = n̂ P⁻¹ is
unbiased (the exponential mechanism's raw histogram is not). Central DP for comparison: a trusted curator adds
one Laplace(1/ε) to the count, std √2/ε whatever n; the local estimate's std grows like √n/ε.

Gaussian calibration: the classic σ = B√(2 ln(1.25/δ))/ε (Dwork & Roth, Thm A.1; what the official code uses) is
only a theorem for ε < 1, so `gaussian_sigma` also offers the exact calibration of Balle & Wang (ICML 2018,
"analytic Gaussian mechanism", Thm 8): the smallest σ with Φ(B/2σ − εσ/B) − e^ε Φ(−B/2σ − εσ/B) ≤ δ (checked
against dp-accounting's PLD accountant in the tests).
"""
from __future__ import annotations

import itertools

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm

from ...core.registry import register
from ...utils import check_draws, check_number, check_positive_int


def _check_epsilon(epsilon) -> float:
    return check_number("epsilon", epsilon, 0)


def _finite(value: float, what: str) -> float:
    """A noise level or std that a subnormal ε (1/ε overflows) would make infinite is refused, naming ε."""
    if not np.isfinite(value):
        raise ValueError(f"{what} is {value}: epsilon is too small to calibrate (1/epsilon overflows); use a larger one")
    return float(value)


def _check_regions(regions, n_regions: int) -> np.ndarray:
    """Region ids as integers in 0..n_regions−1 (a −1 or a float would be numpy's bare error or a wrong bin)."""
    n_regions = check_positive_int("n_regions", n_regions)
    regions = np.asarray(regions)
    if regions.size and (regions.dtype.kind not in "iu" or regions.min() < 0 or regions.max() >= n_regions):
        raise ValueError(f"regions must be integer region ids in 0..{n_regions - 1}, got dtype {regions.dtype}, "
                         f"range [{regions.min()}, {regions.max()}]")
    return regions


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2:
        raise ValueError(f"k (the number of categories) must be an integer >= 2, got {k!r}")
    return int(k)


def _check_values(values, k: int) -> np.ndarray:
    """Categories 0..k−1 as integers (a −1 would index category k−1; 0.7 would be truncated to 0)."""
    values = np.asarray(values)
    if values.size and (values.dtype.kind not in "iub" or values.min() < 0 or values.max() >= k):
        raise ValueError(f"values must lie in 0..{k - 1}, as integers; got dtype {values.dtype}, range "
                         f"[{values.min()}, {values.max()}]")
    return values.astype(np.int64) if values.dtype.kind == "b" else values  # a bool array would index as a mask


def _check_bits(bits) -> np.ndarray:
    bits = np.asarray(bits)
    if bits.size and not np.isin(bits, (0, 1)).all():  # a 2 would come back as 2 or −1: the input shown exactly
        raise ValueError(f"bits must be 0 or 1, got values {np.unique(bits)[:5]}")
    return bits


# --- k-ary randomized response ---------------------------------------------------------------------------
def grr_probabilities(epsilon: float, k: int) -> tuple[float, float]:
    """(p, q): keep probability e^ε/(e^ε + k − 1) and the probability of each particular other value; past
    ε = 700 (e^ε near float64's limit) written with e^−ε, so that p → 1 rather than inf/inf = NaN."""
    epsilon, k = _check_epsilon(epsilon), _check_k(k)
    if epsilon > 700:
        shrink = np.exp(-epsilon)
        return float(1 / (1 + (k - 1) * shrink)), float(shrink / (1 + (k - 1) * shrink))
    e = np.exp(epsilon)
    return float(e / (e + k - 1)), float(1 / (e + k - 1))


def grr_channel(epsilon: float, k: int) -> np.ndarray:
    """P[in, out] of k-ary randomized response."""
    p, q = grr_probabilities(epsilon, k)
    if q == 0:  # past ε ≈ 745 e^−ε underflows: the channel's log-ratio audit would read inf
        raise ValueError(f"epsilon = {epsilon} is past what float64 can hold in the channel (e^-epsilon underflows "
                         "to 0); audit epsilon <= 700")
    return np.full((k, k), q) + (p - q) * np.eye(k)


def max_log_ratio(channel: np.ndarray) -> float:
    """max over outputs o and inputs i, j of log P[i, o]/P[j, o]: the mechanism is ε-LDP for exactly this ε."""
    logp = np.log(np.asarray(channel, np.float64))
    return float(np.max(logp.max(0) - logp.min(0)))


@register("locational_dp", claims="locational_dp", kind="module")
def randomized_response(values, k: int, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """Each user's value in {0..k−1} is kept w.p. p, else replaced by one of the other k−1 values uniformly."""
    k = _check_k(k)
    values = _check_values(values, k)
    p, _ = grr_probabilities(epsilon, k)
    keep = rng.random(values.shape) < p
    other = (values + rng.integers(1, k, size=values.shape)) % k   # uniform over the k−1 other values
    return np.where(keep, values, other)


def debias_counts(report_counts, n: int, epsilon: float, k: int) -> np.ndarray:
    """ĉ = (n̂ − n q)/(p − q) for each category (or, for k = 2, the count of ones)."""
    p, q = grr_probabilities(epsilon, k)
    return (np.asarray(report_counts, np.float64) - n * q) / (p - q)


def expected_reports(true_counts, epsilon: float, k: int) -> np.ndarray:
    """E n̂ = cᵀ P (exact)."""
    return np.asarray(true_counts, np.float64) @ grr_channel(epsilon, k)


def debiased_variance(true_count, n: int, epsilon: float, k: int):
    """Var ĉ_v = n q(1−q)/(p−q)² + c_v (1−p−q)/(p−q)."""
    p, q = grr_probabilities(epsilon, k)
    return n * q * (1 - q) / (p - q) ** 2 + np.asarray(true_count, np.float64) * (1 - p - q) / (p - q)


def region_counts(regions, values, n_regions: int, k: int) -> np.ndarray:
    """[n_regions, k] histogram of values per region."""
    regions, values = np.asarray(regions), np.asarray(values)
    out = np.zeros((n_regions, k))
    np.add.at(out, (regions, values), 1)
    return out


def private_region_shares(regions, bits, n_regions: int, epsilon: float, rng: np.random.Generator,
                          draws: int = 1) -> np.ndarray:
    """[draws, n_regions]: each user randomises their bit (binary RR); the server debiases each region's count
    and divides by the region size (public)."""
    regions, bits = _check_regions(regions, n_regions), _check_values(bits, 2).astype(np.int64)
    draws = check_draws(draws, n_regions)
    sizes = np.bincount(regions, minlength=n_regions)
    out = np.empty((draws, n_regions))
    for d in range(draws):
        ones = np.bincount(regions, weights=randomized_response(bits, 2, epsilon, rng), minlength=n_regions)
        out[d] = debias_counts(ones, sizes, epsilon, 2) / np.maximum(sizes, 1)
    return out


# --- the official code's one-hot mechanism: per-bit flips -----------------------------------------------
def flip_bits(bits, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """Flip every bit independently w.p. 1/(1 + e^ε) (the official code's one-hot / boolean randomiser)."""
    f = 1 / (1 + np.exp(_check_epsilon(epsilon)))
    bits = _check_bits(bits)
    return np.where(rng.random(bits.shape) < f, 1 - bits, bits)


def unary_flip_log_ratio(epsilon: float, k: int) -> float:
    """Exact max log-likelihood ratio of `flip_bits` between two one-hot inputs of length k (all 2^k outputs)."""
    epsilon, k = _check_epsilon(epsilon), _check_k(k)
    if epsilon > 700:  # f = 1/(1+e^ε) underflows to 0 and log(0) makes the audit NaN
        raise ValueError(f"epsilon = {epsilon} is past what float64 can audit (the flip probability underflows); "
                         "audit epsilon <= 700")
    f = 1 / (1 + np.exp(epsilon))
    if k > 16:
        raise ValueError(f"unary_flip_log_ratio enumerates 2^k outputs; use k <= 16, got {k}")
    outputs = np.array(list(itertools.product((0, 1), repeat=k)))
    inputs = np.eye(k, dtype=int)
    flips = (outputs[None, :, :] != inputs[:, None, :]).sum(2)               # [k inputs, 2^k outputs]
    logp = flips * np.log(f) + (k - flips) * np.log(1 - f)
    return float(np.max(logp.max(0) - logp.min(0)))


# --- floats: clipped Gaussian ---------------------------------------------------------------------------
def _gaussian_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    a, b = sensitivity / (2 * sigma), epsilon * sigma / sensitivity
    return float(norm.cdf(a - b) - np.exp(epsilon) * norm.cdf(-a - b))


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float, calibration: str = "analytic") -> float:
    """σ of an (ε, δ)-DP Gaussian mechanism for this ℓ2 sensitivity. "classic": B√(2 ln(1.25/δ))/ε (ε < 1
    only); "analytic": the exact smallest σ (Balle & Wang 2018)."""
    epsilon = _check_epsilon(epsilon)
    delta = check_number("delta", delta, 0, 1, "e.g. 1e-5")
    sensitivity = check_number("sensitivity", sensitivity, 0, fix="the l2 sensitivity bound of one user's value")
    if calibration == "classic":
        if epsilon >= 1:
            raise ValueError(f"the classic Gaussian calibration is a theorem only for epsilon < 1, got {epsilon}; "
                             "use calibration='analytic'")
        return sensitivity * np.sqrt(2 * np.log(1.25 / delta)) / epsilon
    if calibration != "analytic":
        raise ValueError(f"calibration must be 'analytic' or 'classic', got {calibration!r}")
    lo, hi = 1e-6 * sensitivity, 1e6 * sensitivity
    try:
        return float(brentq(lambda s: _gaussian_delta(s, epsilon, sensitivity) - delta, lo, hi,
                            xtol=1e-14 * sensitivity))
    except ValueError:  # no sign change in the bracket, NaN at its ends, or an xtol below float resolution
        raise ValueError(f"no noise std in [1e-6, 1e6] x sensitivity gives (epsilon = {epsilon:g}, delta = {delta:g}) "
                         f"for sensitivity {sensitivity:g}: the epsilon, delta or sensitivity is outside what the "
                         "analytic calibration can solve in float64; use moderate values") from None


def private_region_means(regions, values, n_regions: int, bound: float, sigma: float, rng: np.random.Generator,
                         draws: int = 1) -> np.ndarray:
    """[draws, n_regions]: each user clips their value to [0, bound] and adds N(0, σ²); the server averages."""
    bound = check_number("bound", bound, 0, fix="the values are clipped to [0, bound]: it bounds the sensitivity")
    sigma = check_number("sigma", sigma, 0, fix="the noise std, e.g. gaussian_sigma(epsilon, delta, bound); 0 is none")
    regions, draws = _check_regions(regions, n_regions), check_draws(draws, n_regions)
    x = np.asarray(values, np.float64)
    if np.isnan(x).any():  # np.clip keeps NaN: the release would show which region holds it
        raise ValueError(f"values hold {int(np.isnan(x).sum())} NaN value(s); drop or impute them before the release")
    x = np.clip(x, 0.0, bound)
    sizes = np.maximum(np.bincount(regions, minlength=n_regions), 1)
    out = np.empty((draws, n_regions))
    for d in range(draws):
        out[d] = np.bincount(regions, weights=x + sigma * rng.standard_normal(len(x)), minlength=n_regions) / sizes
    return out


# --- rankings: the noisy-argmax ("exponential") mechanism and its channel ----------------------------------
def noisy_argmax_channel(epsilon: float, k: int, n_grid: int = 20001) -> np.ndarray:
    """P[in, out] of reporting argmax_j (1[j = in] + Laplace(1/ε)_j) (the official code's mechanism): by symmetry
    P[i, i] = P(L_0 + 1 > max_{j≥1} L_j) and every other output gets (1 − P[i, i])/(k − 1); computed by
    numerical integration of the Laplace density against the CDF of the max."""
    epsilon, k = _check_epsilon(epsilon), _check_k(k)
    b = 1 / epsilon
    t = np.linspace(-60 * b, 60 * b + 1, n_grid)                 # the value of L_0 + 1
    dens = 0.5 / b * np.exp(-np.abs(t - 1) / b)
    cdf = np.where(t < 0, 0.5 * np.exp(np.minimum(t, 0) / b), 1 - 0.5 * np.exp(-np.maximum(t, 0) / b))
    keep = float(np.trapezoid(dens * cdf ** (k - 1), t))
    return np.full((k, k), (1 - keep) / (k - 1)) + (keep - (1 - keep) / (k - 1)) * np.eye(k)


def noisy_argmax(values, k: int, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    values = _check_values(values, _check_k(k))
    scores = np.eye(k)[values] + rng.laplace(0.0, 1 / _check_epsilon(epsilon), size=(len(values), k))
    return scores.argmax(1)


def channel_debias(report_counts, channel: np.ndarray) -> np.ndarray:
    """ĉ solving ĉᵀ P = n̂ (unbiased for any invertible channel)."""
    return np.linalg.solve(np.asarray(channel, np.float64).T, np.asarray(report_counts, np.float64).T).T


# --- local vs central ------------------------------------------------------------------------------------
def local_count_std(n: int, true_count, epsilon: float) -> np.ndarray:
    """std of the debiased binary-RR count of a region with n users."""
    return np.sqrt(debiased_variance(true_count, n, epsilon, 2))


def central_count_std(epsilon: float) -> float:
    """std of a count released by a trusted curator with Laplace(1/ε) noise (sensitivity 1): √2/ε."""
    return _finite(np.sqrt(2) / _check_epsilon(epsilon), "the count's std sqrt(2)/epsilon")
