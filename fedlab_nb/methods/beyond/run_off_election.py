"""Run-Off Election (ROE) over a partition ensemble — Keivan Rezaei, Kiarash Banihashem, Atoosa Chegini and Soheil
Feizi, "Run-Off Election: Improved Provable Defense against Data Poisoning Attacks", ICML 2023 (arXiv 2302.02300).
Official code: https://github.com/k1rezaei/Run-Off-Election (snapshot read: k1rezaei/DPA-election,
`dpa_roe_certify.py`, `dp_calc.py`). The plain-vote baseline is Deep Partition Aggregation (DPA), Alexander Levine and
Soheil Feizi, "Deep Partition Aggregation: Provable Defenses against General Poisoning Attacks", ICLR 2021.

DPA hashes every training sample, by its content, into one of k partitions and trains one base model per partition;
a poisoned (inserted or removed) sample therefore changes at most one base model. The prediction is the plurality
of the k votes. ROE keeps the same ensemble but holds a second round: the top two classes of the first round meet in
a run-off in which every model votes for the finalist it scores higher. Each model is summarised here by its ranking
of the classes (scores sorted, ties to the smaller class index), which fixes both its first-round vote and its
run-off preference, and a corrupted model may report any ranking.

Certificates (the number of poisoned samples that provably cannot change the prediction; ties always go to the
smaller class index):
* DPA: winner c keeps winning against r changed models iff n_c − n_c' − 1[c' < c] ≥ 2r for every c' ≠ c.
* ROE (the paper's Theorem, as `dpa_roe_certify.py` computes it): the prediction p can only change if either
  (1) two classes overtake p in round 1 (a changed model closes the two gaps by (2, 1) or (1, 2) at most), or
  (2) some class c reaches the final (it must overtake the other finalist) AND beats p in the run-off; the
  certificate is the smallest number of models any of these needs, minus one.

`sample_hash`, `hash_partition`, `pooled_features` and `ensemble_scores` are the partition-ensemble pieces that
`fedlab_nb.methods.beyond.hash_bagging` reuses.
"""
from __future__ import annotations

import hashlib
import itertools

import numpy as np
import torch

from ...core.registry import register


# --- the partition ensemble (shared with hash_bagging) ------------------------------------------------------------
def sample_hash(x, salt: int = 0) -> np.ndarray:
    """A 64-bit hash of each row's content (pixels quantised to 8 bits), keyed by `salt`: the same sample always
    lands in the same place, whatever its index, as DPA requires."""
    rows = np.asarray(x, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"x must be a 2-D array [samples, features], got shape {rows.shape}")
    quantised = np.clip(np.rint(rows * 255), 0, 255).astype(np.uint8)
    key = int(salt).to_bytes(8, "little", signed=True)
    return np.array([int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8, key=key).digest(), "little")
                     for r in quantised], dtype=np.uint64)


def hash_partition(x, k: int, salt: int = 0) -> list[np.ndarray]:
    """DPA's partition: sample i goes to part hash(x_i) mod k. Returns the k index arrays."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (number of partitions) must be an integer >= 1, got {k!r}")
    part = sample_hash(x, salt) % np.uint64(k)
    return [np.flatnonzero(part == j) for j in range(k)]


def pooled_features(x, input_shape, pool: int = 2) -> np.ndarray:
    """Average-pooled pixels, a fixed data-independent feature map (a feature map fitted on all the data would let
    one poisoned sample reach every base model and void the certificate)."""
    images = torch.as_tensor(x, dtype=torch.float32).reshape(-1, *input_shape)
    return torch.nn.functional.avg_pool2d(images, pool).reshape(len(images), -1).double().numpy()


def ensemble_scores(features, y, subsets, features_eval, num_classes: int, C: float = 1.0) -> np.ndarray:
    """Train one logistic regression per subset; return the scores [n_eval, k, num_classes] (decision function;
    classes absent from a subset get −1e9, a subset with one class scores that class 0)."""
    from sklearn.linear_model import LogisticRegression
    y = np.asarray(y)
    out = np.full((len(features_eval), len(subsets), num_classes), -1e9)
    for j, idx in enumerate(subsets):
        classes = np.unique(y[idx])
        if len(classes) == 0:
            out[:, j, :] = 0.0  # an empty part votes for class 0 (the smallest index)
        elif len(classes) == 1:
            out[:, j, classes[0]] = 0.0
        else:
            model = LogisticRegression(C=C, max_iter=300).fit(features[idx], y[idx])
            dec = model.decision_function(features_eval)
            if len(classes) == 2:  # sklearn's binary decision function is one column: + for classes[1]
                dec = np.stack([-dec, dec], axis=1) / 2
            out[:, j, classes] = dec
    return out


def rankings(scores) -> np.ndarray:
    """Each model's ranking of the classes, best first; equal scores go to the smaller class index."""
    return np.argsort(-np.asarray(scores), axis=-1, kind="stable")


