"""Plain `nn.Module` models and the module ↔ flat-vector helpers the engine moves parameters with.

Models take flat rows `[batch, D]` (how `Dataset` stores every input) and reshape inside when they need
an image. The plain models have no BatchNorm or dropout: local training is then a pure function of
(parameters, batch), which is what `torch.func` needs to vectorise clients. `mlp_bn` / `cnn_bn` add
BatchNorm (for FedBN); their running statistics are buffers, which the engine passes explicitly
(`buffer_spec`, `flatten_buffers`, `unflatten_buffers`) and trains on the loop backend only.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
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

    def representation(self, x):
        """The last hidden layer's activations (what MOON contrasts)."""
        return self.body[:-1](x)


class _MaxPool2x2(torch.autograd.Function):
    """2×2 max-pool, stride 2: the forward through torch's channels-last CPU kernel (3-8× faster than its NCHW one
    for a client's small batch), the backward through the NCHW kernel (faster there). Maxima and argmax are those
    of `F.max_pool2d` bit for bit (a max does no arithmetic, and both kernels keep the first maximum of a window),
    so training is unchanged; forward-mode (jvp) and vmap rules let `torch.func` use it (Per-FedAvg's HVPs)."""

    @staticmethod
    def forward(x):
        nhwc = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # strides that pick the channels-last kernel
        out, idx = F.max_pool2d(nhwc, 2, return_indices=True)
        return out.contiguous(), idx.contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(inputs[0], output[1])
        ctx.save_for_forward(output[1])

    @staticmethod
    def backward(ctx, grad_out, _):
        x, idx = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(grad_out.contiguous(), x, [2, 2], [2, 2], [0, 0],
                                                               [1, 1], False, idx)

    @staticmethod
    def jvp(ctx, x_tangent):
        (idx,) = ctx.saved_tensors
        return x_tangent.flatten(2).gather(2, idx.flatten(2)).view_as(idx), None

    @staticmethod
    def vmap(info, in_dims, x):
        if in_dims[0] is None:
            return _MaxPool2x2.apply(x), (None, None)
        x = x.movedim(in_dims[0], 0)  # clients × rows become one batch of images
        out, idx = _MaxPool2x2.apply(x.flatten(0, 1))
        return (out.unflatten(0, x.shape[:2]), idx.unflatten(0, x.shape[:2])), (0, 0)


class MaxPool2x2(nn.MaxPool2d):
    """`nn.MaxPool2d(2)` with the same results and a faster CPU forward for [N, C, H, W] float inputs (above)."""

    def __init__(self):
        super().__init__(2)

    def forward(self, x):
        if x.dim() != 4 or x.device.type != "cpu":
            return super().forward(x)
        return _MaxPool2x2.apply(x)[0]


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
            nn.Conv2d(c, channels[0], 5, padding=pad), nn.ReLU(), MaxPool2x2(),
            nn.Conv2d(channels[0], channels[1], 5, padding=pad), nn.ReLU(), MaxPool2x2())
        flat = channels[1] * (h // 4) * (w // 4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.head(self.features(x.reshape(x.shape[0], *self.input_shape)))

    def representation(self, x):
        """The last hidden layer's activations (what MOON contrasts)."""
        return self.head[:-1](self.features(x.reshape(x.shape[0], *self.input_shape)))


class _Representation(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.representation(x)


def representation(model: nn.Module, params: dict, x: torch.Tensor) -> torch.Tensor:
    """`model.representation(x)` (its penultimate layer, [B, h]) with parameters `params` (name → tensor),
    stateless like `functional_call` (works under torch.func's grad and vmap). Any module with a
    `representation(x)` method qualifies."""
    if not callable(getattr(model, "representation", None)):
        raise TypeError(f"{type(model).__name__} has no representation(x) method; use 'mlp' or 'cnn', or add one "
                        "returning the penultimate layer's activations")
    from torch.func import functional_call
    return functional_call(_Representation(model), {f"model.{k}": v for k, v in params.items()}, (x,))


# --- models with BatchNorm (FedBN) -----------------------------------------------------------------
class BatchNorm1dAnyBatch(nn.BatchNorm1d):
    """BatchNorm1d that also accepts a 1-row training batch (a client's last mini-batch of an epoch can
    hold one sample): that batch is normalised with the running statistics, which it leaves unchanged."""

    def forward(self, x):
        if self.training and x.shape[0] == 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return super().forward(x)


class MLPBN(nn.Module):
    """MLP with BatchNorm after every hidden Linear (Linear → BN → ReLU). Modules are named `fc{i}`,
    `bn{i}` and `head` (the last Linear), so FedBN's pattern `*bn*` selects exactly the BatchNorm tensors."""

    def __init__(self, in_features: int, num_classes: int, hidden=(200, 200)):
        super().__init__()
        sizes, layers = [in_features, *hidden], OrderedDict()
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers[f"fc{i}"], layers[f"bn{i}"], layers[f"relu{i}"] = nn.Linear(a, b), BatchNorm1dAnyBatch(b), nn.ReLU()
        self.body = nn.Sequential(layers)
        self.head = nn.Linear(sizes[-1], num_classes)

    def forward(self, x):
        return self.head(self.body(x))

    def representation(self, x):
        return self.body(x)


class CNNBN(nn.Module):
    """`CNN` with BatchNorm after each conv (BatchNorm2d) and after the hidden dense layer, as in FedBN's
    digit-classification CNN (narrower). Modules named `conv{i}`, `bn{i}`, `fc`, `head` (the last Linear)."""

    def __init__(self, input_shape, num_classes: int, channels=(16, 32), hidden: int = 128):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"CNNBN needs an image input_shape (C, H, W), got {input_shape}; use 'mlp_bn' for vectors")
        c, h, w = input_shape
        self.input_shape = tuple(input_shape)
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(c, channels[0], 5, padding=2)), ("bn0", nn.BatchNorm2d(channels[0])),
            ("relu0", nn.ReLU()), ("pool0", MaxPool2x2()),
            ("conv1", nn.Conv2d(channels[0], channels[1], 5, padding=2)), ("bn1", nn.BatchNorm2d(channels[1])),
            ("relu1", nn.ReLU()), ("pool1", MaxPool2x2()), ("flat", nn.Flatten()),
            ("fc", nn.Linear(channels[1] * (h // 4) * (w // 4), hidden)), ("bn2", BatchNorm1dAnyBatch(hidden)),
            ("relu2", nn.ReLU())]))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.features(x.reshape(x.shape[0], *self.input_shape)))

    def representation(self, x):
        return self.features(x.reshape(x.shape[0], *self.input_shape))


