"""fedlab_nb.methods.more.fairness: plug-in information measures against scipy / scikit-learn, the group-fairness gaps on
hand-counted examples, and the BROJA PID against published values (Bertschinger et al. 2014) and a brute-force
search of the polytope Δ_P."""
import numpy as np
import pytest
from scipy.linalg import null_space
from scipy.optimize import linprog
from scipy.stats import entropy as scipy_entropy
from sklearn.metrics import mutual_info_score

from fedlab_nb.methods.more import fairness as F

LN2 = np.log(2)


def samples(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 3, n)
    x = (rng.random(n) < 0.3 + 0.2 * w).astype(int)
    y = (rng.random(n) < 0.2 + 0.5 * x).astype(int) + 2 * (w == 2)
    return x, y, w


def test_entropy_and_mi_match_scipy_and_sklearn():
    x, y, w = samples()
    counts = F.joint_counts(x, y)
    assert F.entropy(counts) == pytest.approx(scipy_entropy(counts.ravel(), base=2), abs=1e-12)
    assert F.mutual_information(x, y) == pytest.approx(mutual_info_score(x, y) / LN2, abs=1e-12)


def test_conditional_mi_is_the_weighted_mi_within_strata():
    x, y, w = samples()
    reference = sum((w == v).mean() * mutual_info_score(x[w == v], y[w == v]) for v in np.unique(w)) / LN2
    assert F.conditional_mutual_information(x, y, w) == pytest.approx(reference, abs=1e-12)


def test_tables_accept_counts_or_probabilities_and_reject_bad_input():
    t = np.array([[3.0, 1.0], [1.0, 3.0]])
    assert F.mutual_information_table(t) == pytest.approx(F.mutual_information_table(t / 8), abs=1e-15)
    with pytest.raises(ValueError, match="2-D"):
        F.mutual_information_table(np.ones(4))
    with pytest.raises(ValueError, match="non-negative"):
        F.entropy([1.0, -1.0])
    with pytest.raises(ValueError, match="one row per example"):
        F.joint_counts([0, 1], [0, 1, 1])


def test_parity_and_equalised_odds_gaps_by_hand():
    y_pred = np.array([1, 1, 0, 0, 1, 0, 0, 0])
    z = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    y_true = np.array([1, 0, 0, 0, 1, 1, 0, 0])
    assert F.statistical_parity_gap(y_pred, z) == pytest.approx(0.5 - 0.25)
    # y=1: z=0 rate 1, z=1 rate 1/2; y=0: z=0 rate 1/3, z=1 rate 0 → max(1/2, 1/3)
    assert F.equalised_odds_gap(y_pred, y_true, z) == pytest.approx(0.5)
    clients = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    local = F.per_client(F.statistical_parity_gap, clients, y_pred, z)
    assert local == {0: pytest.approx(0.0), 1: pytest.approx(0.5)}  # client 0: 1/2 vs 1/2; client 1: 1/2 vs 0
    with pytest.raises(ValueError, match="binary"):
        F.statistical_parity_gap([0, 2], [0, 1])


def test_fairness_report_information_view():
    y_pred, z, clients = np.array([0, 1, 0, 1]), np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1])
    r = F.fairness_report(y_pred, z, clients)
    assert r["sp_global"] == 1.0 and r["sp_local_max"] == 1.0
    assert r["global_disparity"] == pytest.approx(1.0) and r["local_disparity"] == pytest.approx(1.0)


def gate(fn, n_a=2, n_b=2):
    """P(t, a, b) for A, B independent uniform and T = fn(a, b)."""
    outs = {(a, b): fn(a, b) for a in range(n_a) for b in range(n_b)}
    p = np.zeros((max(outs.values()) + 1, n_a, n_b))
    for (a, b), t in outs.items():
        p[t, a, b] = 1
    return p / p.sum()


def test_pid_published_values():
    # Bertschinger et al. (2014), examples: AND — SI = 0.311, CI = 0.5, UI = 0; XOR — CI = 1; COPY — UI = 1 each.
    d = F.pid_broja(gate(lambda a, b: a & b))
    assert d["redundant"] == pytest.approx(0.311278124459, abs=1e-6)
    assert d["synergistic"] == pytest.approx(0.5, abs=1e-6)
    assert abs(d["unique_a"]) < 1e-6 and abs(d["unique_b"]) < 1e-6
    assert F.pid_broja(gate(lambda a, b: a ^ b))["synergistic"] == pytest.approx(1.0, abs=1e-9)
    copy = F.pid_broja(gate(lambda a, b: 2 * a + b))
    assert copy["unique_a"] == pytest.approx(1, abs=1e-6) and copy["unique_b"] == pytest.approx(1, abs=1e-6)
    assert abs(copy["redundant"]) < 1e-6 and abs(copy["synergistic"]) < 1e-6


def brute_force_unique(p, steps=401):
    """min over a fine grid of the 2-D polytope Δ_P (binary T, A, B) of I_Q(T; A | B)."""
    N = null_space(F._marginal_constraints(p.shape))
    box = [[linprog(sign * e, A_ub=-N, b_ub=p.ravel(), bounds=[(None, None)] * 2).x @ e for sign in (1, -1)]
           for e in np.eye(2)]  # the polytope's bounding box in null-space coordinates
    u, v = np.meshgrid(np.linspace(*box[0], steps), np.linspace(*box[1], steps))
    q = p.ravel() + np.stack([u.ravel(), v.ravel()], 1) @ N.T
    q = q[q.min(1) >= 0].reshape(-1, *p.shape)

    def h(t, axes):  # entropies of the marginal over `axes` (kept), one per grid point
        m = t.sum(axis=tuple(i for i in (1, 2, 3) if i not in axes)).reshape(len(t), -1)
        return -(np.where(m > 0, m * np.log2(np.where(m > 0, m, 1)), 0)).sum(1)
    cmi = h(q, (1, 3)) + h(q, (2, 3)) - h(q, (1, 2, 3)) - h(q, (3,))  # I(T;A|B) on (t, a, b)
    return min(cmi.min(), F.conditional_mutual_information_table(p))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pid_unique_is_the_minimum_over_the_polytope(seed):
    p = np.random.default_rng(seed).dirichlet(np.ones(8)).reshape(2, 2, 2)
    d = F.pid_broja(p)
    grid_min = brute_force_unique(p, steps=801)
    assert grid_min - 1e-5 <= d["unique_a"] <= grid_min + 1e-9  # at or below every grid point, and close to them
    for atom in ("unique_a", "unique_b", "redundant", "synergistic"):
        assert d[atom] >= -1e-12


def test_pid_rejects_wrong_shape():
    with pytest.raises(ValueError, match="3-D"):
        F.pid_broja(np.ones((2, 2)))
