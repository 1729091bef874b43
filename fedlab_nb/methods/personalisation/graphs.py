"""Small dense graph pieces in plain numpy / torch (no torch_geometric, no networkx): enough for subgraph
federated learning on a few thousand nodes.

* `sample_sbm` — a stochastic block model whose within-community edge probability depends on whether the two
  endpoints share a label (homophily), with a separate probability across communities;
* `split_communities` — one subgraph per community, the cross-community edges dropped (the subgraph-FL setting of
  Baek et al., ICML 2023, where a METIS split loses the edges between clients);
* `random_partition_graph` — the planted-partition random graph (``networkx.random_partition_graph`` semantics:
  p_in inside a block, p_out between blocks), used by FED-PUB as its proxy input;
* `normalized_adjacency` — Â = D^{-1/2}(A + I)D^{-1/2} (Kipf & Welling, "Semi-Supervised Classification with Graph
  Convolutional Networks", ICLR 2017), dense;
* `gcn_init` / `gcn_forward` / `DenseGCN` — the two-layer GCN with a linear classifier of FED-PUB's official code
  (`models/nets.py`): H₁ = ReLU(Â X W₁ᵀ + b₁), H₂ = Â H₁ W₂ᵀ + b₂ (the "embedding"), logits = ReLU(H₂) W₃ᵀ + b₃,
  with optional element-wise masks on W₁, W₂, W₃. Every tensor may carry leading batch dimensions, so one call runs
  many clients (and seeds) at once.

Adjacency matrices are dense {0, 1} arrays, symmetric, with an empty diagonal."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS = ("conv1.weight", "conv2.weight", "clsif.weight")   # the matrices a FED-PUB mask multiplies
BIASES = ("conv1.bias", "conv2.bias", "clsif.bias")


def _check_prob(name: str, p) -> float:
    if not (0.0 <= float(p) <= 1.0):
        raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
    return float(p)


def _symmetric_bernoulli(prob: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A symmetric {0,1} matrix with independent edges P(A_ij = 1) = prob_ij for i < j and no self-loops."""
    upper = np.triu(rng.random(prob.shape) < prob, k=1)
    return (upper | upper.T).astype(np.uint8)


def sample_sbm(labels, communities, p_same: float, p_diff: float, p_out: float,
               rng: np.random.Generator) -> np.ndarray:
    """[n, n] adjacency of a labelled stochastic block model: inside a community a pair links with p_same if the
    two nodes share a label and with p_diff otherwise; pairs in different communities link with p_out."""
    labels, communities = np.asarray(labels), np.asarray(communities)
    if labels.ndim != 1 or labels.shape != communities.shape:
        raise ValueError(f"labels and communities must be 1-D arrays of the same length, got shapes "
                         f"{labels.shape} and {communities.shape}")
    p_same, p_diff, p_out = (_check_prob(n, p) for n, p in (("p_same", p_same), ("p_diff", p_diff), ("p_out", p_out)))
    inside = communities[:, None] == communities[None, :]
    same = labels[:, None] == labels[None, :]
    prob = np.where(inside, np.where(same, p_same, p_diff), p_out)
    return _symmetric_bernoulli(prob, rng)


def split_communities(adj: np.ndarray, communities) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Cut the graph into one subgraph per community (in sorted community order). Returns the node indices of
    each part, each part's adjacency block, and the number of undirected edges dropped between parts."""
    adj, communities = np.asarray(adj), np.asarray(communities)
    if adj.ndim != 2 or adj.shape[0] != adj.shape[1] or adj.shape[0] != len(communities):
        raise ValueError(f"adj must be square [n, n] with n = len(communities) = {len(communities)}, got {adj.shape}")
    nodes = [np.flatnonzero(communities == c) for c in np.unique(communities)]
    blocks = [adj[np.ix_(idx, idx)] for idx in nodes]
    dropped = int(adj.sum() - sum(int(b.sum()) for b in blocks)) // 2
    return nodes, blocks, dropped


def random_partition_graph(sizes, p_in: float, p_out: float, rng: np.random.Generator) -> np.ndarray:
    """[n, n] adjacency of a planted-partition graph: blocks of the given sizes, p_in inside a block, p_out across
    (the model of `networkx.random_partition_graph`; the draws differ from networkx's)."""
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be a non-empty list of positive block sizes, got {sizes!r}")
    block = np.repeat(np.arange(len(sizes)), sizes)
    inside = block[:, None] == block[None, :]
    return _symmetric_bernoulli(np.where(inside, _check_prob("p_in", p_in), _check_prob("p_out", p_out)), rng)


