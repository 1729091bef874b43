"""Byzantine attacks as pure tensor functions.

Every model-poisoning attack has the shape
``attack(updates [n, d], byzantine BoolTensor[n], *, hyper..., generator=None) -> Tensor[n, d]``:
it returns a new tensor in which only the Byzantine rows are replaced; honest rows are copied untouched.
The Byzantine rows of ``updates`` hold what those clients computed honestly (sign-flip and scaling use
them); the omniscient attacks (ALIE, IPM) read the honest rows instead.

Data poisoning (label flipping) acts on labels before local training: :func:`flip_labels`.
"""
from __future__ import annotations

import functools
import inspect
import numbers
from statistics import NormalDist
from typing import Callable

import torch
from torch import Tensor

from .rules import _unknown


def _check(updates: Tensor, byzantine: Tensor) -> Tensor:
    """Validate shapes; return the mask as a bool tensor on the updates' device."""
    if not isinstance(updates, Tensor) or updates.dim() != 2 or not updates.is_floating_point():
        raise ValueError("updates must be a floating-point tensor of shape [n, d]")
    mask = torch.as_tensor(byzantine, device=updates.device)
    if mask.dtype != torch.bool or mask.shape != (updates.shape[0],):
        raise ValueError(f"byzantine must be a bool mask of shape [n] = [{updates.shape[0]}], got "
                         f"dtype {mask.dtype} and shape {tuple(mask.shape)}; build it with choose_byzantine(n, f)")
    return mask


def _honest(updates: Tensor, mask: Tensor, name: str) -> Tensor:
    if mask.all():
        raise ValueError(f"{name} is omniscient and needs at least one honest client; byzantine marks all rows")
    return updates[~mask]


def _replace(updates: Tensor, mask: Tensor, rows: Tensor) -> Tensor:
    """Copy of ``updates`` with the Byzantine rows set to ``rows`` ([d] broadcast, or [#byz, d])."""
    out = updates.clone()
    out[mask] = rows.to(updates.dtype)
    return out


def sign_flip(updates: Tensor, byzantine: Tensor, *, scale: float = 1.0, generator=None) -> Tensor:
    """Sign flipping: each Byzantine client sends −scale × its own honest update."""
    mask = _check(updates, byzantine)
    return _replace(updates, mask, -scale * updates[mask])


def scaled(updates: Tensor, byzantine: Tensor, *, scale: float = 10.0, generator=None) -> Tensor:
    """Boosted update: each Byzantine client sends scale × its own update (model-replacement style)."""
    mask = _check(updates, byzantine)
    return _replace(updates, mask, scale * updates[mask])


def gaussian_noise(updates: Tensor, byzantine: Tensor, *, std: float = 1.0, generator=None) -> Tensor:
    """Gaussian attack: each Byzantine row is replaced by pure noise N(0, std² I) (drawn on CPU from
    ``generator`` for reproducibility across devices)."""
    mask = _check(updates, byzantine)
    if std < 0:
        raise ValueError(f"gaussian_noise needs std >= 0, got {std}")
    noise = torch.randn((int(mask.sum()), updates.shape[1]), generator=generator, dtype=updates.dtype)
    return _replace(updates, mask, std * noise.to(updates.device))


def alie_z(n: int, f: int) -> float:
    """ALIE's z_max (Baruch et al. 2019): s = ⌊n/2 + 1⌋ − f supporters are needed, and
    z = Φ⁻¹((n − s) / n)."""
    s = n // 2 + 1 - f
    prob = (n - s) / n
    if not 0.0 < prob < 1.0:
        raise ValueError(f"ALIE's z_max is undefined for n={n}, f={f} (needs 1 <= n//2 + 1 - f < n); pass z explicitly")
    return NormalDist().inv_cdf(prob)


def alie(updates: Tensor, byzantine: Tensor, *, z: float | None = None, generator=None) -> Tensor:
    """A Little Is Enough (Baruch et al. 2019), omniscient: every Byzantine row becomes μ − z·σ, with μ, σ
    the per-coordinate mean and (population) standard deviation of the honest rows. ``z=None`` uses the
    paper's z_max from n and f (see :func:`alie_z`)."""
    mask = _check(updates, byzantine)
    honest = _honest(updates, mask, "alie")
    if z is None:
        z = alie_z(updates.shape[0], int(mask.sum()))
    return _replace(updates, mask, honest.mean(dim=0) - z * honest.std(dim=0, correction=0))


def ipm(updates: Tensor, byzantine: Tensor, *, epsilon: float = 0.1, generator=None) -> Tensor:
    """Inner-product manipulation (Xie, Koyejo, Gupta 2020), omniscient: every Byzantine row becomes
    −ε × the mean of the honest rows (small ε hides inside the honest spread; large ε flips the mean)."""
    mask = _check(updates, byzantine)
    return _replace(updates, mask, -epsilon * _honest(updates, mask, "ipm").mean(dim=0))


def no_attack(updates: Tensor, byzantine: Tensor, *, generator=None) -> Tensor:
    """Byzantine clients behave honestly (the f = 0 reference with the same client set)."""
    _check(updates, byzantine)
    return updates.clone()


def flip_labels(y: Tensor, num_classes: int) -> Tensor:
    """Label-flip data poisoning: y → C − 1 − y (Byzantine clients train on these labels)."""
    if not isinstance(num_classes, numbers.Integral) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
    y = torch.as_tensor(y)
    if y.is_floating_point() or (y.numel() and (y.min() < 0 or y.max() >= num_classes)):
        raise ValueError(f"y must hold integer labels in [0, {num_classes - 1}]")
    return num_classes - 1 - y


def choose_byzantine(n: int, f: int | float, generator: torch.Generator | None = None) -> Tensor:
    """Bool mask [n] marking f random clients as Byzantine. An int f is a count; a float f in [0, 1) is a
    fraction and the count is ⌊f·n⌋. Needs 0 ≤ count < n (at least one honest client)."""
    if not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if isinstance(f, bool) or not isinstance(f, (numbers.Integral, float)):
        raise ValueError(f"f must be an int count or a float fraction, got {f!r}")
    if isinstance(f, float):
        if not 0.0 <= f < 1.0:
            raise ValueError(f"a fractional f must be in [0, 1), got {f}; pass an int for a count")
        count = int(f * n)
    else:
        count = int(f)
    if not 0 <= count < n:
        raise ValueError(f"need 0 <= f < n so at least one client is honest, got f={count} of n={n}")
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=generator)[:count]] = True
    return mask


ATTACKS: dict[str, Callable[..., Tensor]] = {
    "none": no_attack,
    "sign_flip": sign_flip,
    "scaled": scaled,
    "gaussian_noise": gaussian_noise,
    "alie": alie,
    "ipm": ipm,
}


def get_attack(name: str, **hyper) -> Callable[..., Tensor]:
    """Attack ``name`` with hyperparameters bound: ``attack(updates, byzantine, generator=None)``."""
    if name not in ATTACKS:
        raise _unknown("attack", name, ATTACKS)
    attack = ATTACKS[name]
    allowed = [k for k, p in inspect.signature(attack).parameters.items()
               if p.kind is p.KEYWORD_ONLY and k != "generator"]
    wrong = [k for k in hyper if k not in allowed]
    if wrong:
        raise ValueError(f"attack {name!r} has no hyperparameter(s) {wrong}; valid: {allowed}")
    return functools.partial(attack, **hyper)
