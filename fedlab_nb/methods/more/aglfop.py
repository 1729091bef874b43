"""AGLFOP — Faisal Hamman, Sanghamitra Dutta, "Demystifying Local & Global Fairness Trade-offs in Federated
Learning Using Partial Information Decomposition", ICLR 2024 (arXiv 2307.11333).
Official code: https://github.com/FaisalHamman/FairFL-PID

An analysis, not a training algorithm. With Z the sensitive attribute, S the client and Ŷ the (binary)
prediction of the global model:
    global disparity  I(Z; Ŷ)        (the model's dependence on Z over all clients pooled)
    local disparity   I(Z; Ŷ | S)    (the average over clients of the dependence inside each client)
The partial information decomposition of I(Z; Ŷ, S) with target Z and sources Ŷ, S splits them into
    I(Z;Ŷ) = Unique + Redundant,     I(Z;Ŷ|S) = Unique + Masked (synergistic),
Unique = UI(Z: Ŷ \\ S). The PID measure is BROJA (Bertschinger et al. 2014), as in the official code
(`dit.pid.PID_BROJA(d, ['S', 'Y'], 'Z')`); here it is fedlab_nb.methods.more.fairness.pid_broja.

AGLFOP (Accuracy and Global-Local Fairness Optimality Problem): over every classifier whose joint law with the
data keeps the data's P(S, Z, Y) — one rate r[s, z, y] = P(Ŷ=1 | S=s, Z=z, Y=y) per cell, the official code's
normalised confusion matrices with each (client, group)'s size and positives fixed — maximise the accuracy
Σ P(s,z,1) r + P(s,z,0)(1 − r) subject to I(Z;Ŷ) ≤ ε_g and I(Z;Ŷ|S) ≤ ε_l. Both informations are convex in
P(Ŷ | Z[, S]), which is linear in r, so the program is convex; it is solved with scipy's SLSQP (as the
official code does). Because r may depend on Y, the optimum is an upper bound on what any FL strategy reaches.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize

from ...core.registry import register
from .fairness import (conditional_mutual_information_table, fairness_report, joint_counts,
                        mutual_information_table, pid_broja)

CASES = ("unique", "redundant", "masked")


# --- the auditor -------------------------------------------------------------------------------------
def table_from_samples(z, s, y_pred) -> np.ndarray:
    """Empirical P(z, s, ŷ) (a 3-D array summing to 1) of aligned samples."""
    counts = joint_counts(z, s, y_pred)
    return counts / counts.sum()


def disparities(p_zsy) -> dict:
    """Global / local disparity of a table P(z, s, ŷ) and their BROJA decomposition, in bits:
    {'global', 'local', 'i_zs', 'unique', 'redundant', 'masked', 'unique_s'}."""
    p = np.asarray(p_zsy, dtype=np.float64)
    if p.ndim != 3:
        raise ValueError(f"p_zsy must be a 3-D table indexed (z, s, ŷ), got {p.ndim}-D")
    pid = pid_broja(p.swapaxes(1, 2))  # target Z, source A = Ŷ, source B = S
    return {"global": pid["i_ta"], "local": pid["i_ta_given_b"], "i_zs": pid["i_tb"], "unique": pid["unique_a"],
            "redundant": pid["redundant"], "masked": pid["synergistic"], "unique_s": pid["unique_b"]}


@register("aglfop", claims="aglfop", kind="module")
def audit(y_pred, z, clients, y_true=None) -> dict:
    """Fairness audit of a federated model's hard predictions: the group-fairness gaps (global and per
    client) of fedlab_nb.methods.more.fairness.fairness_report, and the information view with its PID atoms."""
    report = fairness_report(y_pred, z, clients, y_true)
    report["pid"] = disparities(table_from_samples(z, clients, y_pred))
    return report


def chain_rule_residual(p_zsy) -> float:
    """[I(Z;Ŷ|S) − I(Z;Ŷ)] − [I(Z;S|Ŷ) − I(Z;S)]: zero for every distribution (both equal the co-information
    with the sign flipped); the reason local fairness implies global fairness when I(Z;S) = 0."""
    p = np.asarray(p_zsy, dtype=np.float64)
    local = conditional_mutual_information_table(p.transpose(0, 2, 1))  # (z, ŷ, s): I(Z;Ŷ|S)
    glob = mutual_information_table(p.sum(1))
    zs_given_y = conditional_mutual_information_table(p)                # (z, s, ŷ): I(Z;S|Ŷ)
    zs = mutual_information_table(p.sum(2))
    return (local - glob) - (zs_given_y - zs)


def canonical_table(case: str) -> np.ndarray:
    """The paper's canonical examples with Z and S uniform bits, as P(z, s, ŷ):
    'unique' (S ⊥ Z, Ŷ = Z): 1 bit global and local; 'redundant' (S = Z, Ŷ = Z): 1 bit global, 0 local;
    'masked' (S ⊥ Z, Ŷ = Z ⊕ S): 0 global, 1 bit local."""
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    p = np.zeros((2, 2, 2))
    for z in (0, 1):
        for s in (0, 1):
            if case == "redundant" and s != z:
                continue
            y = z ^ s if case == "masked" else z
            p[z, s, y] += 1.0
    return p / p.sum()


# --- AGLFOP ------------------------------------------------------------------------------------------
def _prediction_table(r, p_szy) -> np.ndarray:
    """P(z, s, ŷ) of the classifier with rates r[s, z, y] = P(Ŷ=1 | s, z, y)."""
    pos = (p_szy * r).sum(2)                       # P(s, z, ŷ=1)
    joint = np.stack([p_szy.sum(2) - pos, pos], 2)  # (s, z, ŷ)
    return np.clip(joint.transpose(1, 0, 2), 0, None)


def _global_mi(r, p_szy) -> float:
    return mutual_information_table(_prediction_table(r, p_szy).sum(1))


def _local_mi(r, p_szy) -> float:
    return conditional_mutual_information_table(_prediction_table(r, p_szy).transpose(0, 2, 1))  # (z, ŷ, s)


def aglfop(p_szy, eps_global: float = math.inf, eps_local: float = math.inf, starts: int = 3, seed: int = 0) -> dict:
    """Solve AGLFOP for a data law P(s, z, y) (counts or probabilities, binary y): the best accuracy of any
    classifier with I(Z;Ŷ) ≤ eps_global and I(Z;Ŷ|S) ≤ eps_local (bits; math.inf drops a constraint).
    Returns {'accuracy', 'rates' (s, z, y), 'global', 'local', 'success'}. A convex program: the best of
    `starts` SLSQP runs (the constant classifier r = ½, then seeded random rates) is kept."""
    p = np.asarray(p_szy, dtype=np.float64)
    if p.ndim != 3 or p.shape[2] != 2 or np.any(p < 0) or p.sum() <= 0:
        raise ValueError(f"p_szy must be a non-negative (s, z, y) table with binary y, got shape {p.shape}")
    for name, eps in (("eps_global", eps_global), ("eps_local", eps_local)):
        if not eps >= 0:
            raise ValueError(f"{name} must be >= 0 (bits) or math.inf, got {eps!r}")
    p = p / p.sum()
    weight = p * np.array([-1.0, 1.0])             # accuracy = Σ p(s,z,0) + Σ_y ±p(s,z,y) r(s,z,y)
    shape = p.shape
    cons = []
    if math.isfinite(eps_global):
        cons.append({"type": "ineq", "fun": lambda x: eps_global - _global_mi(x.reshape(shape), p)})
    if math.isfinite(eps_local):
        cons.append({"type": "ineq", "fun": lambda x: eps_local - _local_mi(x.reshape(shape), p)})
    rng = np.random.default_rng(seed)
    x0s = [np.full(p.size, 0.5)] + [rng.random(p.size) for _ in range(starts - 1)]
    best = None
    for x0 in x0s:
        res = minimize(lambda x: -(weight.ravel() @ x), x0, jac=lambda x: -weight.ravel(), method="SLSQP",
                       bounds=[(0.0, 1.0)] * p.size, constraints=cons, options={"ftol": 1e-12, "maxiter": 500})
        r = np.clip(res.x, 0, 1).reshape(shape)
        g, l = _global_mi(r, p), _local_mi(r, p)
        feasible = g <= eps_global + 1e-7 and l <= eps_local + 1e-7
        acc = float(p[:, :, 0].sum() + (weight * r).sum())
        if feasible and (best is None or acc > best["accuracy"]):
            best = {"accuracy": acc, "rates": r, "global": g, "local": l, "success": bool(res.success)}
    if best is None:  # the constant classifier is always feasible (I = 0)
        r = np.full(shape, 0.5)
        best = {"accuracy": 0.5, "rates": r, "global": 0.0, "local": 0.0, "success": False}
    return best


def frontier(p_szy, eps_grid, eps_local_values=(math.inf,)) -> list[dict]:
    """AGLFOP's optimum over a grid: one row {'eps_global', 'eps_local', 'accuracy'} per pair."""
    return [{"eps_global": eg, "eps_local": el, "accuracy": aglfop(p_szy, eg, el)["accuracy"]}
            for el in eps_local_values for eg in eps_grid]


