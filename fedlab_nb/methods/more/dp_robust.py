"""Private and Byzantine-robust distributed mean estimation with SMEA.

Youssef Allouah, Rachid Guerraoui, Nirupam Gupta, Rafael Pinot, John Stephan, "On the Privacy-Robustness-Utility
Trilemma in Distributed Learning", ICML 2023 (arXiv 2302.04787). Aggregation rule as in the authors' code
(LPD-EPFL/robust-collaborative-learning, aggregators/mea.py) and the EPFL ByzFL documentation of `SMEA`:

    SMEA(x_1 … x_n) = mean of S*,   S* = argmin_{|S| = n − f} λ_max(Σ_S),
    Σ_S = (1/|S|) Σ_{i∈S} (x_i − x̄_S)(x_i − x̄_S)ᵀ.

Honest workers protect their own data against every other entity (local DP): worker i holds m points in an ℓ2
ball of radius B and releases its mean plus N(0, σ²I), σ = z · 2B/m (replace-one sensitivity of a mean), with z
calibrated to (ε, δ) by dp-accounting (`methods.privacy.accounting.noise_for_epsilon`). The classic Dwork–Roth
σ is given too (`classic_sigma`, valid for ε < 1).

The error bound used in the notebook is derived here, in the form the paper's analysis takes (error controlled by
the honest vectors' top eigenvalue, not their trace): for any S of size n − f with λ_max(Σ_S) ≤ λ_max(Σ_H),
‖SMEA − x̄_H‖² ≤ 4f/(n − 2f) · λ_max(Σ_H)  (`resilience_bound`); the constant is ours, not the paper's.
"""
from __future__ import annotations

import functools
import itertools
import math
import numbers

import torch
from torch import Tensor

from ...core.registry import register
from ...utils import check_number, check_positive_int
from ...utils import loglog_slope  # noqa: F401  (the notebook's rate fits)
from ..privacy import accounting
from ..privacy.dp import clip_rows
from ..robustness.attacks import choose_byzantine, get_attack
from ..robustness.robust_aggregation import robust_rule


# --- the aggregation rule ------------------------------------------------------------------------------
def _check_f(updates: Tensor, f) -> int:
    if not isinstance(updates, Tensor) or updates.dim() != 2 or not updates.is_floating_point():
        raise ValueError("updates must be a floating-point tensor of shape [n, d]")
    n = updates.shape[0]
    if isinstance(f, bool) or not isinstance(f, numbers.Integral) or not 0 <= f or not 2 * f < n:
        raise ValueError(f"f must be an int with 0 <= 2f < n = {n}, got {f!r}; SMEA needs an honest majority")
    if not torch.isfinite(updates).all():
        raise ValueError("updates contain NaN/Inf; drop those rows first (robustness.rules.drop_nonfinite)")
    return int(f)


def top_eigenvalue(points: Tensor) -> Tensor:
    """λ_max of the (1/|S|)-normalised empirical covariance of the rows of ``points`` ([..., s, d]).

    Computed from the s×s centred Gram matrix, which has the same non-zero spectrum as the d×d covariance."""
    centred = points - points.mean(dim=-2, keepdim=True)
    gram = centred @ centred.transpose(-1, -2) / points.shape[-2]
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0.0)


def smea_subset(updates: Tensor, f: int) -> tuple[int, ...]:
    """The subset S* of size n − f with the smallest top eigenvalue (all C(n, n − f) subsets; ties go to
    the first subset in lexicographic order). Each subset's centred Gram matrix P G_S P (P = I − 11ᵀ/s) is cut
    from the one n×n Gram matrix, so the cost in d is a single product."""
    f = _check_f(updates, f)
    n = updates.shape[0]
    subsets = list(itertools.combinations(range(n), n - f))
    index = torch.tensor(subsets, device=updates.device)
    centred = updates - updates.mean(dim=0)         # a shift changes no covariance; better conditioned Gram
    gram = (centred @ centred.T)[index[:, :, None], index[:, None, :]]   # [C, s, s] sub-Gram matrices, one d-product
    gram = gram - gram.mean(dim=1, keepdim=True) - gram.mean(dim=2, keepdim=True) + gram.mean(dim=(1, 2), keepdim=True)
    eig = torch.linalg.eigvalsh(gram / (n - f))[:, -1]   # [C]: one batched eigensolve for all subsets
    return subsets[int(torch.argmin(eig))]


def smea(updates: Tensor, weights: Tensor | None = None, *, f: int = 0) -> Tensor:
    """Smallest Maximum Eigenvalue Averaging: the mean of :func:`smea_subset`. Ignores ``weights`` (a
    Byzantine worker could lie about them); exponential in f — exact search, no filtering approximation."""
    return updates[list(smea_subset(updates, f))].mean(dim=0)


def resilience_bound(honest: Tensor, f: int) -> float:
    """4f/(n − 2f) · λ_max(Σ_H) with n = |H| + f: an upper bound on ‖SMEA − x̄_H‖² for every attack.

    Why: S* and H both have top eigenvalue ≤ λ_max(Σ_H), share I = S* ∩ H with |I| ≥ n − 2f, and a set A whose
    covariance is ≤ λ in every direction has ‖x̄_I − x̄_A‖² ≤ λ |A∖I| / |I| for I ⊂ A; the triangle inequality
    through x̄_I gives ‖x̄_{S*} − x̄_H‖ ≤ 2 √(λ_max(Σ_H) f / (n − 2f))."""
    n = honest.shape[0] + f
    if not 2 * f < n:
        raise ValueError(f"need 2f < n, got f={f}, n={n}")
    return 4 * f / (n - 2 * f) * float(top_eigenvalue(honest))


