"""LoRA for the project's own models (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
ICLR 2022, https://arxiv.org/abs/2106.09685): a frozen linear layer plus a trainable low-rank update,

    y = W₀ x + b₀ + (α / r) · B A x,        A ∈ ℝ^{r×k},  B ∈ ℝ^{d×r},  W₀ ∈ ℝ^{d×k},

with A Kaiming-uniform (a = √5, the initialisation of `peft`'s default `init_lora_weights=True`) and B = 0,
so the wrapped model starts as the pre-trained one. `add_lora(model, rank, alpha, targets)` returns a copy
in which every targeted `nn.Linear` is a `LoRALinear` and *every other parameter is a buffer*: the
model's parameters are then exactly the LoRA factors (`<layer>.lora_A`, `<layer>.lora_B`, in layer order),
so `flatten_params` / the engine's θ hold only them, and `torch.func.functional_call(model, {name: A or B},
x)` runs the frozen base with any A, B (e.g. per-sample or per-client under `vmap`).

`peft` (LoraConfig / get_peft_model) is the reference for the same computation (cross-checked in
tests/test_fedsvd.py when it is installed); this module is the small dependency-free version the engine can
flatten. Parameter names differ: ours are `body.0.lora_A`, peft's `base_model.model.body.0.lora_A.default.weight`.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LoRALinear(nn.Module):
    """`base` (an nn.Linear, frozen: its weight and bias become buffers) plus (α/r)·B A."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None):
        super().__init__()
        d, k = base.out_features, base.in_features
        check_rank(rank, d, k, name=f"Linear({k}, {d})")
        self.register_buffer("weight", base.weight.detach().clone())
        self.register_buffer("bias", None if base.bias is None else base.bias.detach().clone())
        self.rank, self.alpha, self.scaling = int(rank), float(alpha), float(alpha) / int(rank)
        a = torch.empty(rank, k, dtype=base.weight.dtype)
        bound = 1.0 / math.sqrt(k)  # kaiming_uniform_(a=√5) on [r, k]: U(−1/√k, 1/√k)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(d, rank, dtype=base.weight.dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + self.scaling * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def merged_weight(self) -> Tensor:
        """W₀ + (α/r)·B A: the dense weight this layer computes with."""
        return self.weight + self.scaling * self.lora_B @ self.lora_A

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, rank={self.rank}, alpha={self.alpha:g}"


def check_rank(rank, d: int, k: int, name: str = "layer") -> int:
    """A LoRA rank is an int with 1 ≤ r ≤ min(d, k) (beyond min(d, k) B A cannot gain rank)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(d, k):
        raise ValueError(f"rank must be an int in 1 … min(out, in) = {min(d, k)} for {name}, got {rank!r}; "
                         "lower the rank or adapt a wider layer")
    return rank


def _freeze_to_buffers(module: nn.Module) -> None:
    """Turn every parameter of `module` (not of its children) into a buffer of the same name."""
    for name, p in list(module._parameters.items()):
        del module._parameters[name]
        module.register_buffer(name, None if p is None else p.detach().clone())


def add_lora(model: nn.Module, rank: int = 4, alpha: float | None = None, targets=None, seed: int = 0) -> nn.Module:
    """A copy of `model` with LoRA on the `nn.Linear` layers named in `targets` (module names, e.g.
    ["body.0", "body.2"]; None: every Linear but the last one, i.e. the hidden layers of an MLP) and every
    other parameter frozen as a buffer. `alpha` defaults to `rank` (scaling α/r = 1, the FedSVD
    repository's r = α = 8). A is drawn from `seed`."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to adapt")
    targets = linears[:-1] if targets is None else list(targets)
    if not targets:
        raise ValueError("targets is empty: the model has one Linear layer; pass targets=[its name] to adapt it")
    unknown = [t for t in targets if t not in linears]
    if unknown:
        raise ValueError(f"targets {unknown} are not nn.Linear modules of the model; choose from {linears}")
    alpha = float(rank if alpha is None else alpha)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (the LoRA scaling is alpha / rank), got {alpha!r}")
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(int(seed))
    for name in targets:  # in the model's module order, so θ's layout is the layer order
        parent_name, _, child = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, generator=g))
    for m in out.modules():
        if not isinstance(m, LoRALinear):
            _freeze_to_buffers(m)
    return out


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """name → LoRALinear of a model built by `add_lora`, in module order."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA layers; wrap it with fedlab_nb.lora.add_lora(model, rank)")
    return layers


@dataclass(frozen=True)
class LoRALayout:
    """Where each layer's A [r, k] and B [d, r] sit in the flat parameter vector θ of an `add_lora` model
    (the order of `named_parameters`: layer 0's A, layer 0's B, layer 1's A, ...)."""
    names: tuple       # layer names
    shapes: tuple      # ((d, k, r), ...) per layer
    scalings: tuple    # α/r per layer

    @classmethod
    def of(cls, model: nn.Module) -> "LoRALayout":
        layers = lora_layers(model)
        spec = [n for n, _ in model.named_parameters()]
        expected = [f"{n}.{p}" for n in layers for p in ("lora_A", "lora_B")]
        if spec != expected:
            raise ValueError(f"the model's parameters {spec} are not exactly the LoRA factors {expected}; "
                             "build it with fedlab_nb.lora.add_lora")
        return cls(tuple(layers), tuple((m.weight.shape[0], m.weight.shape[1], m.rank) for m in layers.values()),
                   tuple(m.scaling for m in layers.values()))

    @property
    def size(self) -> int:
        return sum(r * k + d * r for d, k, r in self.shapes)

    def split(self, theta: Tensor) -> list[tuple[Tensor, Tensor]]:
        """[(A_l, B_l), ...] views of θ (or of rows [..., size]: leading dims kept)."""
        if theta.shape[-1] != self.size:
            raise ValueError(f"theta has {theta.shape[-1]} entries but the LoRA layout has {self.size}")
        out, i, lead = [], 0, theta.shape[:-1]
        for d, k, r in self.shapes:
            a = theta[..., i:i + r * k].reshape(*lead, r, k)
            i += r * k
            b = theta[..., i:i + d * r].reshape(*lead, d, r)
            i += d * r
            out.append((a, b))
        return out

    def join(self, factors) -> Tensor:
        """Inverse of `split`: [(A_l, B_l), ...] → flat θ (leading dims kept)."""
        parts = []
        for a, b in factors:
            parts += [a.reshape(*a.shape[:-2], -1), b.reshape(*b.shape[:-2], -1)]
        return torch.cat(parts, dim=-1)

    def b_only(self, theta: Tensor) -> Tensor:
        """The B factors of θ (rows) concatenated: what FedSVD / FFA-LoRA clients send."""
        return torch.cat([b.reshape(*b.shape[:-2], -1) for _, b in self.split(theta)], dim=-1)

    def split_b(self, flat_b: Tensor) -> list[Tensor]:
        """Inverse of `b_only`: [B_l, ...] from their concatenation (leading dims kept)."""
        out, i, lead = [], 0, flat_b.shape[:-1]
        for d, _, r in self.shapes:
            out.append(flat_b[..., i:i + d * r].reshape(*lead, d, r))
            i += d * r
        return out

    def params(self, theta: Tensor) -> dict[str, Tensor]:
        """{"<layer>.lora_A": A, "<layer>.lora_B": B} for `functional_call`."""
        out = {}
        for name, (a, b) in zip(self.names, self.split(theta)):
            out[f"{name}.lora_A"], out[f"{name}.lora_B"] = a, b
        return out
