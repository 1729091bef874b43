"""Adversarial examples as a client-side step: projected gradient descent (PGD) on the inputs.

Madry, Makelov, Schmidt, Tsipras, Vladu, "Towards Deep Learning Models Resistant to Adversarial Attacks",
ICLR 2018 (https://arxiv.org/abs/1706.06083): the inner maximisation max_{‖δ‖≤ε} ℓ(f(x + δ), y) is
approximated by a random start in the ε-ball, then `steps` ascent steps of size α (the sign of the input
gradient for ℓ∞, the normalised gradient for ℓ2), each followed by a projection back onto the ball and a
clip to the valid input range. Used per client inside local training by FAL (fedlab_nb/methods/more/fal.py) and
to score robust accuracy. Inputs are flat rows [B, D] in [0, 1]."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...models import param_spec, unflatten

NORMS = ("linf", "l2")


def model_fn(model: torch.nn.Module, theta: torch.Tensor):
    """x ↦ logits of `model` at the flat parameters θ (detached: PGD differentiates the input only)."""
    from torch.func import functional_call
    params = unflatten(theta.detach(), param_spec(model))
    return lambda x: functional_call(model, params, (x,))


def check_pgd_args(eps: float, alpha: float, steps: int, norm: str, who: str = "pgd") -> None:
    """ValueError naming the bad PGD parameter (`who`: whose parameters they are, for the message)."""
    if not eps >= 0:
        raise ValueError(f"{who}'s eps (the radius of the perturbation ball) must be >= 0, got {eps}")
    if not alpha >= 0:
        raise ValueError(f"{who}'s alpha (the PGD step size) must be >= 0, got {alpha}")
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ValueError(f"{who}'s steps (PGD steps) must be an integer >= 0, got {steps!r}")
    if norm not in NORMS:
        raise ValueError(f"{who}'s norm must be one of {NORMS}, got {norm!r}")


def _row_norms(v: torch.Tensor) -> torch.Tensor:
    return v.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *([1] * (v.dim() - 1)))


def project(x: torch.Tensor, x_adv: torch.Tensor, eps: float, norm: str = "linf", clip=(0.0, 1.0)) -> torch.Tensor:
    """x_adv moved back into the ε-ball around x (per row), then clipped to the input range (`clip=None`: none)."""
    delta = x_adv - x
    if norm == "linf":
        delta = delta.clamp(-eps, eps)
    else:
        delta = delta * (eps / _row_norms(delta)).clamp(max=1.0)
    out = x + delta
    return out if clip is None else out.clamp(*clip)


def random_start(x: torch.Tensor, eps: float, norm: str = "linf", generator=None, clip=(0.0, 1.0)) -> torch.Tensor:
    """A uniform draw from the ε-ball around each row (ℓ∞: per coordinate; ℓ2: uniform in the ball)."""
    if norm == "linf":
        delta = (2 * torch.rand(x.shape, generator=generator, dtype=x.dtype) - 1).to(x.device) * eps
    else:
        d = x[0].numel()
        direction = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
        radius = torch.rand((len(x),) + (1,) * (x.dim() - 1), generator=generator, dtype=x.dtype).to(x.device) ** (1 / d)
        delta = direction / _row_norms(direction) * radius * eps
    return project(x, x + delta, eps, norm, clip)


def pgd(model_fn, x: torch.Tensor, y: torch.Tensor, eps: float, alpha: float, steps: int, norm: str = "linf",
        generator: torch.Generator | None = None, loss_fn=F.cross_entropy, rand_init: bool = True,
        clip=(0.0, 1.0)) -> torch.Tensor:
    """PGD adversarial examples (detached) for the rows x with labels y.

    `model_fn(x) -> logits`; `loss_fn(logits, y, reduction="sum")` is ascended (a sum, so every row follows
    its own gradient). `generator` keys the random start (`rand_init=False`: start at x). eps = 0 returns x
    exactly. Every output lies in the ε-ball around x and, unless `clip=None`, in [0, 1]."""
    check_pgd_args(eps, alpha, steps, norm)
    x = x.detach()
    x_adv = random_start(x, eps, norm, generator, clip) if rand_init else x.clone()
    for _ in range(int(steps)):
        x_adv.requires_grad_(True)
        with torch.enable_grad():
            loss = loss_fn(model_fn(x_adv), y, reduction="sum")
            (grad,) = torch.autograd.grad(loss, x_adv)
        step = grad.sign() if norm == "linf" else grad / _row_norms(grad)
        x_adv = project(x, x_adv.detach() + alpha * step, eps, norm, clip)
    return x_adv.detach()


def robust_accuracy(model_fn, x: torch.Tensor, y: torch.Tensor, eps: float, alpha: float, steps: int,
                    restarts: int = 1, norm: str = "linf", generator: torch.Generator | None = None,
                    clip=(0.0, 1.0)) -> float:
    """Fraction of rows still classified correctly under every one of `restarts` random-start PGD attacks
    (a row counts as broken if any restart breaks it; clean mistakes count as broken)."""
    with torch.no_grad():
        correct = model_fn(x).argmax(1) == y
    for _ in range(int(restarts)):
        x_adv = pgd(model_fn, x, y, eps, alpha, steps, norm, generator, clip=clip)
        with torch.no_grad():
            correct &= model_fn(x_adv).argmax(1) == y
    return float(correct.float().mean())
