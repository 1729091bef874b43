"""Group fairness and discrete information measures, shared by the fairness notebooks.

Group-fairness gaps (on hard predictions, a sensitive attribute z and, for federated audits, client ids):
- statistical (demographic) parity gap  max_z P(Ŷ=1 | Z=z) − min_z P(Ŷ=1 | Z=z);
- equalised-odds gap  max over true labels y of the parity gap among the rows with Y = y
  (Hardt, Price, Srebro, "Equality of Opportunity in Supervised Learning", NeurIPS 2016);
- global (all rows pooled) and per-client (each client's rows) versions of both.

Plug-in information measures in bits, from count or probability tables (any shape, normalised here) or from
samples of discrete variables: entropy, mutual information I(X;Y), conditional mutual information I(X;Y|W).

Partial information decomposition (PID) of what two sources A, B carry about a target T, with the measure of
Bertschinger, Rauh, Olbrich, Jost, Ay, "Quantifying Unique Information", Entropy 16 (2014) ("BROJA"):
    UI(T: A \\ B) = min_{Q ∈ Δ_P} I_Q(T; A | B),  Δ_P = {Q : Q(t,a) = P(t,a), Q(t,b) = P(t,b)},
    Red = I(T;A) − UI(T: A \\ B),  Syn = I(T;A|B) − UI(T: A \\ B),  UI(T: B \\ A) = I(T;B) − Red.
On Δ_P, I_Q(T;A,B) = I(T;B) + I_Q(T;A|B) (I(T;B) is fixed), so one convex program (minimise I_Q(T;A,B),
i.e. maximise H_Q(T|A,B), over a polytope) gives all four atoms; it is solved with scipy's SLSQP.
"""
from __future__ import annotations

import numpy as np
from scipy.linalg import null_space
from scipy.optimize import minimize

FLOOR = 1e-15  # keeps log2 finite (and the gradient bounded) at empty cells; 0·log 0 = 0 as q·log q → 0


# --- input checks --------------------------------------------------------------------------------------
def _codes(x, name: str) -> np.ndarray:
    """A 1-D array of discrete values mapped to 0..k-1 (labels, strings and booleans all work)."""
    x = np.asarray(x.cpu() if hasattr(x, "cpu") else x)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of discrete values, got shape {x.shape}")
    return np.unique(x, return_inverse=True)[1].reshape(-1)


def _same_length(**arrays) -> int:
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"arrays must have one row per example, got lengths {lengths}; pass aligned arrays")
    return next(iter(lengths.values()))


def _distribution(table) -> np.ndarray:
    p = np.asarray(table, dtype=np.float64)
    if p.size == 0 or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ValueError("table must hold finite non-negative counts or probabilities with a positive total")
    return p / p.sum()


def joint_counts(*variables) -> np.ndarray:
    """Counts of every value combination of aligned discrete samples: an array of shape (k_1, ..., k_m)."""
    if not variables:
        raise ValueError("joint_counts needs at least one variable")
    codes = [_codes(v, f"variable {i}") for i, v in enumerate(variables)]
    _same_length(**{f"variable {i}": c for i, c in enumerate(codes)})
    shape = tuple(int(c.max()) + 1 for c in codes)
    counts = np.zeros(shape, dtype=np.float64)
    np.add.at(counts, tuple(codes), 1.0)
    return counts


# --- information measures (bits) -----------------------------------------------------------------------
def entropy(table) -> float:
    """Shannon entropy (bits) of the joint distribution held in a count / probability table."""
    p = _distribution(table).ravel()
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def mutual_information_table(table) -> float:
    """I(X;Y) in bits from a 2-D table over (x, y): H(X) + H(Y) − H(X,Y)."""
    p = _distribution(table)
    if p.ndim != 2:
        raise ValueError(f"mutual_information_table needs a 2-D table (x, y), got {p.ndim}-D")
    return max(entropy(p.sum(1)) + entropy(p.sum(0)) - entropy(p), 0.0)


