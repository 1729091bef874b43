"""Warm- versus cold-start gradient-based bilevel optimisation.

Vicol, Lorraine, Pedregosa, Duvenaud, Grosse, "On Implicit Bias in Overparameterized Bilevel Optimization",
ICML 2022 (https://proceedings.mlr.press/v162/vicol22a.html). Both alternate T inner GD steps with one outer
hypergradient step; they differ only in where the inner loop starts:

- cold start re-initialises y at y₀ (here 0) every outer step, so with an under-determined least-squares
  inner problem GD returns the minimum-norm solution for the current x (GD from 0 never leaves the row
  space) — the solution is a function of x alone;
- warm start continues from the previous inner iterate, so components picked up under earlier x's stay:
  the inner solution depends on the whole outer path.

The hypergradient is back-propagation through the T inner steps of the current outer step (unrolled.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedlab_nb.core.registry import register

from .derivatives import Objective, check_vector
from .hypergradients import backprop_last, unroll


@dataclass
class BLORun:
    x: torch.Tensor
    y: torch.Tensor
    xs: list = field(default_factory=list)      # the outer iterates
    outer: list = field(default_factory=list)   # f(x_k, y_k) after each outer step's inner loop


@register("warm_cold_start", claims="warm_cold_start", kind="module")
def bilevel_descent(f: Objective, g: Objective, x0: torch.Tensor, y0: torch.Tensor, *, warm: bool,
                    outer_steps: int, outer_lr: float, inner_steps: int, inner_lr,
                    keep: int | None = None) -> BLORun:
    """Alternating BLO: per outer step, `inner_steps` GD steps on g(x, ·) — from y0 (cold) or from the previous
    inner iterate (warm) — then x ← x − outer_lr · (K-step truncated back-propagation, K = `keep`, default all).

    `inner_lr` is a number or a function x ↦ step size (e.g. 1 / L(x) when the inner curvature moves with x)."""
    check_vector("x0", x0)
    check_vector("y0", y0)
    if not isinstance(warm, bool):
        raise ValueError(f"warm must be True (warm start) or False (cold start), got {warm!r}")
    if outer_steps < 0 or not outer_lr > 0:
        raise ValueError(f"outer_steps must be >= 0 and outer_lr > 0, got {outer_steps} and {outer_lr}")
    keep = inner_steps if keep is None else keep
    step = inner_lr if callable(inner_lr) else (lambda _x: inner_lr)
    x, y = x0.detach().clone(), y0.detach().clone()
    run = BLORun(x, y, [x.clone()], [])
    for _ in range(outer_steps):
        start = y if warm else y0.detach()
        lr = step(x)
        y, stored = unroll(g, x, start, lr, inner_steps, keep)
        run.outer.append(float(f(x, y)))
        x = x - outer_lr * backprop_last(f, g, x, y, stored, lr)
        run.xs.append(x.clone())
    # one last inner solve at the final x, so (x, y) is the pair each method would deploy
    y, _ = unroll(g, x, y if warm else y0.detach(), step(x), inner_steps, 0)
    run.x, run.y = x, y
    return run


def replay_warm(g: Objective, xs: list, y0: torch.Tensor, *, inner_steps: int, inner_lr) -> torch.Tensor:
    """The warm-start inner solution after following the outer path `xs` (inner GD at each x in turn, each
    solve starting where the previous one stopped). Two paths to the same final x can end at different y."""
    check_vector("y0", y0)
    step = inner_lr if callable(inner_lr) else (lambda _x: inner_lr)
    y = y0.detach()
    for x in xs:
        y, _ = unroll(g, x, y, step(x), inner_steps, 0)
    return y
