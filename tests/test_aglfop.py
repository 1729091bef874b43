"""AGLFOP (fedlab_nb.methods.more.aglfop): the canonical examples, the chain-rule identity and bound, the PID
identities of global / local disparity, the frontier's monotonicity and the local-implies-global ordering,
the paper's client splits, and the errors."""
import math

import numpy as np
import pytest

from fedlab_nb.methods.more import aglfop as A


@pytest.mark.parametrize("case,values", [("unique", (1, 1, 1, 0, 0)), ("redundant", (1, 0, 0, 1, 0)),
                                         ("masked", (0, 1, 0, 0, 1))])
def test_canonical_examples(case, values):
    d = A.disparities(A.canonical_table(case))
    got = (d["global"], d["local"], d["unique"], d["redundant"], d["masked"])
    assert np.allclose(got, values, atol=1e-9)


def test_identities_on_random_tables():
    rng = np.random.default_rng(0)
    for _ in range(100):
        p = rng.dirichlet(np.ones(12)).reshape(2, 3, 2)  # three clients
        d = A.disparities(p)
        assert abs(A.chain_rule_residual(p)) < 1e-12
        assert d["global"] <= d["local"] + d["i_zs"] + 1e-12
        assert d["global"] == pytest.approx(d["unique"] + d["redundant"], abs=1e-12)
        assert d["local"] == pytest.approx(d["unique"] + d["masked"], abs=1e-12)
        assert min(d["unique"], d["redundant"], d["masked"], d["unique_s"]) >= -1e-12


def synthetic(seed=0):
    p_y1 = np.random.default_rng(seed).uniform(0.05, 0.95, size=(2, 2))
    p_sz = np.outer([0.3, 0.7], [0.6, 0.4])  # Z ⊥ S
    return np.stack([p_sz * (1 - p_y1), p_sz * p_y1], axis=2)


def test_unconstrained_optimum_is_perfect_and_constant_is_feasible_at_zero():
    p = synthetic()
    assert A.aglfop(p)["accuracy"] == pytest.approx(1.0, abs=1e-9)  # r may read Y: an upper bound
    zero = A.aglfop(p, 0.0, 0.0)
    assert zero["global"] <= 1e-7 and zero["local"] <= 1e-7


def test_frontier_monotone_and_local_implies_global():
    p = synthetic(1)
    eps = [0.002, 0.01, 0.05]
    glob = [A.aglfop(p, e, math.inf)["accuracy"] for e in eps]
    loc = [A.aglfop(p, math.inf, e)["accuracy"] for e in eps]
    assert np.all(np.diff(glob) >= -1e-6) and np.all(np.diff(loc) >= -1e-6)
    assert all(l <= g + 1e-6 for l, g in zip(loc, glob))  # I(Z;S) = 0: local ε ⇒ global ε


def test_two_client_split_scenarios():
    rng = np.random.default_rng(0)
    z, y = rng.integers(0, 2, 5000), rng.integers(0, 2, 5000)
    syn = A.two_client_split(z, y, "synergy", np.random.default_rng(1), swap=0.0)
    assert np.all((syn == 0) == (z == y))
    het = A.two_client_split(z, y, "heterogeneity", np.random.default_rng(1), swap=0.0)
    assert (het[z == 1] == 0).mean() == pytest.approx(0.92, abs=1e-3)
    assert (het[z == 0] == 0).mean() == pytest.approx(0.08, abs=1e-3)
    swapped = A.two_client_split(z, y, "synergy", np.random.default_rng(1))
    assert 0 < (swapped != syn).sum() <= 2 * int(0.01 * min((syn == 0).sum(), (syn == 1).sum()))


def test_audit_reports_both_views():
    rng = np.random.default_rng(0)
    z = rng.integers(0, 2, 400)
    clients = rng.integers(0, 2, 400)
    y_pred = z ^ clients  # the masked case, sampled
    r = A.audit(y_pred, z, clients, y_true=y_pred)
    assert r["pid"]["masked"] > 0.9 and r["pid"]["global"] < 0.05
    assert r["sp_local_max"] == pytest.approx(1.0) and "eo_global" in r


def test_errors():
    with pytest.raises(ValueError, match="case"):
        A.canonical_table("other")
    with pytest.raises(ValueError, match="eps_global"):
        A.aglfop(synthetic(), eps_global=-1)
    with pytest.raises(ValueError, match="binary y"):
        A.aglfop(np.ones((2, 2, 3)))
    with pytest.raises(ValueError, match="how"):
        A.two_client_split([0, 1], [0, 1], "dirichlet", np.random.default_rng(0))
