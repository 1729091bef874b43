"""Unrolled and truncated hypergradients through T inner gradient steps.

The inner solver is gradient descent y_{t+1} = Φ(x, y_t) = y_t − η ∇_y g(x, y_t), t = 0 … T−1. Reverse-mode
differentiation of F_T(x) = f(x, y_T) gives

    h_T = ∇_x f(x, y_T) + Σ_{t=0}^{T−1} B_t A_{t+1} ⋯ A_{T−1} ∇_y f(x, y_T),
    A_t = I − η ∇²_yy g(x, y_t),   B_t = −η ∇²_xy g(x, y_t),

and K-step truncated back-propagation (K-RMD) keeps only the terms t ≥ T − K, so it stores the last K
iterates instead of T (Shaban, Cheng, Hatch, Boots, "Truncated Back-propagation for Bilevel
Optimization", AISTATS 2019, https://arxiv.org/abs/1810.10667). `truncated_hypergradient` is that
backward recursion with Hessian-vector products; `autograd_unrolled_hypergradient` is the same quantity
by plain autograd through the loop (the reference, and what the memory meter measures)."""
from __future__ import annotations

import torch

from fedlab_nb.core.registry import register

from .derivatives import Objective, check_vector, cross_vjp, grad_x, grad_y, hvp_yy


def _check_steps(steps: int, keep: int | None = None) -> None:
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0 (the number T of inner steps), got {steps!r}")
    if keep is not None and not (isinstance(keep, int) and 0 <= keep <= steps):
        raise ValueError(f"keep must be an int with 0 <= keep <= steps = {steps} (the K of K-RMD), got {keep!r}")


def inner_gd(g: Objective, x: torch.Tensor, y0: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
    """y_T after `steps` gradient steps y ← y − lr ∇_y g(x, y) from y0 (no graph kept)."""
    _check_steps(steps)
    y = y0.detach()
    x = x.detach()
    for _ in range(steps):
        y = y - lr * grad_y(g, x, y)
    return y


def unroll(g: Objective, x: torch.Tensor, y0: torch.Tensor, lr: float, steps: int, keep: int):
    """Run `steps` inner GD steps and return (y_T, [y_{T−keep}, …, y_{T−1}]): the iterates K-RMD stores."""
    _check_steps(steps, keep)
    y = inner_gd(g, x, y0, lr, steps - keep)
    stored = []
    for _ in range(keep):
        stored.append(y)
        y = y - lr * grad_y(g, x.detach(), y)
    return y, stored


def backprop_last(f: Objective, g: Objective, x: torch.Tensor, y_final: torch.Tensor, stored: list,
                  lr: float) -> torch.Tensor:
    """The reverse recursion of K-RMD over the stored iterates: h = ∇_x f + Σ B_t α_t, α ← A_t α."""
    return backprop_path(f, g, x, y_final, stored, lr)[-1]


def backprop_path(f: Objective, g: Objective, x: torch.Tensor, y_final: torch.Tensor, stored: list,
                  lr: float) -> torch.Tensor:
    """Every partial sum of the K-RMD recursion: row k is h_k (k = 0 … len(stored)), one backward pass."""
    x = x.detach()
    h, alpha = grad_x(f, x, y_final), grad_y(f, x, y_final)
    path = [h]
    for y_t in reversed(stored):
        h = h - lr * cross_vjp(g, x, y_t, alpha)
        alpha = alpha - lr * hvp_yy(g, x, y_t, alpha)
        path.append(h)
    return torch.stack(path)


def truncation_path(f: Objective, g: Objective, x: torch.Tensor, y0: torch.Tensor, *, lr: float,
                    steps: int) -> torch.Tensor:
    """h_K for every K = 0 … T at once ([T + 1, d_x]): row K is `truncated_hypergradient(..., keep=K)`."""
    check_vector("x", x)
    check_vector("y0", y0)
    y_final, stored = unroll(g, x, y0, lr, steps, steps)
    return backprop_path(f, g, x, y_final, stored, lr)


@register("hypergradients", claims="hypergradients", kind="module")
def truncated_hypergradient(f: Objective, g: Objective, x: torch.Tensor, y0: torch.Tensor, *, lr: float,
                            steps: int, keep: int) -> torch.Tensor:
    """K-step truncated back-propagation (K = `keep`) through `steps` = T inner GD steps from y0.

    keep = steps is full reverse-mode unrolling; keep = 0 drops the implicit term (∇_x f only)."""
    check_vector("x", x)
    check_vector("y0", y0)
    if not lr > 0:
        raise ValueError(f"lr must be > 0 (the inner step size η), got {lr}")
    y_final, stored = unroll(g, x, y0, lr, steps, keep)
    return backprop_last(f, g, x, y_final, stored, lr)


def unrolled_hypergradient(f: Objective, g: Objective, x: torch.Tensor, y0: torch.Tensor, *, lr: float,
                           steps: int) -> torch.Tensor:
    """Full reverse-mode unrolling through all T inner steps (truncated back-propagation with K = T)."""
    return truncated_hypergradient(f, g, x, y0, lr=lr, steps=steps, keep=steps)


def autograd_unrolled_hypergradient(f: Objective, g: Objective, x: torch.Tensor, y0: torch.Tensor, *, lr: float,
                                    steps: int, keep: int | None = None) -> torch.Tensor:
    """The same hypergradient by torch.autograd through the loop (a graph of the last `keep` steps).

    The iterates before step T − keep are detached, which is what "back-propagate through the last K steps"
    means in an autodiff framework. Default keep = steps (full unrolling)."""
    check_vector("x", x)
    check_vector("y0", y0)
    keep = steps if keep is None else keep
    _check_steps(steps, keep)
    x_ = x.detach().clone().requires_grad_(True)
    y = y0.detach()
    for _ in range(steps - keep):  # plain autograd (not torch.func), so SavedTensorMeter can watch this call
        y = y.detach().requires_grad_(True)
        y = (y - lr * torch.autograd.grad(g(x_.detach(), y), y)[0]).detach()
    y = y.requires_grad_(True)
    for _ in range(keep):
        (gy,) = torch.autograd.grad(g(x_, y), y, create_graph=True)
        y = y - lr * gy
    (h,) = torch.autograd.grad(f(x_, y), x_)
    return h


class SavedTensorMeter:
    """Measure the bytes autograd keeps for backward: live (and peak) size of the saved tensors.

    A `torch.autograd.graph.saved_tensors_hooks` context: each tensor the graph saves is wrapped, counted
    while the wrapper lives (i.e. while the graph holds it) and uncounted when the graph frees it. torch.func
    transforms refuse saved-tensor hooks, so it watches plain-autograd code only (the unrolled reference)."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.total = 0

    def _pack(self, t):
        return _Saved(t, self)

    @staticmethod
    def _unpack(box):
        return box.tensor

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class _Saved:
    __slots__ = ("tensor", "meter", "nbytes")

    def __init__(self, tensor, meter):
        self.tensor, self.meter = tensor, meter
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.live += self.nbytes
        meter.total += self.nbytes
        meter.peak = max(meter.peak, meter.live)

    def __del__(self):
        self.meter.live -= self.nbytes
