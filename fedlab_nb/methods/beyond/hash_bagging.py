"""Hash bagging and the collective certificate of bagging — Ruoxin Chen, Zenan Li, Jie Li, Junchi Yan and Chentao
Wu, "On Collective Robustness of Bagging Against Data Poisoning", ICML 2022 (PMLR 162:3299–3319, arXiv 2205.13176).
Official code: https://github.com/Emiyalzn/ICML22-CRB (`certify/main_cv_hash.py`, `certify/main_cv_vanilla.py`,
`certify/utils.py`, `partition/hash/cv/partition_data_norm_hash.py`; it solves the programs with Gurobi, we use
HiGHS through `scipy.optimize.milp`).

Bagging trains k sub-classifiers on sub-trainsets S_1..S_k and predicts by plurality (ties -> smaller class).
*Vanilla bagging* draws each S_j at random (the official code: a uniform subset without replacement); *hash bagging*
runs G = ceil(k · portion) rounds, and in round g hashes every sample (salted by g) into one of 1/portion buckets,
each bucket one sub-trainset (the last round keeps only the buckets still needed). Every sample then sits in at most
G sub-trainsets — its *influence scope* is bounded by design — whereas under vanilla bagging some samples land in
many more.

Global poisoning: one poisoned training set attacks all test points at once, and a sub-classifier whose
sub-trainset holds a poisoned sample may vote arbitrarily (independently for every test point). The collective
certificate is the largest number of predictions that P poisons can change *simultaneously*, a binary integer
linear program (BILP) over
    X_j = 1 if sub-classifier j is compromised,   Z_tc = 1 if test point t can be flipped to class c,
maximise sum_t Y_t subject to Y_t <= sum_c Z_tc and, for the clean winner w_t and every c != w_t,
    Z_tc · (1 − b_tc) <= sum_j X_j · ([v_jt != c] + [v_jt = w_t]),   b_tc = n_tc − n_tw + [c < w_t],
(a compromised voter for w_t closes the gap by 2, one for a third class by 1; the official code states the same
implications as products of binaries, we write them linearly). The budget constraint is the bagging's:
* vanilla: W_i = 1 if training sample i is poisoned, sum_i W_i <= P and X_j <= sum_{i in S_j} W_i (samples with
  identical membership merge into one variable, and a pattern contained in another is dropped);
* hash: each poison reaches one sub-classifier per round and may be crafted to hash anywhere, so
  sum_{j in round g} X_j <= P for every round g (as `main_cv_hash.py`).
Points that are pointwise certified can never flip and are left out of the program (as `prepare_param` does).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix, csr_matrix

from ...core.registry import register
from .run_off_election import hash_partition, plurality, vote_counts


# --- the two baggings -----------------------------------------------------------------------------------------------
def hash_bagging_subsets(x, n_classifiers: int, portion: float, salt: int = 0):
    """Hash bagging: (sub-trainsets, rounds), rounds[g] = the classifier indices of hash round g."""
    if not 0 < portion <= 1 or abs(1 / portion - round(1 / portion)) > 1e-9:
        raise ValueError(f"portion must be 1/m for an integer m >= 1 (each round is a partition), got {portion!r}")
    if isinstance(n_classifiers, bool) or not isinstance(n_classifiers, int) or n_classifiers < 1:
        raise ValueError(f"n_classifiers must be an integer >= 1, got {n_classifiers!r}")
    per_round = round(1 / portion)
    subsets, rounds = [], []
    for g in range(math.ceil(n_classifiers / per_round)):
        keep = min(per_round, n_classifiers - g * per_round)
        buckets = hash_partition(x, per_round, salt=salt * 1000 + g)  # a fresh hash (salt) per round
        rounds.append(list(range(len(subsets), len(subsets) + keep)))
        subsets += buckets[:keep]
    return subsets, rounds


def vanilla_bagging_subsets(n: int, n_classifiers: int, subset_size: int, rng: np.random.Generator):
    """Vanilla bagging as the official code draws it: each sub-trainset a uniform subset without replacement."""
    if not 1 <= subset_size <= n:
        raise ValueError(f"subset_size must be in [1, n = {n}], got {subset_size!r}")
    return [np.sort(rng.choice(n, subset_size, replace=False)) for _ in range(n_classifiers)]


def membership(subsets, n: int) -> np.ndarray:
    """Boolean [n, k]: sample i is in sub-trainset j."""
    M = np.zeros((n, len(subsets)), dtype=bool)
    for j, idx in enumerate(subsets):
        M[idx, j] = True
    return M


def influence_scope(member) -> int:
    """The most sub-trainsets any one training sample reaches."""
    return int(np.asarray(member).sum(axis=1).max())


def poison_patterns(member) -> np.ndarray:
    """Distinct, inclusion-maximal membership rows (compromising more classifiers never hurts the attacker)."""
    rows = np.unique(np.asarray(member, dtype=bool), axis=0)
    rows = rows[rows.any(axis=1)]
    sizes = rows.sum(axis=1)
    inside = (rows.astype(np.int32) @ rows.T.astype(np.int32)) == sizes[:, None]  # row i within row j
    np.fill_diagonal(inside, False)
    return rows[~inside.any(axis=1)]  # rows are distinct, so "within another" means strictly smaller


# --- the attack's arithmetic -------------------------------------------------------------------------------------------
@dataclass
class Threat:
    """What P poisons can compromise: `patterns` (vanilla; [m, k] bool) or `rounds` (hash; classifier groups)."""
    budget: int
    patterns: np.ndarray | None = None
    rounds: list | None = None

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, np.integer)) or self.budget < 0:
            raise ValueError(f"budget (number of poisons P) must be an integer >= 0, got {self.budget!r}")
        if (self.patterns is None) == (self.rounds is None):
            raise ValueError("give exactly one of patterns= (vanilla bagging) or rounds= (hash bagging)")


def flip_terms(votes, num_classes: int):
    """For every test point t and class c != winner: the per-classifier gain [T, C, k] and the needed gain
    1 − b_tc [T, C] (inf where c is the winner)."""
    votes = np.asarray(votes)  # [k, T]
    counts = vote_counts(votes.T, num_classes)
    win = plurality(counts)
    T = len(win)
    cls = np.arange(num_classes)
    gain = (votes.T[:, None, :] != cls[None, :, None]).astype(int) + (votes.T == win[:, None])[:, None, :]
    need = 1 - (counts - counts[np.arange(T), win][:, None] + (cls[None, :] < win[:, None]))
    need = need.astype(float)
    need[np.arange(T), win] = np.inf
    return gain, need, win


def flipped(votes, num_classes: int, compromised) -> np.ndarray:
    """Which points the compromised classifiers can flip (the operational check: all of them vote for c)."""
    votes = np.asarray(votes)
    base = plurality(vote_counts(votes.T, num_classes))
    out = np.zeros(votes.shape[1], dtype=bool)
    comp = np.asarray(compromised, dtype=bool)
    for c in range(num_classes):
        attacked = votes.copy()
        attacked[comp] = c
        out |= plurality(vote_counts(attacked.T, num_classes)) != base
    return out


# --- the BILP ------------------------------------------------------------------------------------------------------------
@dataclass
class Collective:
    flips: int          # best attack found (primal value)
    bound: int          # proven upper bound on the simultaneous flips (floor of the dual bound)
    gap: float          # HiGHS's relative MIP gap
    status: str


def max_simultaneous_flips(votes, num_classes: int, threat: Threat, points=None,
                           time_limit: float = 30.0) -> Collective:
    """The collective BILP: the most of `points` (default all) that one P-poison attack flips at once."""
    votes = np.asarray(votes)
    k = votes.shape[0]
    pts = np.arange(votes.shape[1]) if points is None else np.asarray(points)
    if len(pts) == 0 or threat.budget == 0:
        return Collective(0, 0, 0.0, "trivial")
    gain, need, _ = flip_terms(votes[:, pts], num_classes)
    T = len(pts)
    pairs = [(t, c) for t in range(T) for c in range(num_classes) if np.isfinite(need[t, c])]
    m = 0 if threat.patterns is None else len(threat.patterns)
    nX, nY, nZ = k, T, len(pairs)
    n_var = nX + nY + nZ + m
    iX, iY, iZ, iW = 0, nX, nX + nY, nX + nY + nZ
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(row_entries, lower, upper):
        r = len(lo)
        for col, val in row_entries:
            rows.append(r), cols.append(col), vals.append(val)
        lo.append(lower), hi.append(upper)

    for z, (t, c) in enumerate(pairs):  # Z_tc (1 − b_tc) <= sum_j gain_tcj X_j
        add([(iX + j, float(gain[t, c, j])) for j in range(k) if gain[t, c, j]] + [(iZ + z, -need[t, c])], 0, np.inf)
    by_point = {}
    for z, (t, _) in enumerate(pairs):
        by_point.setdefault(t, []).append(z)
    for t in range(T):  # Y_t <= sum_c Z_tc
        add([(iY + t, 1.0)] + [(iZ + z, -1.0) for z in by_point.get(t, [])], -np.inf, 0)
    if threat.patterns is not None:
        P = np.asarray(threat.patterns, dtype=bool)
        add([(iW + i, 1.0) for i in range(m)], -np.inf, threat.budget)
        for j in range(k):  # X_j <= sum of poisoned patterns containing j
            add([(iX + j, 1.0)] + [(iW + i, -1.0) for i in np.flatnonzero(P[:, j])], -np.inf, 0)
    else:
        for grp in threat.rounds:
            add([(iX + j, 1.0) for j in grp], -np.inf, threat.budget)
    A = csr_matrix(coo_matrix((vals, (rows, cols)), shape=(len(lo), n_var)))
    objective = np.zeros(n_var)
    objective[iY:iY + nY] = -1.0  # milp minimises
    res = milp(objective, constraints=LinearConstraint(A, lo, hi), integrality=np.ones(n_var),
               bounds=Bounds(0, 1), options=dict(time_limit=time_limit, disp=False))
    if res.x is None:
        return Collective(0, T, 1.0, res.message)
    best = int(round(-res.fun))
    dual = getattr(res, "mip_dual_bound", None)
    bound = best if dual is None or not np.isfinite(dual) else int(math.floor(-dual + 1e-6))
    return Collective(best, max(best, min(bound, T)), float(getattr(res, "mip_gap", 0.0) or 0.0), res.message)


# --- pointwise certificates ------------------------------------------------------------------------------------------------
def scope_radius(votes, num_classes: int, scope: int) -> np.ndarray:
    """The sample-wise radius when one poison reaches at most `scope` classifiers (DPA's bound divided by the
    scope, as `certify/utils.py`): floor((n_w − n_c − [c < w]) / (2 · scope)), min over c."""
    _, need, _ = flip_terms(votes, num_classes)
    return np.floor((need.min(axis=1) - 1) / (2 * scope)).astype(np.int64)


def _best_gain(gain, threat: Threat, exact: bool):
    """The largest total gain P poisons reach for one point and class (gain: [k] per compromised classifier).
    Rounds: the top P gains of every round (exact). Patterns: greedy (a lower bound) or, with exact=False, the sum
    of the P largest pattern gains (an upper bound)."""
    if threat.rounds is not None:
        return sum(np.sort(gain[grp])[::-1][:threat.budget].sum() for grp in threat.rounds)
    cover = np.asarray(threat.patterns, dtype=bool)
    if not exact:
        return np.sort(cover @ gain)[::-1][:threat.budget].sum()
    taken, total = np.zeros(len(gain), dtype=bool), 0
    for _ in range(threat.budget):
        extra = cover[:, ~taken] @ gain[~taken]
        best = int(extra.argmax())
        if extra[best] <= 0:
            break
        total += extra[best]
        taken |= cover[best]
    return total


def pointwise_flippable(votes, num_classes: int, threat: Threat, time_limit: float = 10.0) -> np.ndarray:
    """Exact sample-wise check: can some P-poison attack flip point t on its own? Hash rounds: exact in closed
    form. Vanilla: greedy attack (flips -> yes), sum of the P largest pattern gains (short -> no), else the BILP
    with this one point over the patterns restricted to the classifiers that matter for it."""
    votes = np.asarray(votes)
    gain, need, _ = flip_terms(votes, num_classes)
    out = np.zeros(votes.shape[1], dtype=bool)
    for t in range(votes.shape[1]):
        rivals = np.flatnonzero(np.isfinite(need[t]))
        if any(_best_gain(gain[t, c], threat, exact=True) >= need[t, c] for c in rivals):
            out[t] = True
        elif threat.rounds is None and any(_best_gain(gain[t, c], threat, exact=False) >= need[t, c] for c in rivals):
            relevant = (gain[t, rivals] > 0).any(axis=0)
            local = Threat(threat.budget, patterns=poison_patterns(np.asarray(threat.patterns) & relevant))
            # the proven bound, not the best attack found: an unfinished solve counts as attackable (sound)
            out[t] = max_simultaneous_flips(votes[:, [t]], num_classes, local, time_limit=time_limit).bound >= 1
    return out


@register("hash_bagging", claims="hash_bagging", kind="module")
def certify_bagging(votes, num_classes: int, threat: Threat, labels=None, time_limit: float = 30.0) -> dict:
    """Pointwise and collective certified counts at budget P. With `labels`, only correctly predicted points count
    (certified accuracy = count / T); otherwise all points (certified robustness)."""
    votes = np.asarray(votes)
    pred = plurality(vote_counts(votes.T, num_classes))
    scope = (int(np.asarray(threat.patterns).sum(axis=1).max()) if threat.patterns is not None
             else len(threat.rounds))
    consider = np.ones(len(pred), dtype=bool) if labels is None else pred == np.asarray(labels)
    safe = scope_radius(votes, num_classes, scope) >= threat.budget  # certified without solving anything
    candidates = np.flatnonzero(consider & ~safe)
    flippable = np.zeros(len(pred), dtype=bool)
    if len(candidates):
        flippable[candidates] = pointwise_flippable(votes[:, candidates], num_classes, threat, time_limit)
    attackable = np.flatnonzero(flippable)
    col = max_simultaneous_flips(votes, num_classes, threat, points=attackable, time_limit=time_limit)
    total = int(consider.sum())
    return dict(pointwise=total - len(attackable), collective=total - col.bound, flips=col.flips,
                flip_bound=col.bound, gap=col.gap, n_attackable=len(attackable))


# --- brute force on tiny instances -------------------------------------------------------------------------------------------
def brute_force_max_flips(votes, num_classes: int, threat: Threat, points=None) -> int:
    """Enumerate every P-poison attack (sets of patterns, or <= P classifiers per round) and count flips."""
    votes = np.asarray(votes)
    pts = np.arange(votes.shape[1]) if points is None else np.asarray(points)
    k = votes.shape[0]
    best = 0
    for comp in _attacks(threat, k):
        best = max(best, int(flipped(votes[:, pts], num_classes, comp).sum()))
    return best


def _attacks(threat: Threat, k: int):
    if threat.patterns is not None:
        P = np.asarray(threat.patterns, dtype=bool)
        for r in range(min(threat.budget, len(P)) + 1):
            for chosen in itertools.combinations(range(len(P)), r):
                yield P[list(chosen)].any(axis=0) if chosen else np.zeros(k, dtype=bool)
    else:
        per_round = [[c for r in range(min(threat.budget, len(g)) + 1) for c in itertools.combinations(g, r)]
                     for g in threat.rounds]
        for choice in itertools.product(*per_round):
            comp = np.zeros(k, dtype=bool)
            comp[[j for part in choice for j in part]] = True
            yield comp
