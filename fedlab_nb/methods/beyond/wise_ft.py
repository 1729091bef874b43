"""WiSE-FT and BANG: weight-space ensembles of a pretrained and a fine-tuned model, and diverse spurious features.

WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022, https://arxiv.org/abs/2109.01903)
interpolates θ(α) = (1 − α)·θ₀ + α·θ₁ between a pretrained θ₀ and its fine-tuned θ₁. Lin et al., "Spurious Feature
Diversification Improves Out-of-distribution Generalization", ICLR 2024 (https://arxiv.org/abs/2309.17230), find
that under shift θ(α) corrects many inputs on which *both* endpoints are wrong ("FalseFalseTrue"): the two models
rely on different spurious features, and the mix weakens each one. An overconfident θ₁ dominates the mix; BANG
("BAlaNced averaGing") fine-tunes θ₁ with MixUp and label smoothing before averaging.

This module builds a "MultiColor digits" toy (our construction, after the paper's MultiColorMNIST: digit pixels
plus one-hot spurious "colour" blocks whose colour follows the label in some blocks), counts FFT / TTF cases, sweeps
α, gives BANG's fine-tuning data and loss for `merging.fit`, and a temperature-scaling control. Training,
interpolation and scoring are `fedlab_nb.merging` (not rewritten here).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ... import merging
from ...core.registry import register
from ...models import param_spec

ALPHAS = tuple(round(0.1 * i, 1) for i in range(11))  # the WiSE-FT sweep α ∈ {0, 0.1, …, 1}


# --- the MultiColor digits toy ----------------------------------------------------------------------
def multicolor_digits(x: torch.Tensor, y: torch.Tensor, *, informative: Sequence[int], blocks: int = 8,
                      colours: int = 10, p: float = 0.8, generator: torch.Generator) -> torch.Tensor:
    """Append `blocks` one-hot colour blocks (`colours` values each) to the image rows x.

    In each block listed in `informative` a row's colour is its label (mod `colours`) with probability p and a
    uniformly random colour otherwise; every other block is uniformly random. `informative=()` gives the OOD rows
    on which no spurious block carries information."""
    if not 0 <= p <= 1:
        raise ValueError(f"p (the probability that an informative block shows the label's colour) must be in [0, 1], got {p}")
    if any(not 0 <= b < blocks for b in informative):
        raise ValueError(f"informative must list block indices in [0, {blocks}), got {list(informative)}")
    n = len(x)
    colour = torch.randint(colours, (n, blocks), generator=generator)
    follow = torch.rand(n, blocks, generator=generator) < p
    mask = torch.zeros(blocks, dtype=torch.bool)
    mask[list(informative)] = True
    colour = torch.where(follow & mask, (y % colours)[:, None], colour)
    return torch.cat([x, F.one_hot(colour, colours).reshape(n, -1).to(x.dtype)], 1)


# --- WiSE-FT: the α sweep and the FFT / TTF counts -----------------------------------------------------------
@register("wise_ft", claims="wise_ft", kind="module")
def wise_ft_curve(model: torch.nn.Module, theta0: torch.Tensor, theta1: torch.Tensor, x: torch.Tensor,
                  y: torch.Tensor, alphas: Sequence[float] = ALPHAS) -> list[float]:
    """Accuracy on (x, y) of θ(α) = (1 − α)θ₀ + αθ₁ for each α (WiSE-FT's weight-space ensemble)."""
    return [merging.accuracy(merging.predict_proba(model, merging.interpolate(theta0, theta1, a), x), y)
            for a in alphas]


def fft_ttf(model: torch.nn.Module, theta0: torch.Tensor, theta1: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
            alpha: float = 0.5) -> dict[str, int]:
    """Counts of (θ₀ right?, θ₁ right?, θ(α) right?) patterns: "FFT" = both endpoints wrong and the mix right,
    "TTF" = both right and the mix wrong (Lin et al.'s FalseFalseTrue / TrueTrueFalse)."""
    right = [merging.predict_proba(model, th, x).argmax(1) == y
             for th in (theta0, theta1, merging.interpolate(theta0, theta1, alpha))]
    r0, r1, rm = right
    return {"FFT": int((~r0 & ~r1 & rm).sum()), "TTF": int((r0 & r1 & ~rm).sum()),
            "FF": int((~r0 & ~r1).sum()), "TT": int((r0 & r1).sum())}


def overconfident_alpha(alpha: float, c: float) -> float:
    """Scaling θ₁'s logits by c > 0 turns the logit mix at α into the unscaled mix at α′ = αc / (1 − α + αc)
    (up to a positive factor, so the argmax is the same): an overconfident θ₁ (c > 1) acts as a larger α."""
    if not c > 0 or not 0 <= alpha <= 1:
        raise ValueError(f"need c > 0 and alpha in [0, 1], got c={c}, alpha={alpha}")
    return alpha * c / (1 - alpha + alpha * c)


# --- BANG: MixUp + label smoothing fine-tuning ---------------------------------------------------------------
def mixup_targets(x: torch.Tensor, y: torch.Tensor, num_classes: int, *, copies: int = 1, beta: float = 0.2,
                  smoothing: float = 0.1, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`copies` MixUp draws of the data set (Zhang et al., ICLR 2018): rows λx_i + (1 − λ)x_j with λ ~ Beta(β, β)
    and the same mix of the label-smoothed targets (1 − ε)·onehot + ε/C (Szegedy et al., CVPR 2016).

    Returns (x_mix, soft targets) of copies·n rows; one pass of `merging.fit(..., loss_fn=soft_cross_entropy)`
    over them is `copies` epochs of MixUp training."""
    if not beta > 0 or not 0 <= smoothing < 1 or copies < 1:
        raise ValueError(f"need beta > 0, smoothing in [0, 1) and copies >= 1, got {beta}, {smoothing}, {copies}")
    soft = (1 - smoothing) * F.one_hot(y, num_classes).to(x.dtype) + smoothing / num_classes
    xs, ts = [], []
    for _ in range(copies):
        j = torch.from_numpy(rng.permutation(len(x)))
        lam = torch.from_numpy(rng.beta(beta, beta, (len(x), 1))).to(x.dtype)
        xs.append(lam * x + (1 - lam) * x[j])
        ts.append(lam * soft + (1 - lam) * soft[j])
    return torch.cat(xs), torch.cat(ts)


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against soft targets (rows summing to 1): the loss BANG's fine-tuning minimises."""
    return -(targets * torch.log_softmax(logits, -1)).sum(-1).mean()


@register("bang", claims="wise_ft", kind="module")
def bang_finetune(model: torch.nn.Module, theta0: torch.Tensor, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                  *, epochs: int, lr: float, batch_size: int, beta: float = 0.2, smoothing: float = 0.1,
                  seed: int = 0) -> torch.Tensor:
    """BANG's fine-tuned endpoint: θ₀ fine-tuned with MixUp + label smoothing (then averaged as WiSE-FT)."""
    rng = np.random.default_rng(int(seed))
    xm, tm = mixup_targets(x, y, num_classes, copies=epochs, beta=beta, smoothing=smoothing, rng=rng)
    return merging.fit(model, theta0, xm, tm, epochs=1, lr=lr, batch_size=batch_size, optimizer="adam",
                       loss_fn=soft_cross_entropy, seed=seed)


# --- the control: temperature-scale a plain θ₁ ---------------------------------------------------------------
def scale_last_layer(model: torch.nn.Module, theta: torch.Tensor, temperature: float) -> torch.Tensor:
    """θ with the last layer's weight and bias divided by T: the model's logits divided by T exactly (the last
    layer is linear), i.e. temperature scaling written into the weights so that it can be averaged."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out, i = theta.clone(), 0
    spec = param_spec(model)
    sizes = [s.numel() for _, s in spec]
    last = spec[-1][0].rsplit(".", 1)[0]  # the module owning the last parameter
    for (name, _), n in zip(spec, sizes):
        if name.rsplit(".", 1)[0] == last:
            out[i:i + n] = theta[i:i + n] / temperature
        i += n
    return out


def fit_temperature(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                    grid: Sequence[float] = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)) -> float:
    """The T of `grid` with the lowest NLL of the scaled model on (x, y) (Guo et al., ICML 2017)."""
    return min(grid, key=lambda t: merging.nll(merging.predict_proba(model, scale_last_layer(model, theta, t), x), y))
