"""Verdict names, and verdicts over seeds: a claim with `seeds: N` is judged on the seed distribution.

Rule (papers/SCHEMA.md, "Verdicts over seeds"): the claim's expectation is turned into one or two one-sided
statements `d > 0` (or `<`, `>=`, `<=`) on per-seed values d_i (for `> rhs`: d_i = metric_i − rhs_i, paired
seed by seed when rhs names other per-seed metrics). With mean m, sample sd s and Student's t quantile
t = t_{n−1}(confidence), the half-width is h = t · s / √n, so [m − h, m + h] holds the lower and the upper
one-sided confidence bounds of the mean at `confidence` (together a two-sided 2·confidence − 1 interval).
  reproduced                    every point of [m − h, m + h] satisfies the statement,
  not reproduced at this scale  no point of it does (the opposite one-sided bound, same confidence),
  inconclusive at this scale    it straddles the bound.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

from .expect import Expectation, MetricError, _value, huge_int

REPRODUCED = "reproduced"
PARTIAL = "partially reproduced"
NOT_REPRODUCED = "not reproduced at this scale"
INCONCLUSIVE = "inconclusive at this scale"
ERROR = "error"

DEFAULT_CONFIDENCE = 0.9
MIN_SEEDS = 5
_ONE_SIDED = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


@dataclass(frozen=True)
class Interval:
    """Mean ± half-width: [low, high] are the lower and upper one-sided bounds at `confidence`."""

    mean: float
    half_width: float
    n: int
    confidence: float

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def text(self) -> str:
        return f"{self.mean:.4g} ± {self.half_width:.2g} (n={self.n}, {self.confidence:.0%} one-sided)"

    def as_dict(self) -> dict:
        return {"mean": self.mean, "half_width": self.half_width, "low": self.low, "high": self.high,
                "n": self.n, "confidence": self.confidence}


def t_quantile(confidence: float, dof: int) -> float:
    from scipy.stats import t  # imported here: scipy is slow to import inside a kernel
    return float(t.ppf(confidence, dof))


def mean_interval(values, confidence: float = DEFAULT_CONFIDENCE) -> Interval:
    """Student-t one-sided confidence bounds of the mean of `values` (n ≥ 2), as mean ± half-width."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) < 2:
        raise ValueError(f"an interval needs at least 2 values, got {x.shape}")
    half = t_quantile(confidence, len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return Interval(float(x.mean()), half, len(x), confidence)


def one_sided_verdict(interval: Interval, op: str) -> str:
    """Three-way verdict of the statement `mean OP 0` from the interval (see the module docstring)."""
    test = _ONE_SIDED[op]
    worst, best = (interval.low, interval.high) if op in (">", ">=") else (interval.high, interval.low)
    if test(worst, 0.0):
        return REPRODUCED
    if not test(best, 0.0):
        return NOT_REPRODUCED
    return INCONCLUSIVE


def combine(verdicts) -> str:
    """All statements hold -> reproduced; any one confidently fails -> not reproduced; else inconclusive."""
    verdicts = list(verdicts)
    if all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return NOT_REPRODUCED if NOT_REPRODUCED in verdicts else INCONCLUSIVE


# ---------------------------------------------------------------------------------------------- per-seed data
def seed_values(metrics: dict, name: str, n: int) -> np.ndarray:
    """The claim metric's n per-seed values; MetricError saying what was recorded otherwise."""
    if name not in metrics:
        raise MetricError(f"metric {name} was not recorded")
    value = metrics[name]
    if not isinstance(value, list):
        raise MetricError(f"metric {name} was recorded as a single value ({value!r}); a claim with seeds: {n} "
                          f"needs one value per seed: repro.record({name!r}, [value for each of {n} seeds])")
    if len(value) != n:
        raise MetricError(f"metric {name} has {len(value)} per-seed values; the claim says seeds: {n}")
    bad = [i for i, v in enumerate(value) if v is None or isinstance(v, bool) or not isinstance(v, (int, float))
           or huge_int(v) or not math.isfinite(v)]
    if bad:
        raise MetricError(f"metric {name} is NaN, infinite, an integer too large for a float or not a number at "
                          f"seed index {bad[0]}")
    return np.asarray(value, dtype=float)


def _operands(expect: Expectation, metrics: dict, n: int) -> dict:
    """The metrics the expectation names: per-seed lists as arrays (paired by seed), scalars as they are."""
    out = {}
    for name in expect.names:
        value = metrics.get(name)
        if isinstance(value, list):
            out[name] = seed_values(metrics, name, n)
        elif name not in metrics or value is None or isinstance(value, float) and not math.isfinite(value):
            raise MetricError(f"metric {name} was not recorded" if name not in metrics
                              else f"metric {name} is NaN or infinite")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MetricError(f"metric {name} is {value!r}; a seeded claim compares numbers")
        elif huge_int(value):
            raise MetricError(f"metric {name} is an integer of {value.bit_length()} bits, too large for a float")
        else:
            out[name] = float(value)
    return out


def _per_seed(node, operands: dict, n: int) -> np.ndarray:
    try:
        return np.broadcast_to(np.asarray(_value(node, operands), dtype=float), (n,))
    except (TypeError, ValueError) as e:  # e.g. a quoted string in the bound
        raise MetricError(f"cannot evaluate the bound per seed: {e}") from None


def statements(expect: Expectation, values: np.ndarray, metrics: dict) -> list[tuple[np.ndarray, str]]:
    """The expectation as one-sided statements (d_i, op) meaning `mean(d) op 0`."""
    n = len(values)
    operands = _operands(expect, metrics, n)
    if expect.kind in _ONE_SIDED:
        return [(values - _per_seed(expect.args[0], operands, n), expect.kind)]
    if expect.kind == "between":
        low, high = (_per_seed(a, operands, n) for a in expect.args)
        return [(values - low, ">="), (values - high, "<=")]
    if expect.kind == "within":
        tol, relative, target = expect.args
        x = _per_seed(target, operands, n)
        band = tol * abs(float(x.mean())) if relative else tol  # relative: P% of the mean target
        return [(values - x - band, "<="), (values - x + band, ">=")]
    raise MetricError(f"expectation {expect.text!r} cannot be judged over seeds (use <, <=, >, >=, within, between)")


def seeded_verdict(expect: Expectation, values: np.ndarray, metrics: dict, confidence: float) -> str:
    return combine(one_sided_verdict(mean_interval(d, confidence), op)
                   for d, op in statements(expect, values, metrics))


def judge_seeded(expect: Expectation, partial: Expectation | None, metric: str, seeds: int, metrics: dict,
                 confidence: float = DEFAULT_CONFIDENCE) -> tuple[str, dict]:
    """(verdict, summary) of a seeded claim; summary holds the metric's interval and, when the bound names
    per-seed metrics, the interval of the paired margin (metric − bound). Raises MetricError."""
    values = seed_values(metrics, metric, seeds)
    verdict = seeded_verdict(expect, values, metrics, confidence)
    if verdict == NOT_REPRODUCED and partial is not None:  # expect confidently fails: try the weaker claim
        verdict = {REPRODUCED: PARTIAL, INCONCLUSIVE: INCONCLUSIVE}.get(
            seeded_verdict(partial, values, metrics, confidence), NOT_REPRODUCED)
    summary = mean_interval(values, confidence).as_dict()
    if any(isinstance(metrics.get(name), list) for name in expect.names) and expect.kind in (*_ONE_SIDED, "within"):
        target = expect.args[0] if expect.kind in _ONE_SIDED else expect.args[2]
        margin = values - _per_seed(target, _operands(expect, metrics, seeds), seeds)
        summary["margin"] = mean_interval(margin, confidence).as_dict()
    return verdict, summary


def summary_text(summary: dict | None) -> str:
    """'0.912 ± 0.013 (n=5, 90% one-sided)', plus the paired margin when there is one."""
    if not summary:
        return ""
    text = Interval(summary["mean"], summary["half_width"], summary["n"], summary["confidence"]).text()
    margin = summary.get("margin")
    if margin:
        text += f"; paired margin {margin['mean']:+.3g} ± {margin['half_width']:.2g}"
    return text