# --- DPA: the plain vote --------------------------------------------------------------------------------------------
def vote_counts(votes, num_classes: int) -> np.ndarray:
    """Votes [n, k] (class indices) -> counts [n, num_classes]."""
    votes = np.asarray(votes)
    counts = np.zeros((len(votes), num_classes), dtype=np.int64)
    np.add.at(counts, (np.arange(len(votes))[:, None], votes), 1)
    return counts


def plurality(counts) -> np.ndarray:
    """The most-voted class; ties -> the smallest index."""
    return np.asarray(counts).argmax(axis=1)


def dpa_certificate(counts) -> np.ndarray:
    """DPA's radius: min over c' != c of floor((n_c − n_c' − 1[c' < c]) / 2), c the plurality winner."""
    counts = np.asarray(counts)
    n, C = counts.shape
    win = plurality(counts)
    others = np.arange(C)[None, :]
    margin = counts[np.arange(n), win][:, None] - counts - (others < win[:, None])
    margin[np.arange(n), win] = np.iinfo(np.int64).max
    return margin.min(axis=1) // 2


# --- ROE: the two-round election ------------------------------------------------------------------------------------
def _positions(ranks) -> np.ndarray:
    """pos[..., c] = where class c sits in each model's ranking (0 = top)."""
    ranks = np.asarray(ranks)
    pos = np.empty_like(ranks)
    np.put_along_axis(pos, ranks, np.arange(ranks.shape[-1]), axis=-1)
    return pos


def prefers(ranks, a, b) -> np.ndarray:
    """How many models of each point rank class a[i] above class b[i]."""
    pos = _positions(ranks)
    n = len(pos)
    return (pos[np.arange(n), :, a] < pos[np.arange(n), :, b]).sum(axis=1)


def finalists(counts) -> tuple[np.ndarray, np.ndarray]:
    """The top two classes of round 1 (counts, ties -> smaller index)."""
    order = np.argsort(-np.asarray(counts), axis=1, kind="stable")
    return order[:, 0], order[:, 1]


def roe_predict(ranks) -> np.ndarray:
    """The run-off winner between round 1's top two; a tied run-off goes to the smaller class index."""
    ranks = np.asarray(ranks)
    k, C = ranks.shape[1:]
    m1, m2 = finalists(vote_counts(ranks[..., 0], C))
    for_m1 = prefers(ranks, m1, m2)
    m1_wins = (2 * for_m1 > k) | ((2 * for_m1 == k) & (m1 < m2))
    return np.where(m1_wins, m1, m2)


