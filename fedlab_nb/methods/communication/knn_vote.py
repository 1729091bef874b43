"""Distributed 1-NN with a majority vote — J. Jon Ryu and Young-Han Kim, "One-Nearest-Neighbor Search is All
You Need for Minimax Optimal Regression and Classification", arXiv 2202.02464 (2022; v2, 2024, retitled
"Minimax Optimal Algorithms with Fixed-k-Nearest Neighbors"). Official code:
https://github.com/jongharyu/split-knn-rules . The rule itself is the bigNN classifier of Qiao, Duan and Cheng,
"Rates of Convergence for Large-scale Nearest Neighbor Classification", NeurIPS 2019, with k = 1 per group.

The training set is split at random into M (nearly) equal groups; each group answers a query x with the label
of its own nearest neighbour, and the server takes the majority of the M labels:

    ŷ(x) = argmax_c  #{m : Y_(1)^m(x) = c}                     (ties → the smallest label)

Ryu & Kim show that with M growing with n this attains the minimax rate up to a log factor: M groups of 1-NN
behave like a standard Θ(M)-NN rule. Their refined ("distance-selective") rule lets only the L = ⌈κ M⌉ groups
whose nearest neighbour is closest to x vote; the official code's default is κ = 1 − e^(−k/4) (k = 1 here).
The tie rule follows the official code, which predicts class 1 when the mean of the binary votes is > 1/2, so an
even split goes to class 0; for more classes the smallest tied label wins (as `argmax` and scikit-learn's
KNeighborsClassifier do).

As a one-shot federated procedure each client is one group: it receives the queries, runs a 1-NN search on its
own data and uploads one vote per query (one byte each for up to 256 classes; the selective rule also uploads
the float32 distance). Nothing else leaves the client. The regression form averages the M group-wise 1-NN
responses instead of voting (`distributed_1nn_regress`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.registry import register

DEFAULT_SELECT_RATIO = 1 - math.exp(-1 / 4)  # the official code's κ for k = 1


# --- the split --------------------------------------------------------------------------------
def random_groups(n: int, M: int, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """A random partition of range(n) into M groups whose sizes differ by at most one."""
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"M (number of groups) must be an integer >= 1, got {M!r}")
    if M > n:
        raise ValueError(f"M = {M} groups need at least M training points, got n = {n}; use M <= n")
    return list(torch.randperm(n, generator=generator).tensor_split(M))


# --- nearest-neighbour searches -----------------------------------------------------------------
def nearest_neighbour(x_train: torch.Tensor, x_query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, distance) of each query's nearest training point, exact (Euclidean, first index on ties)."""
    dist = torch.cdist(x_query, x_train)
    d, idx = dist.min(dim=1)
    return idx, d


def knn_predict(x_train: torch.Tensor, y_train: torch.Tensor, x_query: torch.Tensor, k: int,
                num_classes: int, dist: torch.Tensor | None = None) -> torch.Tensor:
    """Standard k-NN majority (uniform weights, smallest label on a tie), exact by brute force.
    `dist` is an optional precomputed [queries, n] distance matrix."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(y_train):
        raise ValueError(f"k must be an integer in [1, n = {len(y_train)}], got {k!r}")
    dist = torch.cdist(x_query, x_train) if dist is None else dist
    idx = dist.topk(k, dim=1, largest=False).indices
    return majority_vote(y_train[idx].T, num_classes)


# --- the distributed rule -----------------------------------------------------------------------
def group_votes(train_dist: torch.Tensor, y_train: torch.Tensor, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's 1-NN label and distance for every query, from an [n, queries] train-to-query distance matrix
    (the rows of group m are what client m computes on its own data): votes, distances of shape [M, queries]."""
    votes, dists = [], []
    for g in groups:
        d, j = train_dist[g].min(dim=0)
        votes.append(y_train[g][j])
        dists.append(d)
    return torch.stack(votes), torch.stack(dists)


