"""Decentralised learning without a server: communication graphs, mixing matrices and gossip.

Nodes sit on a graph and only talk to their neighbours. One gossip step replaces each node's vector by a
weighted average of its neighbours' vectors, X ← W X, with W doubly stochastic (rows and columns sum to 1)
and W_ij = 0 unless i and j are neighbours. Then the average over nodes never changes, and the nodes
reach consensus at the rate of W's second-largest singular value ρ = ‖W − 11ᵀ/m‖₂ < 1 (Xiao & Boyd,
"Fast linear iterations for distributed averaging", 2004; Boyd, Ghosh, Prabhakar, Shah, "Randomized gossip
algorithms", 2006). The spectral gap 1 − ρ is the number that decentralised rates depend on.

Used by the decentralised bilevel method (DSBO) and any method whose nodes gossip instead of sending to a
server. Node states are stacked as rows of an [m, d] tensor, so one gossip step is one matrix product.
"""
from __future__ import annotations

import numpy as np
import torch

from .utils import check_positive_int, rng


def ring(m: int) -> np.ndarray:
    """Adjacency of a ring of m nodes (each node linked to its two neighbours; m = 2 is one edge)."""
    m = check_positive_int("m", m, 2)
    adj = np.zeros((m, m), dtype=bool)
    for i in range(m):
        adj[i, (i + 1) % m] = adj[(i + 1) % m, i] = True
    return adj


def torus(rows: int, cols: int) -> np.ndarray:
    """Adjacency of a rows × cols torus (a grid whose edges wrap around), rows·cols nodes."""
    rows, cols = check_positive_int("rows", rows, 2), check_positive_int("cols", cols, 2)
    adj = np.zeros((rows * cols, rows * cols), dtype=bool)
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            for j in (((r + 1) % rows) * cols + c, r * cols + (c + 1) % cols):
                if j != i:
                    adj[i, j] = adj[j, i] = True
    return adj


def random_graph(m: int, p: float, seed: int = 0, max_tries: int = 100) -> np.ndarray:
    """A connected Erdős–Rényi graph G(m, p): each edge present with probability p, redrawn until connected."""
    m = check_positive_int("m", m, 2)
    if not 0 < p <= 1:
        raise ValueError(f"p (edge probability) must be in (0, 1], got {p}; try p = 2·log(m)/m for a connected graph")
    for attempt in range(max_tries):
        upper = np.triu(rng(seed, attempt).random((m, m)) < p, 1)
        adj = upper | upper.T
        if is_connected(adj):
            return adj
    raise ValueError(f"no connected G(m={m}, p={p}) in {max_tries} draws; raise p (2·log(m)/m = {2 * np.log(m) / m:.2f})")


def is_connected(adj: np.ndarray) -> bool:
    """True when every node is reachable from node 0 (a breadth-first search)."""
    seen = np.zeros(len(adj), dtype=bool)
    seen[0], frontier = True, np.array([0])
    while frontier.size:
        reached = adj[frontier].any(0) & ~seen
        seen |= reached
        frontier = np.flatnonzero(reached)
    return bool(seen.all())


def metropolis_weights(adj: np.ndarray) -> np.ndarray:
    """The Metropolis–Hastings mixing matrix: W_ij = 1/(1 + max(deg_i, deg_j)) on edges, the rest on the
    diagonal. Symmetric and doubly stochastic for any undirected graph, using only what neighbours know."""
    adj = _check_adjacency(adj)
    deg = adj.sum(1)
    w = np.where(adj, 1.0 / (1.0 + np.maximum(deg[:, None], deg[None, :])), 0.0)
    np.fill_diagonal(w, 1.0 - w.sum(1))
    return w


def uniform_weights(adj: np.ndarray) -> np.ndarray:
    """Each node averages itself and its neighbours equally: doubly stochastic only on regular graphs
    (ring, torus), which is where decentralised papers use it; anything else raises."""
    adj = _check_adjacency(adj)
    deg = adj.sum(1)
    if np.any(deg != deg[0]):
        raise ValueError("uniform_weights needs a regular graph (every node the same degree); "
                         "use metropolis_weights(adj) for this one")
    return (adj | np.eye(len(adj), dtype=bool)) / (deg[0] + 1.0)


def spectral_gap(w: np.ndarray) -> float:
    """1 − ρ with ρ = ‖W − 11ᵀ/m‖₂: how much one gossip step shrinks the disagreement between nodes."""
    w = check_mixing(w)
    m = len(w)
    return 1.0 - float(np.linalg.norm(w - np.full((m, m), 1.0 / m), 2))


def check_mixing(w, tol: float = 1e-10) -> np.ndarray:
    """W must be square, non-negative and doubly stochastic; anything else would move the nodes' average."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"mixing matrix W must be square [m, m], got shape {w.shape}")
    if np.any(w < -tol):
        raise ValueError("mixing matrix W has negative entries; build it with metropolis_weights(adjacency)")
    if np.abs(w.sum(0) - 1).max() > tol or np.abs(w.sum(1) - 1).max() > tol:
        raise ValueError("mixing matrix W must be doubly stochastic (rows and columns sum to 1); "
                         "metropolis_weights(adjacency) gives one for any undirected graph")
    return w


def _check_adjacency(adj) -> np.ndarray:
    adj = np.asarray(adj, dtype=bool)
    if adj.ndim != 2 or adj.shape[0] != adj.shape[1] or np.any(adj != adj.T):
        raise ValueError("adjacency must be a symmetric [m, m] boolean matrix (an undirected graph)")
    if np.any(np.diag(adj)):
        raise ValueError("adjacency must have no self-loops (its diagonal is False); the mixing weights add them")
    return adj


def mix(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One gossip step for stacked node states x [m, ...]: node i gets Σ_j W_ij x_j."""
    if w.shape[0] != x.shape[0]:
        raise ValueError(f"W is {tuple(w.shape)} but x has {x.shape[0]} nodes (rows); they must match")
    return (w.to(x) @ x.reshape(x.shape[0], -1)).reshape(x.shape)


def consensus_error(x: torch.Tensor) -> float:
    """(1/m) Σ_i ‖x_i − x̄‖²: how far the nodes are from agreeing."""
    flat = x.reshape(x.shape[0], -1)
    return float((flat - flat.mean(0)).pow(2).sum(1).mean())


def communication_floats(adj: np.ndarray, d: int) -> int:
    """Numbers sent in one gossip step: each node sends its d-vector to each neighbour (2 per edge)."""
    return int(_check_adjacency(adj).sum()) * int(d)