def two_gap_cost(g1, g2):
    """The fewest changed models that close two round-1 gaps g1, g2 >= 0 at once: a model moving from the
    predicted class to one rival closes (2, 1) or (1, 2), so r models close at most 2r of each and 3r in total
    (equal to the paper's dynamic-programming table in `dp_calc.py`; checked in tests)."""
    g1, g2 = np.maximum(g1, 0), np.maximum(g2, 0)
    return np.maximum(np.maximum(-(-g1 // 2), -(-g2 // 2)), -(-(g1 + g2) // 3))


def paper_two_gap_table(size: int) -> np.ndarray:
    """The paper's table of two-gap costs, computed by its recursion (as `dp_calc.py`: a changed model closes the
    gaps by (2, 1) or (1, 2)); the reference `two_gap_cost` is checked against."""
    A = np.zeros((size, size), dtype=np.int64)
    for i in range(size):
        for j in range(size):
            if i + j == 0:
                A[i, j] = 0
            elif (i <= 1 and j <= 2) or (i <= 2 and j <= 1):
                A[i, j] = 1
            elif i <= 1 or j <= 1:
                A[i, j] = (max(i, j) + 1) // 2
            else:
                A[i, j] = 1 + min(A[i - 2, j - 1], A[i - 1, j - 2])
    return A


def roe_certificate(ranks) -> np.ndarray:
    """ROE's certified number of poisoned samples for each point (ranks: [n, k, C] model rankings)."""
    ranks = np.asarray(ranks)
    n, k, C = ranks.shape
    counts = vote_counts(ranks[..., 0], C)
    m1, m2 = finalists(counts)
    pred = roe_predict(ranks)
    second = np.where(pred == m1, m2, m1)
    rows = np.arange(n)
    cls = np.arange(C)[None, :]
    gap = counts[rows, pred][:, None] - counts + (cls > pred[:, None])  # round-1 gap of p over each class
    # (1) p pushed out of the final by two rivals c1 != c2
    g = np.maximum(gap, 0)
    pair = two_gap_cost(g[:, :, None], g[:, None, :]).astype(float)
    bad = (cls[:, :, None] == pred[:, None, None]) | (cls[:, None, :] == pred[:, None, None]) | np.eye(C, dtype=bool)
    pair[bad] = np.inf
    cert_out = pair.reshape(n, -1).min(axis=1)
    # (2) c reaches the final (overtakes `second`) and wins the run-off against p
    reach = counts[rows, second][:, None] - counts + (cls > second[:, None])
    pos = _positions(ranks)
    p_over_c = (pos[rows, :, pred][:, :, None] < pos).sum(axis=1)  # [n, C]: models ranking p above c
    runoff = 2 * p_over_c - k + (cls > pred[:, None])
    need = np.maximum(-(-np.maximum(reach, 0) // 2), -(-np.maximum(runoff, 0) // 2)).astype(float)
    need[rows, pred] = np.inf
    cert_runoff = need.min(axis=1)
    return (np.minimum(cert_out, cert_runoff) - 1).astype(np.int64)


# --- certified accuracy -----------------------------------------------------------------------------------------------
def certified_accuracy(pred, cert, y, max_radius: int) -> np.ndarray:
    """Fraction of points predicted correctly with certificate >= r, for r = 0..max_radius."""
    ok = np.where(np.asarray(pred) == np.asarray(y), np.asarray(cert), -1)
    return np.array([(ok >= r).mean() for r in range(max_radius + 1)])


def certified_area(pred, cert, y) -> float:
    """Area under the certified-accuracy step curve, sum_r acc(r) = mean over points of (cert + 1) if correct."""
    ok = np.where(np.asarray(pred) == np.asarray(y), np.asarray(cert) + 1, 0)
    return float(ok.mean())


@register("roe", claims="run_off_election", kind="module")
def dpa_and_roe(scores) -> dict:
    """Both defences from the base models' scores [n, k, C]: predictions and certificates of DPA and DPA+ROE."""
    scores = np.asarray(scores)
    if scores.ndim != 3:
        raise ValueError(f"scores must be [points, models, classes], got shape {scores.shape}")
    ranks = rankings(scores)
    counts = vote_counts(ranks[..., 0], scores.shape[2])
    return dict(dpa_pred=plurality(counts), dpa_cert=dpa_certificate(counts),
                roe_pred=roe_predict(ranks), roe_cert=roe_certificate(ranks))


# --- brute force on tiny ensembles -----------------------------------------------------------------------------------
def brute_force_flip_size(outputs, predict, choices, max_r: int | None = None) -> int:
    """The fewest models whose outputs, replaced by any of `choices`, change predict(outputs). `outputs`: one
    hashable output per model (a class for DPA, a ranking tuple for ROE). Returns len(outputs) + 1 if none does."""
    outputs = list(outputs)
    base = predict(outputs)
    k = len(outputs)
    for r in range(1, (k if max_r is None else max_r) + 1):
        kept_sets = set()  # which models are replaced matters only through the multiset left
        for removed in itertools.combinations(range(k), r):
            kept_sets.add(tuple(sorted(o for i, o in enumerate(outputs) if i not in removed)))
        for kept in kept_sets:
            for added in itertools.combinations_with_replacement(choices, r):
                if predict(list(kept) + list(added)) != base:
                    return r
    return k + 1


def plurality_of(votes: list, num_classes: int) -> int:
    """Plurality of one point's votes (ties -> smaller class)."""
    counts = [0] * num_classes
    for v in votes:
        counts[v] += 1
    return max(range(num_classes), key=lambda c: (counts[c], -c))


def runoff_of(rank_list: list, num_classes: int) -> int:
    """ROE on one point's model rankings (tuples), written independently of the vectorised `roe_predict`."""
    m1, m2 = sorted(range(num_classes), key=lambda c: (-sum(r[0] == c for r in rank_list), c))[:2]
    for_m1 = sum(r.index(m1) < r.index(m2) for r in rank_list)
    against = len(rank_list) - for_m1
    return m1 if (for_m1 > against or (for_m1 == against and m1 < m2)) else m2


def all_rankings(num_classes: int) -> list[tuple]:
    return list(itertools.permutations(range(num_classes)))
