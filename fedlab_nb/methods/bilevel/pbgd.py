"""PBGD — penalty-based bilevel gradient descent with the lower-level value-function penalty.

Shen, Chen, "On Penalty-based Bilevel Gradient Descent Method", ICML 2023 (https://arxiv.org/abs/2302.05185).
The bilevel problem min_{x, y ∈ S(x)} f(x, y), S(x) = argmin_y g(x, y), is replaced by the penalised
single-level problem

    min_{x, y}  f(x, y) + γ (g(x, y) − v(x)),   v(x) = min_{y'} g(x, y'),

whose solutions are O(1/γ)-approximate bilevel solutions. By Danskin's theorem ∇v(x) = ∇_x g(x, ω*(x)), so
one V-PBGD step (i) runs a few inner GD steps ω ≈ argmin g(x, ·) and (ii) takes a (projected) gradient step
on (x, y) with ∇_x f + γ(∇_x g(x, y) − ∇_x g(x, ω)) and ∇_y f + γ∇_y g(x, y). First-order only: no Hessian."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fedlab_nb.core.registry import register

from torch.func import grad

from .derivatives import Objective, check_vector, grad_x
from .hypergradients import inner_gd


@dataclass
class PBGDResult:
    x: torch.Tensor
    y: torch.Tensor
    omega: torch.Tensor                      # the last inner approximation of argmin_y g(x, ·)
    history: list = field(default_factory=list)   # (step, f, g − v) every `record_every` steps


def penalty_gradients(f: Objective, g: Objective, x, y, omega, gamma: float):
    """(∂_x, ∂_y) of f(x, y) + γ(g(x, y) − g(x, ω)) with ω held fixed (Danskin: ∇v(x) = ∇_x g(x, ω*))."""
    fx, fy = grad(f, argnums=(0, 1))(x, y)
    gx, gy = grad(g, argnums=(0, 1))(x, y)
    return fx + gamma * (gx - grad_x(g, x, omega)), fy + gamma * gy


@register("pbgd", claims="pbgd", kind="module")
def pbgd(f: Objective, g: Objective, x0: torch.Tensor, y0: torch.Tensor, *, gamma: float, lr: float, steps: int,
         inner_lr: float, inner_steps: int, lr_x: float | None = None, project_x: Callable | None = None,
         project_y: Callable | None = None, record_every: int = 0) -> PBGDResult:
    """V-PBGD: `steps` projected gradient steps of size `lr` on the value-function penalty with weight `gamma`.

    Each step warm-starts ω from the previous one and runs `inner_steps` GD steps (size `inner_lr`) on
    g(x, ·). `lr_x` (default `lr`) is a separate step for x — the paper's analysis uses one step α; a larger x
    step only rescales the x coordinates (a diagonal preconditioner) when x is badly scaled against y.
    `project_x` / `project_y` map a point onto the constraint sets (identity when None)."""
    check_vector("x0", x0)
    check_vector("y0", y0)
    lr_x = lr if lr_x is None else lr_x
    for name, value in (("gamma", gamma), ("lr", lr), ("lr_x", lr_x), ("inner_lr", inner_lr)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if steps < 1 or inner_steps < 0:
        raise ValueError(f"steps must be >= 1 and inner_steps >= 0, got {steps} and {inner_steps}")
    px = project_x or (lambda t: t)
    py = project_y or (lambda t: t)
    x, y, omega = x0.detach().clone(), y0.detach().clone(), y0.detach().clone()
    history = []
    for k in range(steps):
        omega = inner_gd(g, x, omega, inner_lr, inner_steps)
        dx, dy = penalty_gradients(f, g, x, y, omega, gamma)
        x, y = px(x - lr_x * dx), py(y - lr * dy)
        if record_every and (k % record_every == 0 or k == steps - 1):
            history.append((k, float(f(x, y)), float(g(x, y) - g(x, omega))))
    return PBGDResult(x, y, omega, history)
