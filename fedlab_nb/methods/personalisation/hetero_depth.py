"""Depth-heterogeneous clients on the round pipeline: every client trains a prefix of one server model.

System heterogeneity as in InCo Aggregation's "stage splitting" (Chan, Zhou, Zhao, Jiang, Ngai, ICLR 2024,
https://github.com/ChanYunHin/InCo-Aggregation): the server holds the deepest model; a weak client holds the
stem, its first d residual blocks and the shared classifier, and skips the rest (a residual block left out is
the identity, so the prefix is itself a working model). The server averages each parameter over the clients
that hold it (HeteroFL-style, as the official `aggregate_gradients` counts clients per layer); a parameter no
round client holds stays where it is.

Here the model is `ResidualMLP` (stem → `blocks` equal-width residual blocks h ← h + ReLU(W_j h + b_j) → head),
and a client's sub-model is `DepthView(net, d)`: the same parameter tensors, names and flat layout, with the
forward pass stopping after block d − 1. A client trains its view with the engine's own kernel (loop or vmap),
the blocks it lacks frozen, so they come back bit-exactly unchanged. `hetero_depth(base, net, depths)` turns
a FedAvg-family `Method` (FedAvg, FedProx, SCAFFOLD, FedNova, MOON) into its depth-heterogeneous version.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...core.groups import ParamGroups
from ...core.messages import Transform
from ...core.method import ClientUpdate, Method, OwnTraining, weighted_mean
from ...engine.client import make_loss
from ...engine.evaluate import evaluate
from ...models import param_spec


class ResidualMLP(nn.Module):
    """stem Linear(in → width) + ReLU, `blocks` residual blocks h ← h + ReLU(Linear(width, width)(h)), head
    Linear(width → classes). `depth` = how many blocks the forward pass uses (all of them here)."""

    def __init__(self, in_features: int, num_classes: int, width: int = 64, blocks: int = 4):
        super().__init__()
        if blocks < 1 or width < 1:
            raise ValueError(f"ResidualMLP needs blocks >= 1 and width >= 1, got blocks={blocks}, width={width}")
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, num_classes)
        self.depth = blocks

    def representation(self, x):
        """The features the head sees (what MOON contrasts): the output of block depth − 1."""
        h = F.relu(self.stem(x))
        for block in self.blocks[:self.depth]:
            h = h + F.relu(block(h))
        return h

    def forward(self, x):
        return self.head(self.representation(x))


class DepthView(ResidualMLP):
    """The first `depth` blocks of `net` with the shared head: the same parameter tensors (not copies), so the
    same names, order and flat layout as `net`; the blocks it skips get zero gradient."""

    def __init__(self, net: ResidualMLP, depth: int):
        nn.Module.__init__(self)
        if not 1 <= depth <= len(net.blocks):
            raise ValueError(f"depth must be in 1 … {len(net.blocks)} (the model's blocks), got {depth}")
        self.stem, self.blocks, self.head = net.stem, net.blocks, net.head
        self.depth = int(depth)


def depth_groups(n_clients: int, levels=(2, 3, 4)) -> np.ndarray:
    """Client k's depth: `levels` in contiguous, equal-as-possible groups of client ids (as the official code
    assigns model sizes to groups of ranks); the partition is random, so the id order carries no data."""
    if n_clients < len(levels) or any(int(v) < 1 for v in levels):
        raise ValueError(f"depth_groups needs n_clients >= len(levels) and levels >= 1, got {n_clients}, {levels}")
    return np.array([int(levels[k * len(levels) // n_clients]) for k in range(n_clients)])


@dataclass(frozen=True)
class DepthLayout:
    """Which flat coordinates a client of each depth holds, and the model's layers as flat slices."""
    spec: tuple                      # (name, shape) of every parameter, the flat layout
    depths: tuple                    # depth of every client 0 … K−1
    blocks: int

    @classmethod
    def of(cls, net: ResidualMLP, depths) -> "DepthLayout":
        if not isinstance(net, ResidualMLP):
            raise ValueError("depth heterogeneity needs a ResidualMLP "
                             f"(fedlab_nb.methods.personalisation.hetero_depth), got "
                             f"{type(net).__name__}")
        depths = tuple(int(d) for d in depths)
        bad = [d for d in depths if not 1 <= d <= len(net.blocks)]
        if bad:
            raise ValueError(f"depths must be in 1 … {len(net.blocks)} (the model's blocks), got {sorted(set(bad))}")
        return cls(tuple((n, tuple(s)) for n, s in param_spec(net)), depths, len(net.blocks))

    def slices(self) -> dict:
        """name → slice of the flat vector, for every parameter tensor."""
        out, i = {}, 0
        for name, shape in self.spec:
            n = int(np.prod(shape))
            out[name], i = slice(i, i + n), i + n
        return out

    def unheld(self, depth: int) -> tuple:
        """Glob patterns of the blocks a client of this depth does not have."""
        return tuple(f"blocks.{j}.*" for j in range(depth, self.blocks))

    def held(self, depth: int) -> torch.Tensor:
        """Bool [D] mask of the coordinates a client of this depth trains and sends."""
        mask = torch.ones(sum(int(np.prod(s)) for _, s in self.spec), dtype=torch.bool)
        for name, sl in self.slices().items():
            if name.startswith("blocks.") and int(name.split(".")[1]) >= depth:
                mask[sl] = False
        return mask

    def layers(self) -> dict:
        """Layer label → flat index of its tensors (weight and bias): stem, block0 …, head."""
        out = {}
        for name, sl in self.slices().items():
            parts = name.split(".")
            label = f"block{parts[1]}" if parts[0] == "blocks" else parts[0]
            out.setdefault(label, []).append(torch.arange(sl.start, sl.stop))
        return {k: torch.cat(v) for k, v in out.items()}


