"""Privacy accounting through Google's `dp-accounting` library (RDP and PLD accountants): no hand-written
accountant. A round (or a DP-SGD step) of the sampled Gaussian mechanism is one `DpEvent`; T of them
compose. Used by DP-FedAvg (client-level: q = the client sampling rate) and DP-SGD (sample-level: q = B/n).

    epsilon(q=0.1, noise_multiplier=1.0, steps=100, delta=1e-5)            # ε after 100 rounds
    noise_for_epsilon(target_epsilon=3, q=0.1, steps=100, delta=1e-5)       # the z that spends exactly ε

`sampling="poisson"` (each unit independently with probability q) or `"fixed"` (a fixed-size sample
without replacement, q = m/K; RDP only, substitution neighbours).

`noise_multiplier` is the noise std over the query's ℓ2 sensitivity *for that neighbouring relation*: with
add/remove-one (Poisson) a sum of S-clipped vectors has sensitivity S; with replace-one (fixed) it has 2S, so
noise z·S is a multiplier of z/2 there (`fedlab_nb.methods.privacy.dp.central_epsilon` does this conversion)."""
from __future__ import annotations

import logging
import math

from ...utils import check_number

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed")
# ε decreases in z and is already 0.0 at z = 1e6; above this dp_accounting's RDP arithmetic overflows
_Z_CAP = 1e100
# below this, dp_accounting's RDP arithmetic (alpha / (2 z**2)) overflows or divides by zero (z ~ 1e-154 gives 0.0,
# 1e-200 a ZeroDivisionError): z < _Z_FLOOR is treated like z = 0, no privacy (ε = inf); ε(1e-100) ~ 5e200 already
_Z_FLOOR = 1e-100
# PLD discretises the privacy loss, whose range for one Gaussian round is ~ 2·sqrt(2·50)/z wide (tails cut at
# e^-50), into buckets of 1e-4: z = 0.2 is ~1e6 buckets per round (seconds); z = 1e-3 would need tens of GiB
_PLD_MIN_Z = 0.2
_PLD_MAX_STEPS = 10**7
# PLD's work is an FFT over the composed privacy loss's buckets (16-byte complex, a few arrays at once): 3e7
# buckets is ~2 GB and tens of seconds (q=0.1, z=1, 1e6 steps); (q=0.1, z=0.2, 1e6 steps) would be ~6e8, 15+ GiB
_PLD_MAX_BUCKETS = 3e7
_PLD_BUCKET = 1e-4          # dp_accounting's PLDAccountant value_discretization_interval