def make_model(name: str, input_shape, num_classes: int, **kwargs) -> nn.Module:
    """`"logreg"`, `"mlp"` (kwargs: hidden), `"cnn"`, `"mlp_bn"` / `"cnn_bn"` (with BatchNorm) for a data set's
    `input_shape` and class count."""
    d = math.prod(input_shape)
    if name in ("logreg", "logistic"):
        return LogisticRegression(d, num_classes)
    if name == "mlp":
        return MLP(d, num_classes, **kwargs)
    if name == "cnn":
        return CNN(input_shape, num_classes, **kwargs)
    if name == "mlp_bn":
        return MLPBN(d, num_classes, **kwargs)
    if name == "cnn_bn":
        return CNNBN(input_shape, num_classes, **kwargs)
    raise ValueError(f"unknown model {name!r}; choose 'logreg', 'mlp', 'cnn', 'mlp_bn' or 'cnn_bn' "
                     "(or pass an nn.Module)")


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


# --- buffers (BatchNorm running statistics) as one flat vector ------------------------------------
def buffer_spec(model: nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(name, shape, dtype) of every buffer (BatchNorm running mean / var / batch count); [] for the plain models."""
    return [(n, b.shape, b.dtype) for n, b in model.named_buffers()]


def flatten_buffers(model: nn.Module, dtype=torch.float32) -> torch.Tensor:
    """All buffers concatenated into one detached 1-D tensor of `dtype` (empty without buffers)."""
    bufs = [b.detach().reshape(-1).to(dtype) for b in model.buffers()]
    return torch.cat(bufs) if bufs else torch.zeros(0, dtype=dtype)


def unflatten_buffers(flat: torch.Tensor, spec) -> dict[str, torch.Tensor]:
    """Fresh tensors (copies, in each buffer's own dtype) from a flat buffer vector: a forward pass in
    training mode updates them in place, and `torch.cat` of them flattens them back."""
    out, i = {}, 0
    for name, shape, dtype in spec:
        n = math.prod(shape)
        out[name] = flat[i:i + n].reshape(shape).to(dtype, copy=True)
        i += n
    return out


def load_buffers(model: nn.Module, flat: torch.Tensor) -> nn.Module:
    """Copy a flat buffer vector into the model's buffers in place (returns the model)."""
    with torch.no_grad():
        for b, v in zip(model.buffers(), unflatten_buffers(flat, buffer_spec(model)).values()):
            b.copy_(v)
    return model
