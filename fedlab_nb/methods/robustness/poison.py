"""Data poisoning as a hook of the engine: a client's training data transformed per round, no dataset copies.

`simulate(..., poison=p)` calls `p(k, round, x, y, generator)` on the training rows of every client in
`p.clients` each time one of its local jobs is built, and trains on what it returns; everyone else's rows,
and every test set, are untouched. The generator is keyed by (seed, POISON, round, client), so which rows a
client poisons is the same on every backend and after a resume. A poison with `evaluate(model, theta, fed)`
adds its columns to History at every evaluation — the attack success rate of a backdoor next to the clean
accuracy.

- `LabelFlip`: y → C − 1 − y on the poisoned clients (the label-flipping attack of the robustness chapter).
- `PixelTrigger`: a backdoor (Gu, Dolan-Gavitt, Garg, "BadNets", 2017; in FL: Bagdasaryan, Veit, Hua, Estrin,
  Shmatikov, "How To Backdoor Federated Learning", AISTATS 2020): a fixed pixel pattern stamped on a fraction of
  the poisoned clients' rows, relabelled as the target class. Its `evaluate` reports `asr`, the fraction of
  triggered test inputs of other classes that the global model puts in the target class.
Model replacement (Bagdasaryan et al.) is the message attack `fedlab_nb.methods.robustness.attacks.scaled` with
`scale = model_replacement_scale(...)`: the attacker's update boosted so that it survives averaging.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...engine.evaluate import evaluate
from .attacks import flip_labels


def _client_ids(clients) -> tuple:
    ids = tuple(sorted({int(k) for k in clients}))
    if not ids:
        raise ValueError("a poison needs at least one client id in `clients`, e.g. clients=(0, 1)")
    return ids


@dataclass(frozen=True)
class LabelFlip:
    """The poisoned clients train on y → C − 1 − y (every row, every round)."""
    clients: tuple
    num_classes: int

    def __post_init__(self):
        object.__setattr__(self, "clients", _client_ids(self.clients))

    def __call__(self, k, rnd, x, y, generator):
        return x, flip_labels(y, self.num_classes)


def corner_pattern(input_shape, size: int = 3) -> tuple:
    """Flat feature indices of a size × size square in the bottom-right corner of every channel: the usual
    pixel-pattern trigger, for inputs stored flat or as [C, H, W]."""
    shape = tuple(int(s) for s in input_shape)
    if len(shape) == 1:
        side = int(round(np.sqrt(shape[0])))
        if side * side != shape[0]:
            raise ValueError(f"input_shape {shape} is flat but not a square image; pass (C, H, W) or explicit indices")
        shape = (1, side, side)
    c, h, w = shape[-3:] if len(shape) >= 3 else (1, *shape)
    if not 1 <= size <= min(h, w):
        raise ValueError(f"size must be between 1 and {min(h, w)} for images of {h}×{w}, got {size}")
    grid = np.arange(c * h * w).reshape(c, h, w)
    return tuple(int(i) for i in grid[:, h - size:, w - size:].ravel())


@dataclass(frozen=True)
class PixelTrigger:
    """Backdoor: on the poisoned clients, a `fraction` of the rows (drawn anew each round) get the trigger
    (features at `pattern` set to `value`) and the label `target`."""
    clients: tuple
    target: int
    pattern: tuple
    value: float = 1.0
    fraction: float = 0.5

    def __post_init__(self):
        object.__setattr__(self, "clients", _client_ids(self.clients))
        object.__setattr__(self, "pattern", tuple(int(i) for i in self.pattern))
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction (of a poisoned client's rows to stamp) must be in (0, 1], got {self.fraction}")
        if not self.pattern:
            raise ValueError("pattern (the trigger's feature indices) is empty; build one with corner_pattern(input_shape)")

    def stamp(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(len(x), -1).clone()
        flat[:, list(self.pattern)] = self.value
        return flat.reshape(x.shape)

    def __call__(self, k, rnd, x, y, generator: np.random.Generator):
        n = len(y)
        rows = torch.as_tensor(generator.choice(n, max(1, int(round(self.fraction * n))), replace=False),
                               device=y.device)
        x, y = x.clone(), y.clone()
        x[rows] = self.stamp(x[rows])
        y[rows] = self.target
        return x, y

    def evaluate(self, model, theta, fed) -> dict:
        return {"asr": attack_success_rate(model, theta, fed.x_test, fed.y_test, self)}


@torch.no_grad()
def attack_success_rate(model, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, trigger: PixelTrigger) -> float:
    """Fraction of test inputs whose true class is not the target that, once triggered, are classified as the
    target by the model with parameters θ."""
    keep = y != trigger.target
    if not keep.any():
        raise ValueError(f"every test label is the target class {trigger.target}; the attack success rate is undefined")
    as_target = torch.full_like(y[keep], trigger.target)
    return evaluate(model, theta, trigger.stamp(x[keep]), as_target)[1]   # "accuracy" against the target label


def model_replacement_scale(clients_per_round: int, server_lr: float = 1.0) -> float:
    """Bagdasaryan et al.'s boost γ = n / η: with n clients averaged and server learning rate η, the
    attacker's update scaled by γ replaces the global model (`robustness.attacks.get_attack("scaled", scale=γ)`,
    passed to `simulate(attack=..., byzantine=...)`)."""
    if clients_per_round < 1 or not server_lr > 0:
        raise ValueError(f"clients_per_round must be >= 1 and server_lr > 0, got {clients_per_round}, {server_lr}")
    return clients_per_round / server_lr
