"""Second-order building blocks for bilevel optimisation, on flat parameter vectors with `torch.func`.

Convention used by the whole package: the upper level is f(x, y) and the lower level g(x, y), both
scalar functions of two 1-D tensors (x the outer / hyper-parameters, y the inner parameters). Every
second derivative is applied to a vector — reverse-over-reverse `vjp`s of the gradient (the Hessian is
symmetric, so its vjp is the Hessian-vector product; forward-over-reverse `jvp` gives the same numbers but was
4–10× slower in torch.func on CPU here) — so no d × d matrix is ever formed.
The implicit solver (implicit.py), truncated back-propagation (unrolled.py) and the federated and
decentralised algorithms reuse these three functions."""
from __future__ import annotations

from typing import Callable

import torch
from torch.func import grad, jvp, vjp

Objective = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_vector(name: str, t) -> torch.Tensor:
    """Raise a ValueError naming `name` unless `t` is a 1-D floating tensor (the package's convention)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a 1-D torch.Tensor (a flat parameter vector), got {type(t).__name__}")
    if t.dim() != 1 or not t.is_floating_point():
        raise ValueError(f"{name} must be a 1-D floating tensor (flatten it first), got shape "
                         f"{tuple(t.shape)} and dtype {t.dtype}")
    return t


def grad_x(fn: Objective, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∇_x fn(x, y)."""
    return grad(fn, argnums=0)(x, y)


def grad_y(fn: Objective, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∇_y fn(x, y)."""
    return grad(fn, argnums=1)(x, y)


def hvp_yy(g: Objective, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """∇²_yy g(x, y) · v: the vjp of y ↦ ∇_y g(x, y) with cotangent v (= Hv, H symmetric; never built)."""
    if v.shape != y.shape:
        raise ValueError(f"v must have the shape of y {tuple(y.shape)}, got {tuple(v.shape)}")
    _, pull = vjp(lambda y_: grad_y(g, x, y_), y)
    return pull(v)[0]


def cross_vjp(g: Objective, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """∇²_xy g(x, y) · v = ∇_x ⟨∇_y g(x, y), v⟩ (a d_x vector; ∇²_xy g is the d_x × d_y block)."""
    if v.shape != y.shape:
        raise ValueError(f"v must have the shape of y {tuple(y.shape)}, got {tuple(v.shape)}")
    _, pull = vjp(lambda x_: grad_y(g, x_, y), x)
    return pull(v)[0]


def hvp(fn: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """∇² fn(w) · v for a function of one flat vector (DSBO's and FedMBO's per-client Hessian products)."""
    _, pull = vjp(grad(fn), w)
    return pull(v)[0]


def hvp_forward(fn: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same product by forward-over-reverse (a jvp of the gradient), for checking and for comparison."""
    return jvp(grad(fn), (w,), (v,))[1]