def majority_vote(votes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The label with most votes per column of `votes` [M, queries]; the smallest label wins a tie."""
    counts = torch.nn.functional.one_hot(votes.long(), num_classes).sum(dim=0)  # [queries, classes]
    return counts.argmax(dim=1)  # argmax returns the first maximum: the smallest tied label


def selective_vote(votes: torch.Tensor, dists: torch.Tensor, num_classes: int,
                   select_ratio: float = DEFAULT_SELECT_RATIO) -> torch.Tensor:
    """Ryu & Kim's refined rule: only the L = ⌈select_ratio · M⌉ groups (at least 1) whose nearest neighbour is
    closest to the query vote."""
    if not 0 < select_ratio <= 1:
        raise ValueError(f"select_ratio must be in (0, 1], got {select_ratio}")
    M = votes.shape[0]
    L = min(M, max(1, math.ceil(select_ratio * M)))
    keep = dists.topk(L, dim=0, largest=False).indices  # [L, queries]
    return majority_vote(votes.gather(0, keep), num_classes)


def knn_regress(y_train: torch.Tensor, dist: torch.Tensor, k: int) -> torch.Tensor:
    """Standard k-NN regression (mean response of the k nearest) from a [queries, n] distance matrix."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= dist.shape[1]:
        raise ValueError(f"k must be an integer in [1, n = {dist.shape[1]}], got {k!r}")
    idx = dist.topk(k, dim=1, largest=False).indices
    return y_train.to(torch.float64)[idx].mean(dim=1)


def distributed_1nn_regress(y_train: torch.Tensor, train_dist: torch.Tensor, groups) -> torch.Tensor:
    """The regression form of the rule: the mean of the M group-wise 1-NN responses."""
    values, _ = group_votes(train_dist, y_train.to(torch.float64), groups)
    return values.mean(dim=0)


def vote_dtype(num_classes: int) -> torch.dtype:
    """The smallest integer type that encodes a class label (what a client uploads per query)."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if num_classes <= 256:
        return torch.uint8
    return torch.int16 if num_classes <= 2 ** 15 else torch.int32


def encode_votes(votes: torch.Tensor, num_classes: int) -> torch.Tensor:
    return votes.to(vote_dtype(num_classes))


def encoded_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class VoteResult:
    prediction: torch.Tensor  # [queries]
    votes: torch.Tensor       # [M, queries] encoded labels, one row per client
    distances: torch.Tensor   # [M, queries] each client's 1-NN distance (uploaded by the selective rule only)
    groups: list              # the training indices each client holds
    bytes_up: int             # total bytes the M clients upload


@register("knn_vote", claims="knn_vote", kind="module")
def distributed_1nn(x_train: torch.Tensor, y_train: torch.Tensor, x_query: torch.Tensor, M: int,
                    num_classes: int, generator: torch.Generator | None = None, rule: str = "majority",
                    select_ratio: float = DEFAULT_SELECT_RATIO, train_dist: torch.Tensor | None = None) -> VoteResult:
    """One-shot federated distributed 1-NN: split the data into M clients at random, each uploads its 1-NN vote
    per query, the server aggregates with `rule` = "majority" (bigNN with k = 1) or "selective" (Ryu & Kim's
    refined rule). `train_dist` is an optional precomputed [n, queries] matrix (client m uses its rows)."""
    if rule not in ("majority", "selective"):
        raise ValueError(f"rule must be 'majority' or 'selective', got {rule!r}")
    if len(x_train) != len(y_train):
        raise ValueError(f"x_train has {len(x_train)} rows but y_train has {len(y_train)} labels")
    if train_dist is not None and tuple(train_dist.shape) != (len(y_train), len(x_query)):
        raise ValueError(f"train_dist must have shape [n, queries] = {[len(y_train), len(x_query)]}, got "
                         f"{list(train_dist.shape)} (pass torch.cdist(x_train, x_query))")
    groups = random_groups(len(y_train), M, generator)
    if train_dist is None:  # each client computes distances from its own points only
        train_dist = torch.empty(len(y_train), len(x_query), dtype=x_query.dtype, device=x_query.device)
        for g in groups:
            train_dist[g] = torch.cdist(x_train[g], x_query)
    votes, dists = group_votes(train_dist, y_train, groups)
    encoded = encode_votes(votes, num_classes)
    if rule == "majority":
        prediction, sent = majority_vote(encoded, num_classes), encoded_bytes(encoded)
    else:
        d32 = dists.to(torch.float32)
        prediction = selective_vote(encoded, d32, num_classes, select_ratio)
        sent = encoded_bytes(encoded) + encoded_bytes(d32)
    return VoteResult(prediction, encoded, dists, groups, sent)


# --- the synthetic task with a known Bayes error (the paper's Section 5.1 mixture) ---------------------
def two_gaussians(n: int, d: int = 5, sigma: float = 1.0, generator: torch.Generator | None = None):
    """Class 0 ~ N(0, I_d), class 1 ~ N(1, σ² I_d), equal priors (each label drawn with probability 1/2)."""
    y = torch.randint(0, 2, (n,), generator=generator)
    z = torch.randn(n, d, generator=generator, dtype=torch.float64)
    x = torch.where(y[:, None] == 1, 1.0 + sigma * z, z)
    return x, y


def two_gaussians_eta(x: torch.Tensor) -> torch.Tensor:
    """P(Y = 1 | x) for σ = 1: the log-likelihood ratio is Σ_i x_i − d/2, so η is its logistic function."""
    return torch.sigmoid(x.sum(dim=1) - x.shape[1] / 2)


def two_gaussians_bayes_error(d: int = 5) -> float:
    """Bayes error for σ = 1: the two means are √d apart, so the error is Φ(−√d / 2)."""
    return 0.5 * math.erfc(math.sqrt(d) / 2 / math.sqrt(2))