class HeteroDepthClient(OwnTraining):
    """The base method's single track, run per depth group with the engine's kernel on `DepthView(net, d)` and
    the missing blocks frozen. Message: Δ (zero on missing blocks) and `depth`; any other [m, D] entry (SCAFFOLD's
    Δc) is zeroed on missing blocks, and [m, D] client state (c_k, MOON's previous model) keeps its old values there."""

    def __init__(self, layout: DepthLayout):
        self.layout = layout

    def local_train(self, method, ctx, jobs, down, cstate):
        theta = down["theta"]
        (track,) = self.tracks(method)
        obj_state = {k[len("objective."):]: v for k, v in cstate.items() if k.startswith("objective.")}
        rows = track.objective.context(down, obj_state)
        if rows is not None:  # the engine hands local_train jobs without the objective's context rows
            jobs = [replace(j, ctx=rows[i]) for i, j in enumerate(jobs)]
        depths = torch.tensor([self.layout.depths[j.client_id] for j in jobs])
        W, losses = theta.repeat(len(jobs), 1), theta.new_zeros(len(jobs))
        net, criterion = ctx.model, getattr(ctx.loss_fn, "criterion", None)
        for d in depths.unique().tolist():
            rows = (depths == d).nonzero().ravel()
            view = DepthView(net, d)
            groups = ParamGroups(frozen=tuple(method.groups.frozen) + self.layout.unheld(d)).resolve(param_spec(view))
            W[rows], losses[rows] = replace(ctx, optimizer=track.optimizer).train(
                theta, [jobs[i] for i in rows], track.objective, groups=groups, loss_fn=make_loss(view, criterion))
        steps = torch.tensor([float(len(j.batches)) for j in jobs], device=theta.device)
        entries, new = self.finish({"w": W}, theta, down, cstate, steps, ctx.lr, method, ctx.groups)
        held = torch.stack([self.layout.held(int(d)) for d in depths]).to(theta.device)
        for name, value in entries.items():
            if name != "delta" and value.shape == held.shape:
                entries[name] = torch.where(held, value, torch.zeros_like(value))
        for name, value in new.items():
            if value.shape == held.shape and name in cstate:
                new[name] = torch.where(held, value, cstate[name])
        return {**entries, "depth": depths.to(theta.device)}, new, losses