def conditional_mutual_information_table(table) -> float:
    """I(X;Y|W) in bits from a 3-D table over (x, y, w): H(X,W) + H(Y,W) − H(X,Y,W) − H(W)."""
    p = _distribution(table)
    if p.ndim != 3:
        raise ValueError(f"conditional_mutual_information_table needs a 3-D table (x, y, w), got {p.ndim}-D")
    value = entropy(p.sum(1)) + entropy(p.sum(0)) - entropy(p) - entropy(p.sum((0, 1)))
    return max(value, 0.0)


def mutual_information(x, y) -> float:
    """Plug-in I(X;Y) in bits from aligned discrete samples."""
    return mutual_information_table(joint_counts(x, y))


def conditional_mutual_information(x, y, w) -> float:
    """Plug-in I(X;Y|W) in bits from aligned discrete samples."""
    return conditional_mutual_information_table(joint_counts(x, y, w))


# --- partial information decomposition (BROJA) ---------------------------------------------------------
def _marginal_constraints(shape):
    """Rows of A with A·vec(Q) = the (t, a) and (t, b) marginals of Q over a (t, a, b) table."""
    eye = np.eye(int(np.prod(shape))).reshape(-1, *shape)
    by_ta = eye.sum(3).reshape(len(eye), -1).T  # one row per (t, a) cell
    by_tb = eye.sum(2).reshape(len(eye), -1).T  # one row per (t, b) cell
    return np.vstack([by_ta, by_tb])


def _joint_information(x, free, shape) -> tuple[float, np.ndarray]:
    """−H_Q(T | A,B) = Σ q log2(q / q(a,b)) (= I_Q(T; A,B) − H(T), H(T) fixed on Δ_P) and its gradient
    log2(q / q(a,b)) (the +1 terms of the two entropies cancel), over the cells `free` that Δ_P lets be > 0."""
    q = np.zeros(shape)
    q[free] = np.clip(x, 0, None)
    qab = np.broadcast_to(q.sum(0, keepdims=True), shape)[free]
    ratio = np.log2(np.maximum(q[free], FLOOR) / np.maximum(qab, FLOOR))
    return float((q[free] * ratio).sum()), ratio


def pid_broja(table, tol: float = 1e-14) -> dict:
    """BROJA PID of a table P(t, a, b) (target T first, then sources A and B), in bits.

    Returns {'unique_a', 'unique_b', 'redundant', 'synergistic', 'i_ta', 'i_tb', 'i_ta_given_b', 'i_t_ab'}.
    The minimiser starts at Q₀(t,a,b) = P(t,a) P(t,b) / P(t), which lies in Δ_P (A ⊥ B given T); cells with
    P(t,a) = 0 or P(t,b) = 0 are zero for every Q in Δ_P and are left out of the program."""
    p = _distribution(table)
    if p.ndim != 3:
        raise ValueError(f"pid_broja needs a 3-D table (target, source_a, source_b), got {p.ndim}-D")
    pt, pta, ptb = p.sum((1, 2)), p.sum(2), p.sum(1)
    free = (pta[:, :, None] > 0) & (ptb[:, None, :] > 0)
    q0 = np.where(free, pta[:, :, None] * ptb[:, None, :] / np.maximum(pt, FLOOR)[:, None, None], 0.0)
    # Δ_P = {q0 + N y ≥ 0}: N spans the directions that keep both pair marginals (A has redundant rows, which
    # SLSQP's equality solver handles badly, so the program is written over y with q ≥ 0 as linear inequalities)
    N = null_space(_marginal_constraints(p.shape)[:, free.ravel()])
    x0 = q0[free]
    q = q0
    if N.shape[1]:
        def objective(y):
            value, grad = _joint_information(x0 + N @ y, free, p.shape)
            return value, N.T @ grad
        res = minimize(objective, np.zeros(N.shape[1]), jac=True, method="SLSQP",
                       constraints=[{"type": "ineq", "fun": lambda y: x0 + N @ y, "jac": lambda y: N}],
                       options={"ftol": tol, "maxiter": 1000})
        if res.fun <= objective(np.zeros(N.shape[1]))[0]:  # never worse than the feasible start
            q = np.zeros(p.shape)
            q[free] = np.clip(x0 + N @ res.x, 0, None)
    i_ta, i_tb = mutual_information_table(pta), mutual_information_table(ptb)
    i_ta_given_b = conditional_mutual_information_table(p)
    unique_a = min(conditional_mutual_information_table(q), i_ta, i_ta_given_b)
    redundant = i_ta - unique_a
    return {"unique_a": unique_a, "unique_b": i_tb - redundant, "redundant": redundant,
            "synergistic": i_ta_given_b - unique_a, "i_ta": i_ta, "i_tb": i_tb, "i_ta_given_b": i_ta_given_b,
            "i_t_ab": mutual_information_table(p.reshape(p.shape[0], -1))}


