"""Implicit hypergradients: the implicit function theorem with a matrix-free linear solve.

At an inner solution y* (∇_y g(x, y*) = 0) the hypergradient of F(x) = f(x, y*(x)) is

    ∇F(x) = ∇_x f − ∇²_xy g · u,   u = [∇²_yy g]⁻¹ ∇_y f,

and u is found from Hessian-vector products only, by conjugate gradient or by the Neumann series
u ≈ α Σ_{k<K} (I − α∇²_yy g)^k ∇_y f. This is the recipe of automatic implicit differentiation
(Blondel, Berthet, Cuturi, Frostig, Hoyer, Llinares-López, Pedregosa, Vert, "Efficient and Modular Implicit
Differentiation", NeurIPS 2022; JAXopt, https://github.com/google/jaxopt): the optimality condition
∇_y g = 0 is written once and differentiated by autodiff; the forward solver is any solver, run without
a graph. The Neumann form is the one of Lorraine, Vicol, Duvenaud (AISTATS 2020)."""
from __future__ import annotations

from typing import Callable

import torch

from .derivatives import Objective, check_vector, cross_vjp, grad_x, grad_y, hvp_yy

MatVec = Callable[[torch.Tensor], torch.Tensor]


def conjugate_gradient(matvec: MatVec, b: torch.Tensor, *, tol: float = 1e-12, max_iter: int | None = None,
                       x0: torch.Tensor | None = None) -> torch.Tensor:
    """Solve A u = b for a symmetric positive (semi-)definite A given only u ↦ A u.

    Stops when ‖A u − b‖ ≤ tol · ‖b‖ or after `max_iter` steps (default: 10 · len(b))."""
    check_vector("b", b)
    if tol <= 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    max_iter = 10 * b.numel() if max_iter is None else max_iter
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    u = torch.zeros_like(b) if x0 is None else x0.clone()
    r = b - matvec(u) if x0 is not None else b.clone()
    p, rr = r.clone(), r @ r
    stop = (tol * torch.linalg.vector_norm(b)) ** 2
    for _ in range(max_iter):
        if rr <= stop:
            break
        ap = matvec(p)
        step = rr / (p @ ap)
        u, r = u + step * p, r - step * ap
        rr_new = r @ r
        p, rr = r + (rr_new / rr) * p, rr_new
    return u


def neumann_series(matvec: MatVec, b: torch.Tensor, *, alpha: float, steps: int) -> torch.Tensor:
    """u ≈ A⁻¹ b by the truncated Neumann series α Σ_{k=0}^{steps-1} (I − αA)^k b.

    Converges when 0 < α < 2 / λ_max(A) and A is positive definite; the error after K terms is
    (I − αA)^K A⁻¹ b, so it shrinks geometrically at rate max |1 − αλ|."""
    check_vector("b", b)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (below 2 / largest Hessian eigenvalue), got {alpha}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    term, total = b.clone(), b.clone()
    for _ in range(steps - 1):
        term = term - alpha * matvec(term)
        total = total + term
    return alpha * total


def solve_adjoint(g: Objective, x: torch.Tensor, y: torch.Tensor, rhs: torch.Tensor, *, solver: str = "cg",
                  tol: float = 1e-12, max_iter: int | None = None, alpha: float | None = None,
                  steps: int = 100) -> torch.Tensor:
    """u = [∇²_yy g(x, y)]⁻¹ rhs by `solver` = "cg" (tol, max_iter) or "neumann" (alpha, steps)."""
    matvec = lambda v: hvp_yy(g, x, y, v)
    if solver == "cg":
        return conjugate_gradient(matvec, rhs, tol=tol, max_iter=max_iter)
    if solver == "neumann":
        if alpha is None:
            raise ValueError("alpha is required with solver='neumann' (use 1 / largest Hessian eigenvalue)")
        return neumann_series(matvec, rhs, alpha=alpha, steps=steps)
    raise ValueError(f"solver must be 'cg' or 'neumann', got {solver!r}")


def implicit_hypergradient(f: Objective, g: Objective, x: torch.Tensor, y: torch.Tensor, *, solver: str = "cg",
                           **solve_kwargs) -> torch.Tensor:
    """∇F(x) = ∇_x f − ∇²_xy g [∇²_yy g]⁻¹ ∇_y f at an (approximate) inner solution y.

    `y` must solve the inner problem (∇_y g(x, y) ≈ 0): the formula assumes it. Keyword arguments go to
    `solve_adjoint` (solver "cg": tol, max_iter; "neumann": alpha, steps)."""
    check_vector("x", x)
    check_vector("y", y)
    x, y = x.detach(), y.detach()
    u = solve_adjoint(g, x, y, grad_y(f, x, y), solver=solver, **solve_kwargs)
    return grad_x(f, x, y) - cross_vjp(g, x, y, u)