# --- the Gaussian mechanism of each honest worker ------------------------------------------------------
def classic_sigma(radius: float, m: int, epsilon: float, delta: float) -> float:
    """Dwork–Roth Gaussian mechanism for a mean of m points in a ball of radius B: σ = (2B/m) √(2 ln(1.25/δ)) / ε
    (their Theorem A.1 needs ε < 1)."""
    epsilon = check_number("epsilon", epsilon, 0, 1, "the classic Gaussian-mechanism bound needs 0 < epsilon < 1; "
                           "for a larger one use gaussian_sigma")
    radius = check_number("radius", radius, 0, fix="the radius B of the ball the points lie in")
    delta = check_number("delta", delta, 0, 1, "e.g. 1e-5")
    m = check_positive_int("m (the number of points averaged)", m)
    if m >= 2 ** 53:  # past float64's whole numbers: 2B/m would round, or overflow past 10^308
        raise ValueError(f"m (the number of points averaged) must be below 2^53, got {m}")
    sigma = 2 * radius / m * math.sqrt(2 * math.log(1.25 / delta)) / epsilon
    if not math.isfinite(sigma):  # a subnormal ε: 1/ε overflows
        raise ValueError(f"epsilon = {epsilon!r} is too small to calibrate (the noise std overflows); use a larger one")
    return sigma


@functools.lru_cache(maxsize=256)
def gaussian_sigma(radius: float, m: int, epsilon: float, delta: float) -> float:
    """σ = z · 2B/m with z the smallest noise multiplier giving (ε, δ)-DP for one Gaussian release (PLD
    accountant of dp-accounting, tight for any ε > 0). Cached: calibration takes about a second."""
    if not radius > 0 or not (isinstance(m, numbers.Integral) and m >= 1):
        raise ValueError(f"radius must be > 0 and m an int >= 1, got radius={radius!r}, m={m!r}")
    z = accounting.noise_for_epsilon(epsilon, q=1.0, steps=1, delta=delta, accountant="pld")
    return z * 2 * radius / m


def honest_dp_error(d: int, sigma: float, n: int, f: int) -> float:
    """E‖(1/(n − f)) Σ_H noise‖² = d σ² / (n − f): the error of averaging the honest private means (noise only)."""
    return d * sigma ** 2 / (n - f)


# --- one private + robust mean estimate ---------------------------------------------------------------
def hidden_shift(updates: Tensor, byzantine: Tensor, *, scale: float = 1.0, generator=None) -> Tensor:
    """All Byzantine rows at x̄_H + t·u, u a random unit direction, t = scale · √trace(Σ_H): as far from the honest
    mean as a typical honest (noisy) vector, so the attack hides in the DP noise."""
    mask = torch.as_tensor(byzantine, dtype=torch.bool)
    honest = updates[~mask]
    u = torch.randn(updates.shape[1], generator=generator, dtype=torch.float64).to(updates)
    spread = (honest - honest.mean(0)).pow(2).sum(1).mean().sqrt()
    out = updates.clone()
    out[mask] = honest.mean(0) + scale * spread * u / u.norm()
    return out


def worker_means(points: Tensor, radius: float) -> Tensor:
    """[n, m, d] points → [n, d] means of the points clipped to the ℓ2 ball of radius B (π(x, B))."""
    n, m, d = points.shape
    clipped, _ = clip_rows(points.reshape(n * m, d), radius)
    return clipped.reshape(n, m, d).mean(dim=1)


@register("dp_robust", claims="dp_robust", kind="module")
def private_robust_mean(points: Tensor, f: int, *, epsilon: float, delta: float, radius: float,
                        attack: str = "alie", rule: str = "smea", byzantine: Tensor | None = None,
                        generator: torch.Generator | None = None, **attack_hyper) -> dict:
    """One round of the paper's setting: each worker clips its m points to radius B, averages them and adds
    N(0, σ²I) (local (ε, δ)-DP); the f Byzantine rows are then replaced by ``attack`` (methods.robustness.attacks,
    or "hidden_shift"); the server aggregates with ``rule`` ("smea" or any robustness.rules name; f is passed to
    rules that take it). Returns the estimate, the honest private means and the σ used."""
    n, m, d = points.shape
    sigma = gaussian_sigma(radius, m, epsilon, delta)
    private = worker_means(points, radius)
    private = private + sigma * torch.randn(private.shape, generator=generator, dtype=torch.float64).to(private)
    mask = choose_byzantine(n, f, generator) if byzantine is None else byzantine
    attack_fn = (lambda u, b, generator=None: hidden_shift(u, b, generator=generator, **attack_hyper)) \
        if attack == "hidden_shift" else get_attack(attack, **attack_hyper)
    sent = attack_fn(private, mask, generator=generator) if f > 0 else private
    return {"estimate": aggregate(sent, f, rule), "honest": private[~mask], "sigma": sigma, "sent": sent}


def aggregate(updates: Tensor, f: int, rule: str = "smea") -> Tensor:
    """SMEA or a baseline rule by name, f passed where the rule uses it (robust_aggregation.robust_rule: Krum gets f,
    the trimmed mean cuts f values from each side)."""
    return smea(updates, f=f) if rule == "smea" else robust_rule(rule, f)(updates)