# --- group fairness gaps -------------------------------------------------------------------------------
def _rates(y_pred, groups) -> np.ndarray:
    """P(Ŷ = 1 | group) for each group present."""
    y_pred = np.asarray(y_pred, dtype=np.float64)
    return np.array([y_pred[groups == g].mean() for g in np.unique(groups)])


def _binary(y, name: str) -> np.ndarray:
    y = np.asarray(y.cpu() if hasattr(y, "cpu") else y).reshape(-1)
    if not np.isin(y, (0, 1)).all():
        raise ValueError(f"{name} must hold binary labels 0/1 (the positive decision is 1), got {np.unique(y)[:5]}")
    return y.astype(np.int64)


def statistical_parity_gap(y_pred, z) -> float:
    """max_z P(Ŷ=1 | Z=z) − min_z P(Ŷ=1 | Z=z); 0 when every group receives the positive decision equally."""
    y_pred, z = _binary(y_pred, "y_pred"), _codes(z, "z")
    _same_length(y_pred=y_pred, z=z)
    rates = _rates(y_pred, z)
    return float(rates.max() - rates.min())


def equalised_odds_gap(y_pred, y_true, z) -> float:
    """max over y ∈ {0, 1} of the parity gap among rows with Y = y (the larger of the TPR and FPR gaps)."""
    y_pred, y_true, z = _binary(y_pred, "y_pred"), _binary(y_true, "y_true"), _codes(z, "z")
    _same_length(y_pred=y_pred, y_true=y_true, z=z)
    gaps = [statistical_parity_gap(y_pred[y_true == y], z[y_true == y]) for y in (0, 1)
            if len(np.unique(z[y_true == y])) > 1]
    return float(max(gaps)) if gaps else 0.0


def per_client(metric, clients, *arrays) -> dict:
    """{client: metric(*arrays restricted to that client's rows)}; clients holding one group only score 0."""
    clients = np.asarray(clients.cpu() if hasattr(clients, "cpu") else clients).reshape(-1)
    arrays = [np.asarray(a.cpu() if hasattr(a, "cpu") else a).reshape(-1) for a in arrays]
    _same_length(clients=clients, **{f"array {i}": a for i, a in enumerate(arrays)})
    return {c: metric(*(a[clients == c] for a in arrays)) for c in np.unique(clients)}


def fairness_report(y_pred, z, clients, y_true=None) -> dict:
    """Global and local group fairness of hard predictions: the statistical-parity gap on all rows and on
    each client's rows (plus the worst client), the same for equalised odds when `y_true` is given, and the
    information view: global disparity I(Z;Ŷ) and local disparity I(Z;Ŷ|S) in bits."""
    report = {"sp_global": statistical_parity_gap(y_pred, z),
              "sp_local": per_client(statistical_parity_gap, clients, y_pred, z)}
    report["sp_local_max"] = max(report["sp_local"].values())
    if y_true is not None:
        report["eo_global"] = equalised_odds_gap(y_pred, y_true, z)
        report["eo_local"] = per_client(equalised_odds_gap, clients, y_pred, y_true, z)
        report["eo_local_max"] = max(report["eo_local"].values())
    report["global_disparity"] = mutual_information(z, y_pred)
    report["local_disparity"] = conditional_mutual_information(z, y_pred, clients)
    return report