# --- the paper's two-client splits -------------------------------------------------------------------
SPLITS = ("iid", "heterogeneity", "synergy")


def two_client_split(z, y, how: str, rng: np.random.Generator, ratio: float = 0.92, swap: float = 0.01) -> np.ndarray:
    """Client id (0/1) of every row for the official code's scenarios: 'iid' (random halves); 'heterogeneity'
    (client 0 holds a `ratio` share of the z=1 rows and 1 − ratio of the z=0 rows); 'synergy' (client 0 holds
    the rows with z = y). Then a `swap` share of the smaller client's size is exchanged between the clients,
    as the code does, so no client is a pure function of (z, y)."""
    z, y = np.asarray(z).reshape(-1), np.asarray(y).reshape(-1)
    if how not in SPLITS:
        raise ValueError(f"how must be one of {SPLITS}, got {how!r}")
    if not 0 <= swap < 1 or not 0 < ratio < 1:
        raise ValueError(f"need 0 < ratio < 1 and 0 <= swap < 1, got ratio={ratio}, swap={swap}")
    clients = np.zeros(len(z), dtype=np.int64)
    if how == "iid":
        clients[rng.permutation(len(z))[: len(z) // 2]] = 1
    elif how == "heterogeneity":
        for group, share in ((1, ratio), (0, 1 - ratio)):
            rows = rng.permutation(np.flatnonzero(z == group))
            clients[rows[int(share * len(rows)):]] = 1
    else:
        clients[z != y] = 1
    m = int(swap * min((clients == 0).sum(), (clients == 1).sum()))
    to_1 = rng.choice(np.flatnonzero(clients == 0), m, replace=False)
    to_0 = rng.choice(np.flatnonzero(clients == 1), m, replace=False)
    clients[to_1], clients[to_0] = 1, 0
    return clients