def normalized_adjacency(adj, dtype=torch.float32) -> torch.Tensor:
    """Â = D^{-1/2}(A + I)D^{-1/2} with D the degree matrix of A + I; leading batch dimensions are kept."""
    a = torch.as_tensor(np.asarray(adj) if not torch.is_tensor(adj) else adj, dtype=dtype)
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"adj must be [..., n, n] (square in its last two dimensions), got {tuple(a.shape)}")
    if not torch.equal(a, a.transpose(-1, -2)):
        raise ValueError("adj must be symmetric (an undirected graph); symmetrise it with A | A.T first")
    a = a + torch.eye(a.shape[-1], dtype=dtype)
    d = a.sum(-1).rsqrt()
    return d[..., :, None] * a * d[..., None, :]


def gcn_init(n_feat: int, hidden: int, n_classes: int, generator: torch.Generator | None = None,
             batch: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Glorot-uniform weights ([out, in], as torch.nn.Linear) and zero biases, with optional leading batch dims
    (each batch entry drawn independently)."""
    for name, v in (("n_feat", n_feat), ("hidden", hidden), ("n_classes", n_classes)):
        if int(v) < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    shapes = {"conv1": (hidden, n_feat), "conv2": (hidden, hidden), "clsif": (n_classes, hidden)}
    params = {}
    for layer, (out, inp) in shapes.items():
        bound = math.sqrt(6.0 / (out + inp))
        params[f"{layer}.weight"] = (torch.rand(*batch, out, inp, generator=generator) * 2 - 1) * bound
        params[f"{layer}.bias"] = torch.zeros(*batch, out)
    return params


def _dropout(h: torch.Tensor, p: float, generator) -> torch.Tensor:
    if isinstance(generator, (list, tuple)):   # one generator per leading index (e.g. per seed): independent streams
        if len(generator) != h.shape[0]:
            raise ValueError(f"generator: got {len(generator)} generators for a leading dimension of {h.shape[0]}")
        keep = torch.stack([torch.bernoulli(torch.full_like(h[0], 1 - p), generator=g) for g in generator])
    else:
        keep = torch.bernoulli(torch.full_like(h, 1 - p), generator=generator)
    return h * keep / (1 - p)


def gcn_forward(params: dict[str, torch.Tensor], a_hat: torch.Tensor, x: torch.Tensor,
                masks: dict[str, torch.Tensor] | None = None, embedding: bool = False,
                dropout: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Logits [..., n, C] (or the second layer's pre-activation output [..., n, hidden] with `embedding=True`).
    Each weight W is used as W ⊙ M when `masks` holds M for it; `dropout` > 0 drops hidden units (training), with
    `generator` one torch.Generator or a list of them, one per index of the first dimension."""
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    missing = [k for k in WEIGHTS + BIASES if k not in params]
    if missing:
        raise ValueError(f"params lacks {missing}; build it with gcn_init(...)")

    def weight(name):
        w = params[name]
        return w * masks[name] if masks is not None and name in masks else w

    def linear(h, layer):
        return h @ weight(f"{layer}.weight").transpose(-1, -2) + params[f"{layer}.bias"].unsqueeze(-2)

    def conv(h, layer):   # Â (H Wᵀ) + b: the bias is added after propagation, as in torch_geometric's GCNConv
        return a_hat @ (h @ weight(f"{layer}.weight").transpose(-1, -2)) + params[f"{layer}.bias"].unsqueeze(-2)

    h = F.relu(conv(x, "conv1"))
    if dropout:
        h = _dropout(h, dropout, generator)
    h = conv(h, "conv2")
    if embedding:
        return h
    h = F.relu(h)
    if dropout:
        h = _dropout(h, dropout, generator)
    return linear(h, "clsif")


class DenseGCN(nn.Module):
    """`gcn_forward` as an nn.Module (parameters named conv1.weight ... clsif.bias, so `fedlab_nb.models.
    flatten_params` / `unflatten` / `torch.func.functional_call` work on it). forward(x, a_hat)."""

    def __init__(self, n_feat: int, hidden: int, n_classes: int, generator: torch.Generator | None = None):
        super().__init__()
        init = gcn_init(n_feat, hidden, n_classes, generator)
        for layer in ("conv1", "conv2", "clsif"):
            setattr(self, layer, nn.Module())
            for kind in ("weight", "bias"):
                getattr(self, layer).register_parameter(kind, nn.Parameter(init[f"{layer}.{kind}"]))

    def forward(self, x: torch.Tensor, a_hat: torch.Tensor, embedding: bool = False) -> torch.Tensor:
        return gcn_forward(dict(self.named_parameters()), a_hat, x, embedding=embedding)
