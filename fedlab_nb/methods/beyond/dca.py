"""DCA / DCWA: deep combinatorial aggregation and deep combinatorial weight averaging.

Shen & Cremers, "Deep Combinatorial Aggregation", NeurIPS 2022 (https://arxiv.org/abs/2210.06436; official code
https://github.com/tum-vision/dca). DCA keeps K instances ("copies") of every network component; each training
forward pass uses one random combination (one copy per component, drawn uniformly: `IIDUniform` in `dca/dca.py`),
so the K copies of each component are trained to work with any copy of every other one. K copies of M components
cost the parameters of a K-member deep ensemble but give K^M model proposals; the prediction is the mean over
proposals. For fine-grain (layer-wise) components the copies stay compatible and their average is a good single
model: DCWA (`wamodule` in the official code). Coarse-grain components (several layers each) may permute hidden units
between copies, so they are aggregated as an ensemble only. The consistency-enforcing loss follows the official
`experiments/*/train_dca.py`: each mini-batch is run `repeats` times with fresh combinations and each run adds
KL(p_previous ‖ p_current) to its cross-entropy (the first reference is a gradient-free extra pass); the gradients
of the runs are averaged into one optimiser step.

Here the network is the project's MLP on flat parameters: a DCA model is a [K, d] tensor of K copies of the
base model's flat vector (all copies start equal, as the official code deep-copies one initialised module), and a
"component" is a group of Linear layers whose copy is drawn jointly. SWA (Izmailov et al., UAI 2018) is the mean of
end-of-epoch snapshots of plain training; plain training is `copies=1`.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from ... import merging
from ...core.registry import register
from ...models import flatten_params, param_spec
from ...merging import logits as model_logits


# --- layout: which flat entries belong to which layer / component -------------------------------------
def layer_slices(model: torch.nn.Module) -> list[slice]:
    """The flat-vector range of each parametrised layer (a module's weight and bias together), in order."""
    out, owners, i = [], [], 0
    for name, shape in param_spec(model):
        owner, n = name.rsplit(".", 1)[0], math.prod(shape)
        if owners and owners[-1] == owner:
            out[-1] = slice(out[-1].start, i + n)
        else:
            owners.append(owner)
            out.append(slice(i, i + n))
        i += n
    return out


def component_slices(model: torch.nn.Module, components: Sequence[Sequence[int]] | None = None) -> list[list[slice]]:
    """Slices of each DCA component. `components` groups layer indices, e.g. [[0], [1, 2]] (coarse: the first
    layer, then layers 2-3); None = layer-wise (every layer its own component, the fine-grain DCA)."""
    layers = layer_slices(model)
    components = [[i] for i in range(len(layers))] if components is None else [list(c) for c in components]
    flat = sorted(i for c in components for i in c)
    if flat != list(range(len(layers))):
        raise ValueError(f"components must partition the layer indices 0..{len(layers) - 1}, got {components}")
    return [[layers[i] for i in c] for c in components]


def parameter_counts(model: torch.nn.Module, copies: int, components=None) -> dict[str, int]:
    """Parameters of a DCA model vs a deep ensemble of `copies` members, and the number of model proposals."""
    d = sum(math.prod(s) for _, s in param_spec(model))
    m = len(component_slices(model, components))
    return {"base": d, "dca": copies * d, "ensemble": copies * d, "components": m, "proposals": copies ** m}


# --- combinations ---------------------------------------------------------------------------------------
def combine(copies: torch.Tensor, comps: list[list[slice]], choice: Sequence[int]) -> torch.Tensor:
    """The flat θ of one model proposal: component c taken from copy choice[c] (differentiable in `copies`)."""
    pieces = [(s, copies[int(k), s]) for c, k in zip(comps, choice) for s in c]
    return torch.cat([p for _, p in sorted(pieces, key=lambda sp: sp[0].start)])


def dcwa(copies: torch.Tensor) -> torch.Tensor:
    """Deep combinatorial weight averaging: the mean of the copies, one base-model parameterisation."""
    return copies.mean(0)


def proposals(copies: torch.Tensor, comps: list[list[slice]], max_proposals: int = 64,
              generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """All K^M proposals when there are at most `max_proposals`, else `max_proposals` random ones."""
    K, M = len(copies), len(comps)
    if K ** M <= max_proposals:
        choices = list(itertools.product(range(K), repeat=M))
    else:
        choices = torch.randint(K, (max_proposals, M), generator=generator).tolist()
    return [combine(copies, comps, ch) for ch in choices]


def dca_proba(model: torch.nn.Module, copies: torch.Tensor, x: torch.Tensor, components=None,
              max_proposals: int = 64, generator: torch.Generator | None = None) -> torch.Tensor:
    """DCA's prediction: the mean predicted probabilities of the model proposals."""
    comps = component_slices(model, components)
    return torch.stack([merging.predict_proba(model, th, x)
                        for th in proposals(copies, comps, max_proposals, generator)]).mean(0)


# --- training -------------------------------------------------------------------------------------------
def consistency_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) ‖ softmax(logits)), mean over rows (the official `kldiv_logits`)."""
    return (torch.softmax(ref_logits, -1) * (torch.log_softmax(ref_logits, -1) - torch.log_softmax(logits, -1))).sum(-1).mean()


@register("dca", claims="dca", kind="module")
def train_dca(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, copies: int = 4, components=None,
              epochs: int = 10, lr: float = 1e-3, batch_size: int = 64, repeats: int = 1, consistency: bool = False,
              theta: torch.Tensor | None = None, seed: int = 0,
              snapshot_epochs: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Train a DCA model with Adam; returns ([K, d] copies, the DCWA snapshots after the epochs in `snapshot_epochs`).

    Each of the `repeats` forward passes per mini-batch draws one copy per component uniformly; with
    `consistency` each pass also adds KL(p_previous ‖ p_current). `copies=1, repeats=1` is plain training with
    exactly `merging.fit`'s batches (same shuffles from `seed`); the copy choices use a separate generator."""
    if copies < 1 or repeats < 1:
        raise ValueError(f"copies and repeats must be >= 1, got {copies} and {repeats}")
    if epochs < 0 or batch_size < 1 or not lr > 0:
        raise ValueError(f"need epochs >= 0, batch_size >= 1 and lr > 0, got {epochs}, {batch_size}, {lr}")
    comps = component_slices(model, components)
    base = flatten_params(model) if theta is None else theta
    w = base.detach().repeat(copies, 1).requires_grad_(True)  # all copies start from one initialisation
    opt = torch.optim.Adam([w], lr=lr)
    g, g_choice = torch.Generator().manual_seed(int(seed)), torch.Generator().manual_seed(int(seed) + 7919)
    draw = lambda: torch.randint(copies, (len(comps),), generator=g_choice).tolist()  # noqa: E731
    snaps = []
    for epoch in range(1, epochs + 1):
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            opt.zero_grad()
            if consistency:
                with torch.no_grad():
                    ref = model_logits(model, combine(w, comps, draw()), x[idx])
            for _ in range(repeats):
                logits = model_logits(model, combine(w, comps, draw()), x[idx])
                loss = F.cross_entropy(logits, y[idx])
                if consistency:
                    loss = loss + consistency_kl(ref, logits)
                    ref = logits.detach()
                (loss / repeats).backward()
            opt.step()
        if epoch in snapshot_epochs:
            snaps.append(dcwa(w.detach()))
    return w.detach(), snaps


def swa(snapshots: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stochastic weight averaging: the mean of the snapshots (here end-of-epoch weights of plain training)."""
    if len(snapshots) == 0:
        raise ValueError("swa needs at least one snapshot; pass snapshot_epochs to train_dca")
    return torch.stack(list(snapshots)).mean(0)
