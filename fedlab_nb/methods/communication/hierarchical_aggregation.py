"""Hierarchical (tree) aggregation — the aggregation pattern that LIFL accelerates.

Shixiong Qi, K. K. Ramakrishnan, Myungjin Lee, "LIFL: A Lightweight, Event-driven Serverless Platform for
Federated Learning", MLSys 2024 (https://arxiv.org/abs/2405.10968). LIFL is a serverless *platform*
(eBPF proxies, shared-memory communication, locality-aware placement, autoscaling); none of that is
reproduced here. What this module teaches is the computation it runs: hierarchical aggregation.

    leaf aggregator a (its clients C_a, in arrival order):   S_a = Σ_{k∈C_a} w_k Δ_k,  W_a = Σ_{k∈C_a} w_k
    inner aggregator b (its children):                        S_b = Σ_a S_a,            W_b = Σ_a W_a
    root:                                                     Δ̄ = S_root / W_root

Every aggregator passes the pair (weighted sum, total weight) upward and only the root divides, so the
result is the flat weighted mean Σ w_k Δ_k / Σ w_k for any tree shape and any arrival order, up to the
order of the floating-point additions (exact when the additions are: e.g. integer-valued updates).
Averaging the children's *averages* without their weights W would be wrong whenever the w_k differ.

`TreeAggregator` is a rule for `Method(rule=...)`; it measures, per level, the bytes that arrive there
(the `encode`d messages: a client's (Δ_k, w_k), an aggregator's (S, W)), the number of aggregators, the
longest chain of additions one aggregator does (its fan-in: the critical path if the aggregators of a
level run in parallel) and the wall time of the level's sums. `hierarchical(base)` swaps it into any
registered weighted-mean method.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from ...core.messages import encode
from ...core.method import Method, weighted_mean
from ...core.registry import get_method, register


@dataclass
class TreeLevel:
    """What one level of the tree cost in one aggregation."""
    nodes: int          # aggregators at this level that received something
    bytes_in: int       # bytes arriving at this level (the encoded messages of its children)
    max_fan_in: int     # the largest number of messages one aggregator of this level adds
    seconds: float      # wall time of this level's sums (run one after another here)


def _check_fan_out(fan_out) -> tuple:
    fan = (fan_out,) if isinstance(fan_out, (int, np.integer)) and not isinstance(fan_out, bool) else tuple(fan_out)
    if not fan or any(isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f < 2 for f in fan):
        raise ValueError(f"fan_out must be an integer >= 2 or a tuple of them (one per level, leaves first), "
                         f"got {fan_out!r}")
    return tuple(int(f) for f in fan)


def tree_groups(n: int, fan_out, leaves=None, client_ids=None) -> list[list[list[int]]]:
    """The tree as groups of child indices, level by level (leaves first), for n messages in arrival order.

    `fan_out`: an int (every aggregator adds up to that many children, levels until one root) or a tuple
    (that level's fan-in; after the last entry the last one repeats). `leaves`: None (arrival-order
    chunks of fan_out[0] clients), or an int L (client id k goes to leaf k mod L: fixed leaf aggregators,
    some of which may get nothing this round; they send nothing upward)."""
    fan = _check_fan_out(fan_out)
    if n < 1:
        raise ValueError("tree aggregation needs at least one message")
    if leaves is None:
        level0 = [list(range(i, min(i + fan[0], n))) for i in range(0, n, fan[0])]
    else:
        if isinstance(leaves, bool) or not isinstance(leaves, (int, np.integer)) or leaves < 1:
            raise ValueError(f"leaves must be None or a positive integer (the number of leaf aggregators), got {leaves!r}")
        ids = np.arange(n) if client_ids is None else np.asarray(client_ids)
        level0 = [list(np.flatnonzero(ids % int(leaves) == a)) for a in range(int(leaves))]
        level0 = [g for g in level0 if g]  # an empty leaf sends nothing upward
    groups, width, depth = [level0], len(level0), 1
    while width > 1:
        f = fan[min(depth, len(fan) - 1)]
        groups.append([list(range(i, min(i + f, width))) for i in range(0, width, f)])
        width, depth = len(groups[-1]), depth + 1
    return groups


def _stream_sum(rows: list[torch.Tensor]) -> torch.Tensor:
    """Add the rows one after another, as an aggregator that folds updates in as they arrive."""
    total = rows[0].clone()
    for r in rows[1:]:
        total += r
    return total


def tree_aggregate(updates: torch.Tensor, weights: torch.Tensor | None = None, fan_out=4, leaves=None,
                   client_ids=None, measure: bool = False):
    """Σ w_k Δ_k / Σ w_k computed through a tree of aggregators (see `tree_groups`).

    Returns the aggregate [d], and with `measure=True` also a list of `TreeLevel`, the level of the
    clients' uplinks first (level 0: bytes the leaves receive) and the root's inputs last."""
    if updates.ndim != 2 or len(updates) == 0:
        raise ValueError(f"updates must be a non-empty [m, d] matrix, got shape {tuple(updates.shape)}")
    m = len(updates)
    w = torch.ones(m, dtype=updates.dtype, device=updates.device) if weights is None else weights.to(updates.dtype)
    if w.shape != (m,):
        raise ValueError(f"weights must have one entry per update ({m}), got shape {tuple(w.shape)}")
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError("aggregation weights must be non-negative with a positive sum")
    groups = tree_groups(m, fan_out, leaves, client_ids)
    costs = []
    t0 = time.perf_counter()
    # leaves: weighted sums of their clients' updates, folded in arrival order
    sums = [_stream_sum([w[k] * updates[k] for k in g]) for g in groups[0]]
    totals = [_stream_sum([w[k:k + 1] for k in g]) for g in groups[0]]
    if measure:
        sent = sum(len(encode({"delta": updates[k], "weight": w[k:k + 1]})) for g in groups[0] for k in g)
        costs.append(TreeLevel(len(groups[0]), sent, max(map(len, groups[0])), time.perf_counter() - t0))
    for level in groups[1:]:
        sent = sum(len(encode({"sum": s, "weight": t})) for s, t in zip(sums, totals)) if measure else 0
        t0 = time.perf_counter()  # the sums only, not the measuring encode
        sums = [_stream_sum([sums[i] for i in g]) for g in level]
        totals = [_stream_sum([totals[i] for i in g]) for g in level]
        if measure:
            costs.append(TreeLevel(len(level), sent, max(map(len, level)), time.perf_counter() - t0))
    agg = sums[0] / totals[0]  # the root divides, once
    return (agg, costs) if measure else agg


def flat_stream_mean(updates: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The flat reference in the same summation order as a one-leaf tree: Σ_k w_k Δ_k folded in order, / Σ w_k."""
    w = torch.ones(len(updates), dtype=updates.dtype) if weights is None else weights.to(updates.dtype)
    return _stream_sum([w[k] * updates[k] for k in range(len(updates))]) / _stream_sum([w[k:k + 1] for k in range(len(w))])