def _number(name: str, value) -> None:
    """A real number (not a bool, not a string): a TypeError naming the parameter otherwise."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}"
                        + (f"; write {name}={float(value)!r}" if isinstance(value, str) and _is_float(value) else ""))


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check(q: float, noise_multiplier: float, steps: int, delta: float, accountant: str, sampling: str):
    for name, value in (("q", q), ("noise_multiplier", noise_multiplier), ("delta", delta)):
        _number(name, value)
    if isinstance(steps, bool):
        raise ValueError(f"steps must be an int >= 0 (rounds or DP-SGD steps), got the bool {steps!r}")
    check_number("noise_multiplier", noise_multiplier, 0, closed_low=True, fix="0 means no privacy")
    if not 0 < check_number("q (the sampling rate)", q, 0, fix="a number in (0, 1]") <= 1:
        raise ValueError(f"q (the sampling rate) must be in (0, 1], got {q!r}")
    import numbers
    if not (isinstance(steps, numbers.Integral) and steps >= 0):  # np.int64 counts too
        raise ValueError(f"steps must be an int >= 0 (rounds or DP-SGD steps), got {steps!r}")
    check_number("delta", delta, 0, 1, "e.g. 1/K^1.1 for K users")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if sampling == "fixed" and accountant != "rdp":
        raise ValueError("fixed-size sampling is accounted by the RDP accountant only; pass accountant='rdp'")
    if accountant == "pld" and steps > _PLD_MAX_STEPS:
        raise ValueError(f"steps={steps} is too many for the PLD accountant (at most {_PLD_MAX_STEPS:.0e}); "
                         "use accountant='rdp'")


def _check_pld_noise(noise_multiplier: float) -> None:
    if 0 < noise_multiplier < _PLD_MIN_Z:
        raise ValueError(f"noise_multiplier z={noise_multiplier!r} is too small for the PLD accountant (z >= "
                         f"{_PLD_MIN_Z}: about {20 / (noise_multiplier * 1e-4):.0e} buckets per round, GiB and "
                         "minutes per call); use accountant='rdp' (a valid upper bound on ε)")


def _pld_buckets(q: float, z: float, steps: int) -> float:
    """Estimate of the buckets PLDAccountant needs (within ~25 %): q = 1 is one Gaussian of std z/sqrt(steps), loss
    range ~ 20/std; q < 1 is the one-round loss range plus the Chernoff width 2·8.4·sqrt(steps·Var[loss]) of the
    `steps`-fold composition (tail mass 1e-15), Var from a quadrature of the one-round loss (remove and add)."""
    import numpy as np
    if q >= 1:
        return 20 * math.sqrt(steps) / (z * _PLD_BUCKET)
    x = np.linspace(-10 * z, 1 + 10 * z, 20001)
    loss = np.logaddexp(math.log1p(-q), math.log(q) + (2 * x - 1) / (2 * z * z))
    p0, p1 = np.exp(-x * x / (2 * z * z)), np.exp(-(x - 1) ** 2 / (2 * z * z))
    var = 0.0
    for w in ((1 - q) * p0 + q * p1, p0):
        w = w / w.sum()
        var = max(var, float((w * (loss - (w * loss).sum()) ** 2).sum()))
    return float(loss.max() - loss.min()) / _PLD_BUCKET + 2 * 8.4 * math.sqrt(steps * var) / _PLD_BUCKET


def _check_pld_work(q: float, noise_multiplier: float, steps: int) -> None:
    buckets = _pld_buckets(q, noise_multiplier, steps)
    if buckets > _PLD_MAX_BUCKETS:
        raise ValueError(f"the PLD accountant needs about {buckets:.1e} buckets (~{buckets * 64 / 2**30:.0f} GiB) for "
                         f"q={q!r}, noise_multiplier={noise_multiplier!r}, steps={steps} (at most {_PLD_MAX_BUCKETS:.0e}); "
                         "use accountant='rdp' (a valid upper bound on ε), fewer steps or more noise")


def dp_event(q: float, noise_multiplier: float, steps: int, sampling: str = "poisson"):
    """The `dp_accounting` event of `steps` compositions of the q-sampled Gaussian mechanism (noise z·S)."""
    import dp_accounting as dpa
    _check(q, noise_multiplier, steps, 0.5, "rdp", sampling)  # δ and the accountant are not the event's: any valid
    gauss = dpa.GaussianDpEvent(noise_multiplier)
    if q < 1:
        if sampling == "poisson":
            gauss = dpa.PoissonSampledDpEvent(q, gauss)
        else:  # the accountant reads q as sample_size / source_dataset_size: an exact ratio of the float q (a
            # rounded one, e.g. to multiples of 1e-6, would account a smaller q and report an invalid, smaller ε)
            sample_size, population = float(q).as_integer_ratio()
            gauss = dpa.SampledWithoutReplacementDpEvent(population, sample_size, gauss)
    return dpa.SelfComposedDpEvent(gauss, steps)


def epsilon(q: float, noise_multiplier: float, steps: int, delta: float, accountant: str = "rdp",
            sampling: str = "poisson") -> float:
    """ε of `steps` compositions of the q-sampled Gaussian mechanism at δ (inf when z = 0 and steps > 0)."""
    _check(q, noise_multiplier, steps, delta, accountant, sampling)
    q, noise_multiplier, steps, delta = float(q), float(noise_multiplier), int(steps), float(delta)
    if steps == 0:
        return 0.0
    if noise_multiplier < _Z_FLOOR:  # z = 0 (no noise) or too little for the accountant's arithmetic: no privacy
        return math.inf
    if accountant == "pld":
        _check_pld_noise(noise_multiplier)
        _check_pld_work(q, min(noise_multiplier, _Z_CAP), steps)
    noise_multiplier = min(noise_multiplier, _Z_CAP)  # ε(z) <= ε(1e100) = 0: an upper bound, no overflow
    acc = _accountant_for(accountant, sampling)
    with _quiet_absl():
        return float(acc.compose(dp_event(q, noise_multiplier, steps, sampling)).get_epsilon(delta))


def noise_for_epsilon(target_epsilon: float, q: float, steps: int, delta: float, accountant: str = "rdp",
                      sampling: str = "poisson") -> float:
    """The smallest noise multiplier z whose ε after `steps` is ≤ target_epsilon (the library's calibration).

    PLD is bracketed by the RDP answer (RDP's ε is never below PLD's, so z_PLD ≤ z_RDP): starting PLD's
    search at a tiny z would build a privacy-loss distribution with billions of buckets."""
    import dp_accounting as dpa
    _check(q, 1.0, steps, delta, accountant, sampling)
    q, steps, delta = float(q), int(steps), float(delta)
    if steps == 0:
        raise ValueError("steps must be >= 1 to calibrate noise (with steps=0 any noise_multiplier spends ε = 0)")
    _number("target_epsilon", target_epsilon)
    target_epsilon = check_number("target_epsilon", target_epsilon, 0, fix="ε = inf needs no noise: noise_multiplier=0")
    bracket = dpa.LowerEndpointAndGuess(1e-3, 1.0)
    if accountant == "rdp" and epsilon(q, 1e-3, steps, delta, "rdp", sampling) <= target_epsilon:
        return _tiny_noise_for_epsilon(target_epsilon, q, steps, delta, sampling)
    if accountant == "pld":
        upper = noise_for_epsilon(target_epsilon, q, steps, delta, "rdp", sampling)
        if upper < _PLD_MIN_Z:
            raise ValueError(f"target_epsilon={target_epsilon!r} needs noise_multiplier z ~ {upper:.3g}, too small "
                             f"for the PLD accountant (z >= {_PLD_MIN_Z}); use accountant='rdp'")
        lower = max(0.8 * upper, _PLD_MIN_Z)  # PLD usually needs 5-15 % less noise than RDP says
        while epsilon(q, lower, steps, delta, "pld", sampling) <= target_epsilon:
            if lower <= _PLD_MIN_Z:
                raise ValueError(f"target_epsilon={target_epsilon!r} needs noise_multiplier z < {_PLD_MIN_Z}, too "
                                 "small for the PLD accountant; use accountant='rdp'")
            lower = max(lower / 2, _PLD_MIN_Z)  # until PLD's ε at `lower` exceeds the target: a bracket
        bracket = dpa.ExplicitBracketInterval(lower, upper)
    try:
        with _quiet_absl():
            return float(dpa.calibrate_dp_mechanism(lambda: _accountant_for(accountant, sampling),
                                                    lambda z: dp_event(q, z, steps, sampling),
                                                    target_epsilon, delta, bracket))
    except ValueError:  # the root finder's bracket error (e.g. delta = 1e-300): name the inputs, not scipy's bracket
        raise ValueError(f"no noise_multiplier reaches target_epsilon={target_epsilon!r} at delta={delta!r} (q={q}, "
                         f"steps={steps}, {accountant}): delta or epsilon is outside what the accountant can "
                         "calibrate; use e.g. delta >= 1e-12") from None


def _tiny_noise_for_epsilon(target_epsilon: float, q: float, steps: int, delta: float, sampling: str) -> float:
    """noise_for_epsilon for a target met by z <= 1e-3: RDP bisection on log10(z) in [log10(_Z_FLOOR), -3]."""
    import dp_accounting as dpa
    if epsilon(q, _Z_FLOOR, steps, delta, "rdp", sampling) <= target_epsilon:
        raise ValueError(f"target_epsilon={target_epsilon!r} is met by a noise_multiplier below {_Z_FLOOR:g}, which "
                         "is no privacy; use noise_multiplier=0 (no noise) or a smaller target_epsilon")
    with _quiet_absl():
        log_z = dpa.calibrate_dp_mechanism(lambda: _accountant_for("rdp", sampling),
                                           lambda x: dp_event(q, 10.0 ** x, steps, sampling), target_epsilon, delta,
                                           dpa.ExplicitBracketInterval(math.log10(_Z_FLOOR), -3.0), tol=1e-9)
    return float(10.0 ** log_z)


def _accountant_for(accountant: str, sampling: str):
    import dp_accounting as dpa
    if accountant == "pld":
        return dpa.pld.PLDAccountant()
    relation = (dpa.NeighboringRelation.REPLACE_ONE if sampling == "fixed"
                else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return dpa.rdp.RdpAccountant(neighboring_relation=relation)


class _quiet_absl:
    """Silence dp-accounting's absl warnings ("failed to converge ... Excluding this order"): the
    accountant drops that RDP order and the result stays valid."""

    def __enter__(self):
        self.logger = logging.getLogger("absl")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
