"""InCo Aggregation — Chan, Zhou, Zhao, Jiang, Ngai, "Internal Cross-layer Gradients for Extending Homogeneity
to Heterogeneity in Federated Learning", ICLR 2024 (arXiv 2308.11464). Official code:
https://github.com/ChanYunHin/InCo-Aggregation (`fed_experiments/InCo/utils.py`, `aggregate_IN_gradients`).

With clients of different depths, the deep layers are trained by fewer clients and their updates agree less
across clients than the shallow layers' do. InCo edits the server's aggregated update (pseudo-gradient) g before
the server step: each deep layer k is paired with a shallow layer 0 of the same shape (in the official ResNet,
the first block of the same stage) and its update becomes the internal cross-layer gradient

    β  = clip(|⟨g₀, g_k⟩| / ⟨g₀, g₀⟩, 0, β_max)            (the convex problem's coefficient)
    g_k ← (g_k/‖g_k‖ + β g₀/‖g₀‖) · (‖g_k‖ + ‖g₀‖)/2         (normalised mix, rescaled to the mean norm)
    g_k ← clip(g_k, −c, c) elementwise                         (the code's guard against unstable steps)

β is the magnitude of the minimiser of the convex problem min_β ‖g_k + β g₀‖² (β* = −⟨g₀, g_k⟩/‖g₀‖², the
dual of the projection min_g ½‖g − g_k‖² s.t. ⟨g, g₀⟩ ≥ 0 when the two conflict); the official code takes |β*|,
clamps it to [0, β_max = 5] (`--clamp_max`) and clips the result to ±0.1; both are parameters here. Nothing is
communicated: it is a server-side step, so it composes with any base method (FedAvg, FedProx, SCAFFOLD, FedNova,
MOON) through `InCoStep`, a wrapper of the base method's server optimiser.

For `ResidualMLP` (hetero_depth.py) every block j ≥ 1 is paired with block 0, as the official code pairs every
later block of a stage with the stage's first; the norms are per weight matrix (the code normalises each 3×3
kernel of a conv, and whole tensors in its ViT variant); biases are left alone unless `include_bias=True` (the
official ResNet convolutions have none).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ...core.method import Method, ServerSGD
from ...core.registry import get_method, register
from .hetero_depth import DepthLayout, ResidualMLP, depth_groups, hetero_depth

EPS = 1e-7  # the official code's guard against dividing by a zero norm


def cross_layer_coefficient(g_deep: torch.Tensor, g_shallow: torch.Tensor, beta_max: float = 5.0) -> torch.Tensor:
    """β = clip(|⟨g₀, g_k⟩| / (⟨g₀, g₀⟩ + ε), 0, β_max): the size of the minimiser of ‖g_k + β g₀‖²."""
    return ((g_shallow * g_deep).sum().abs() / ((g_shallow * g_shallow).sum() + EPS)).clamp(0, beta_max)


def cross_layer_gradient(g_deep: torch.Tensor, g_shallow: torch.Tensor, beta_max: float = 5.0,
                         clip: float | None = 0.1) -> torch.Tensor:
    """The internal cross-layer gradient of a deep layer from its own update and a shallow layer's (same shape)."""
    if g_deep.shape != g_shallow.shape:
        raise ValueError(f"cross-layer gradients need layers of the same shape, got {tuple(g_deep.shape)} and "
                         f"{tuple(g_shallow.shape)}")
    n_k, n_0 = g_deep.norm(), g_shallow.norm()
    beta = cross_layer_coefficient(g_deep, g_shallow, beta_max)
    mixed = (g_deep / (n_k + EPS) + beta * g_shallow / (n_0 + EPS)) * ((n_k + n_0) / 2)
    return mixed if clip is None else mixed.clamp(-clip, clip)


def inco_pairs(layout: DepthLayout, include_bias: bool = False) -> list[tuple[slice, slice]]:
    """(deep, shallow) flat slices: blocks.j.weight ← blocks.0.weight for every j ≥ 1 (and the biases if asked)."""
    sl = layout.slices()
    kinds = ("weight", "bias") if include_bias else ("weight",)
    return [(sl[f"blocks.{j}.{k}"], sl[f"blocks.0.{k}"]) for j in range(1, layout.blocks) for k in kinds]


@dataclass
class InCoStep:
    """Server optimiser: replace each deep layer's part of the aggregated update by its cross-layer gradient
    (computed from the update as aggregated, shallow parts unchanged), then the base method's own server step.
    Records the round's mean β (History column `inco_beta`)."""
    pairs: list
    inner: ServerSGD = field(default_factory=ServerSGD)
    beta_max: float = 5.0
    clip: float | None = 0.1

    def __post_init__(self):
        if not self.beta_max >= 0 or (self.clip is not None and not self.clip > 0):
            raise ValueError(f"InCo needs beta_max >= 0 and clip > 0 (or None), got {self.beta_max}, {self.clip}")

    def init_state(self, theta, num_clients):
        return {"inner": self.inner.init_state(theta, num_clients), "beta": theta.new_tensor(float("nan"))}

    def step(self, theta, update, state):
        mixed, betas = update.clone(), []
        for deep, shallow in self.pairs:
            g_k, g_0 = update[deep], update[shallow]
            if g_k.abs().sum() == 0:  # no round client holds this layer: nothing to mix into
                continue
            betas.append(cross_layer_coefficient(g_k, g_0, self.beta_max))
            mixed[deep] = cross_layer_gradient(g_k, g_0, self.beta_max, self.clip)
        theta, inner = self.inner.step(theta, mixed, state["inner"])
        beta = torch.stack(betas).mean() if betas else theta.new_tensor(float("nan"))
        return theta, {"inner": inner, "beta": beta}

    def metrics(self, state):
        return {"inco_beta": float(state["beta"])}


def with_inco(method: Method, layout: DepthLayout, beta_max: float = 5.0, clip: float | None = 0.1,
              include_bias: bool = False) -> Method:
    """`method` with InCo's cross-layer step in front of its server optimiser (the plug-in form)."""
    step = InCoStep(inco_pairs(layout, include_bias), method.server_opt, beta_max, clip)
    return replace(method, name=f"inco-{method.name}", server_opt=step)


@register("inco", claims="inco")
def inco(net: ResidualMLP, depths=None, base: str | Method = "fedavg", n_clients: int = 10, levels=(2, 3, 4),
         beta_max: float = 5.0, clip: float | None = 0.1, include_bias: bool = False, enabled: bool = True,
         **base_kw) -> Method:
    """InCo-<base> on depth-heterogeneous clients: client k trains the first `depths[k]` blocks of `net`
    (default: `levels` in contiguous groups of `n_clients`); `enabled=False` gives the plain heterogeneous base
    method (the comparison). `base`: a registered FedAvg-family method name or a Method; `base_kw` go to it."""
    method = get_method(base, **base_kw) if isinstance(base, str) else base
    depths = depth_groups(n_clients, levels) if depths is None else depths
    hetero = hetero_depth(method, net, depths)
    return with_inco(hetero, hetero.rule.layout, beta_max, clip, include_bias) if enabled else hetero