@dataclass
class HeldMean:
    """Per coordinate, the weighted mean of the updates of the round's clients that hold it (0 if none does),
    as HeteroFL / the official InCo code aggregate sub-models. Also records, per layer, the mean pairwise cosine
    similarity of the holders' updates (History columns `sim_<layer>`: the layer-similarity observation)."""
    layout: DepthLayout
    uses_context = True

    def init_state(self, theta, num_clients):
        return {"similarity": torch.full((len(self.layout.layers()),), float("nan"), dtype=theta.dtype,
                                         device=theta.device)}

    def aggregate(self, state, deltas, weights, info):
        depths = info.messages["depth"]
        held = torch.stack([self.layout.held(int(d)) for d in depths]).to(deltas.device)
        p = weights.to(deltas.dtype)[:, None] * held
        total = p.sum(0)
        agg = (p * deltas).sum(0) / total.clamp_min(torch.finfo(deltas.dtype).tiny)
        agg = torch.where(total > 0, agg, torch.zeros_like(agg))
        sims = [layer_similarity(deltas[:, idx.to(deltas.device)], held[:, idx[0]]) for idx in self.layout.layers().values()]
        return agg, {"similarity": torch.stack(sims).to(state["similarity"])}

    def metrics(self, state):
        return {f"sim_{name}": float(v) for name, v in zip(self.layout.layers(), state["similarity"])}


def layer_similarity(updates: torch.Tensor, holders: torch.Tensor) -> torch.Tensor:
    """Mean pairwise cosine similarity of the rows `holders` of one layer's updates [m, n] (NaN with < 2)."""
    u = updates[holders]
    if len(u) < 2:
        return updates.new_tensor(float("nan"))
    u = F.normalize(u, dim=1)
    c = u @ u.T
    m = len(u)
    return (c.sum() - c.diagonal().sum()) / (m * (m - 1))


@dataclass
class HeldBytes(Transform):
    """Wire size: a client sends the coordinates of its own sub-model only (of Δ and of any other [m, D] entry,
    e.g. SCAFFOLD's Δc), not the zeros of the blocks it lacks; other entries (its depth) as they are."""
    layout: DepthLayout

    def __call__(self, msgs, cstate, ctx):
        counts = torch.tensor([int(self.layout.held(int(d)).sum()) for d in msgs["depth"]])
        D = msgs["delta"].shape[1]
        size = torch.zeros(len(counts), dtype=torch.int64)
        for t in msgs.tensors.values():
            size += counts * t.element_size() if t.dim() == 2 and t.shape[1] == D else t[0].numel() * t.element_size()
        msgs.bytes = size.to(msgs["delta"].device)
        return msgs, cstate


def hetero_depth(base: Method, net: ResidualMLP, depths) -> Method:
    """`base` (a FedAvg-family method: default client update, weighted-mean rule, every tensor sent) with each
    client k training `DepthView(net, depths[k])` and the server averaging each coordinate over its holders."""
    if type(base.client) is not ClientUpdate or base.rule is not weighted_mean:
        raise ValueError(f"hetero_depth wraps FedAvg-family methods (default client update, weighted_mean rule); "
                         f"{base.name} has {type(base.client).__name__} and rule {base.rule!r}")
    if base.groups.local:
        raise ValueError("hetero_depth needs every tensor sent (no ParamGroups(local=...))")
    layout = DepthLayout.of(net, depths)
    return replace(base, name=f"{base.name}-hetero", rule=HeldMean(layout), client=HeteroDepthClient(layout),
                   uplink=tuple(base.uplink) + (HeldBytes(layout),))


@torch.no_grad()
def depth_accuracy(net: ResidualMLP, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, depths) -> dict:
    """Test accuracy of the global θ run as each sub-model depth (the official code's per-size test accuracy)."""
    return {int(d): evaluate(DepthView(net, int(d)), theta, x, y)[1] for d in sorted(set(int(v) for v in depths))}


@torch.no_grad()
def client_depth_accuracy(net: ResidualMLP, theta: torch.Tensor, fed, depths) -> np.ndarray:
    """Each client's accuracy on its own test split with the sub-model it can run (its depth), [K]."""
    return np.array([evaluate(DepthView(net, int(depths[k])), theta, *fed.client_test[k])[1]
                     for k in range(fed.num_clients)])
