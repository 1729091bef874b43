"""Client optimisers as in-place elementwise updates.

An update touches each parameter tensor elementwise, so the same code updates one client's tensor (the
`loop` backend) or a stacked `[clients, ...]` slice of many (the `vmap` backend) with identical results.
State tensors have the parameter's shape; the step counter `t` is per client (`[clients]` or scalar).

    SGD:       g ← g + λw;  b ← μb + g (μ > 0; b₀ = g);  w ← w − η (g + μb if nesterov else b)
    Adam(W):   m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;  w ← w − η m̂ / (√v̂ + ε)   (decoupled λ for AdamW)
These follow `torch.optim.SGD` / `torch.optim.Adam` / `torch.optim.AdamW` step for step (tests check it)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def client_lr(optimizer, run_lr: float) -> float:
    """The clients' step size: the client optimiser's own `lr`, else the run's. The one route: the kernels, the
    objectives' `finish` (SCAFFOLD's control variate), `RoundInfo.lr` and `LocalContext.lr` all read this value."""
    return run_lr if optimizer is None or optimizer.lr is None else optimizer.lr


@dataclass
class SGD:
    lr: float | None = None      # None: the run's `lr`
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"SGD(lr=...) must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError(f"SGD needs momentum in [0, 1) and weight_decay >= 0, got {self.momentum}, {self.weight_decay}")
        if self.nesterov and not self.momentum:
            raise ValueError("SGD(nesterov=True) needs momentum > 0")

    @property
    def plain(self) -> bool:
        return not self.momentum and not self.weight_decay

    def state_names(self) -> tuple:
        return ("buf",) if self.momentum else ()

    def step_(self, w: torch.Tensor, g: torch.Tensor, state: dict, t: torch.Tensor, lr: float):
        """One step on tensor w in place (g may be modified); `state` holds this tensor's buffers."""
        if self.weight_decay:
            g = g.add(w, alpha=self.weight_decay)
        if self.momentum:
            buf = state["buf"]
            first = _expand(t == 1, buf)
            buf.copy_(torch.where(first, g, buf * self.momentum + g))  # torch.optim: b₁ = g, no dampening
            g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
        w.sub_(g, alpha=lr)


@dataclass
class Adam:
    lr: float | None = None
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False      # True: AdamW

    def __post_init__(self):
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1) or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"Adam needs betas in [0, 1), eps > 0, weight_decay >= 0; got {self.betas}, {self.eps}, "
                             f"{self.weight_decay}")

    plain = False

    def state_names(self) -> tuple:
        return ("m", "v")

    def step_(self, w, g, state, t, lr):
        b1, b2 = self.betas
        if self.weight_decay and self.decoupled:
            w.mul_(1 - lr * self.weight_decay)
        elif self.weight_decay:
            g = g.add(w, alpha=self.weight_decay)
        m, v = state["m"], state["v"]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        if torch.as_tensor(t).dim() == 0:  # one step count for all clients: torch.optim's form, fewer passes
            t = float(t)
            denom = v.sqrt().div_(math.sqrt(1 - b2 ** t)).add_(self.eps)
            w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
            return
        tt = _expand(t.to(w.dtype), w)
        c1, c2 = 1 - b1 ** tt, 1 - b2 ** tt
        w.sub_(lr * (m / c1) / ((v / c2).sqrt() + self.eps))


def _expand(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-client [c] tensor shaped to broadcast against a [c, ...] tensor (a scalar stays a scalar)."""
    return x.reshape(x.shape + (1,) * (like.dim() - x.dim())) if x.dim() else x


def make_optimizer(opt) -> SGD | Adam:
    """None → plain SGD; "sgd" / "adam" / "adamw"; or an SGD / Adam instance."""
    if opt is None or opt == "sgd":
        return SGD()
    if opt == "adam":
        return Adam()
    if opt == "adamw":
        return Adam(weight_decay=0.01, decoupled=True)
    if isinstance(opt, (SGD, Adam)):
        return opt
    raise ValueError(f"client optimizer must be 'sgd', 'adam', 'adamw', SGD(...) or Adam(...), got {opt!r}")
