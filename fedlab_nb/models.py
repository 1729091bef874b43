"""Plain `nn.Module` models and the module ↔ flat-vector helpers the engine moves parameters with.

Models take flat rows `[batch, D]` (how `Dataset` stores every input) and reshape inside when they need
an image. No BatchNorm or dropout: local training is then a pure function of (parameters, batch),
which is what `torch.func` needs to vectorise clients.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class LogisticRegression(nn.Module):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.linear(x)


class MLP(nn.Module):
    """Fully connected ReLU network, e.g. `MLP(784, 10, hidden=(200, 200))` — McMahan et al.'s 2NN."""

    def __init__(self, in_features: int, num_classes: int, hidden=(200, 200)):
        super().__init__()
        sizes = [in_features, *hidden]
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(sizes[-1], num_classes))

    def forward(self, x):
        return self.body(x)


class CNN(nn.Module):
    """Two 5×5 conv + max-pool blocks and two dense layers (McMahan et al.'s CNN, narrower), for C×H×W
    inputs stored flat. Works for 28×28 (MNIST-like) and 8×8 (digits) images."""

    def __init__(self, input_shape, num_classes: int, channels=(16, 32), hidden: int = 128):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"CNN needs an image input_shape (C, H, W), got {input_shape}; use 'mlp' for vectors")
        c, h, w = input_shape
        self.input_shape = tuple(input_shape)
        pad = 2
        self.features = nn.Sequential(
            nn.Conv2d(c, channels[0], 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels[0], channels[1], 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2))
        flat = channels[1] * (h // 4) * (w // 4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.head(self.features(x.reshape(x.shape[0], *self.input_shape)))


def make_model(name: str, input_shape, num_classes: int, **kwargs) -> nn.Module:
    """`"logreg"`, `"mlp"` (kwargs: hidden), `"cnn"` for a data set's `input_shape` and class count."""
    d = math.prod(input_shape)
    if name in ("logreg", "logistic"):
        return LogisticRegression(d, num_classes)
    if name == "mlp":
        return MLP(d, num_classes, **kwargs)
    if name == "cnn":
        return CNN(input_shape, num_classes, **kwargs)
    raise ValueError(f"unknown model {name!r}; choose 'logreg', 'mlp' or 'cnn' (or pass an nn.Module)")


# --- parameters as one flat vector ---------------------------------------------------------------
def param_spec(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every parameter in a stable order: the layout of the flat vector."""
    return [(n, p.shape) for n, p in model.named_parameters()]


def flatten_params(model: nn.Module) -> torch.Tensor:
    """All parameters concatenated into one detached 1-D tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def unflatten(flat: torch.Tensor, spec) -> dict[str, torch.Tensor]:
    """Views of `flat` shaped as the model's parameters (differentiable; works under `vmap`)."""
    total = sum(math.prod(shape) for _, shape in spec)
    if total != flat.shape[-1]:
        raise ValueError(f"flat vector has {flat.shape[-1]} entries but the model has {total} parameters")
    out, i = {}, 0
    for name, shape in spec:
        n = math.prod(shape)
        out[name] = flat[i:i + n].view(shape)
        i += n
    return out


def load_flat(model: nn.Module, flat: torch.Tensor) -> nn.Module:
    """Copy a flat vector into the model's parameters in place (returns the model)."""
    with torch.no_grad():
        for p, v in zip(model.parameters(), unflatten(flat, param_spec(model)).values()):
            p.copy_(v)
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