def mean_of_means(updates: torch.Tensor, weights: torch.Tensor, fan_out=4) -> torch.Tensor:
    """The mistake the (S, W) pairs avoid: each aggregator forwards the plain mean of its children's
    (weighted) means, dropping their total weights."""
    groups = tree_groups(len(updates), fan_out)
    w = weights.to(updates.dtype)
    means = [(w[g] / w[g].sum()) @ updates[g] for g in groups[0]]
    for level in groups[1:]:
        means = [torch.stack([means[i] for i in g]).mean(0) for g in level]
    return means[0]


@dataclass
class TreeAggregator:
    """A `Method` rule: the weighted mean through a tree of aggregators (`tree_aggregate`), placed by
    arrival order (`leaves=None`) or by client id (`leaves=L`). Its state keeps the last round's
    per-level costs; `metrics` adds them to the History as columns tree_bytes_L<i>, tree_seconds_L<i>."""
    fan_out: int | tuple = 4
    leaves: int | None = None
    uses_context = True

    def __post_init__(self):
        self.fan_out = _check_fan_out(self.fan_out)
        if len(self.fan_out) == 1:
            self.fan_out = self.fan_out[0]
        tree_groups(1, self.fan_out, self.leaves)  # validates leaves

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"levels": []}

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None, info=None):
        ids = None if info is None else info.client_ids
        agg, costs = tree_aggregate(updates, weights, self.fan_out, self.leaves, ids, measure=True)
        return agg, {"levels": [dataclasses.asdict(c) for c in costs]}

    def metrics(self, state: dict) -> dict:
        out = {}
        for i, c in enumerate(state.get("levels", [])):
            out[f"tree_bytes_L{i}"] = float(c["bytes_in"])
            out[f"tree_seconds_L{i}"] = float(c["seconds"])
        return out


@register("hierarchical", claims="hierarchical_aggregation")
def hierarchical(base: str = "fedavg", fan_out: int | tuple = 4, leaves: int | None = None, **base_kwargs) -> Method:
    """Any registered weighted-mean method (FedAvg, FedProx, FedAvgM, ...) with its flat weighted mean
    replaced by tree aggregation; e.g. `hierarchical("fedprox", fan_out=8, mu=0.01)`."""
    method = get_method(base, **base_kwargs)
    if method.rule is not weighted_mean:
        raise ValueError(f"hierarchical aggregation replaces a weighted mean, but {base!r} aggregates with "
                         f"{getattr(method.rule, '__name__', type(method.rule).__name__)}; pick a weighted-mean "
                         "method such as 'fedavg', 'fedprox' or 'fedavgm'")
    rule = TreeAggregator(fan_out, leaves)
    return dataclasses.replace(method, name=f"{method.name}+tree", rule=rule)
