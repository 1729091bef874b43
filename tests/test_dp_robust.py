"""SMEA and the private + robust mean estimate (fedlab_nb/methods/more/dp_robust.py), float64."""
import itertools
import math

import numpy as np
import pytest
import scipy.linalg
import torch

from fedlab_nb.methods.privacy import accounting
from fedlab_nb.methods.more import dp_robust as R
from fedlab_nb.methods.robustness.attacks import choose_byzantine, get_attack


def _points(n, d, seed):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _brute_force_subset(x: np.ndarray, f: int):
    """Independent reference: d×d covariance per subset, top eigenvalue by scipy.linalg.eigh."""
    n, d = x.shape
    best, best_val = None, math.inf
    for s in itertools.combinations(range(n), n - f):
        c = x[list(s)] - x[list(s)].mean(0)
        val = scipy.linalg.eigh(c.T @ c / len(s), eigvals_only=True, subset_by_index=[d - 1, d - 1])[0]
        if val < best_val:
            best, best_val = s, val
    return best


def test_f0_is_the_mean():
    x = _points(7, 30, 0)
    assert torch.allclose(R.smea(x, f=0), x.mean(0), rtol=0, atol=1e-14)


@pytest.mark.parametrize("n,f,d,seed", [(8, 2, 5, 1), (10, 2, 12, 2), (9, 3, 4, 3), (6, 1, 40, 4)])
def test_matches_brute_force_and_is_permutation_invariant(n, f, d, seed):
    x = _points(n, d, seed)
    assert R.smea_subset(x, f) == _brute_force_subset(x.numpy(), f)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    assert torch.allclose(R.smea(x[perm], f=f), R.smea(x, f=f), rtol=0, atol=1e-12)


def test_far_outliers_are_excluded():
    n, f, d, sigma = 10, 2, 50, 0.3
    x = sigma * _points(n, d, 5)
    x[:f] += 10 * math.sqrt(d) * sigma * torch.nn.functional.normalize(_points(f, d, 6), dim=1)
    assert R.smea_subset(x, f) == tuple(range(f, n))


@pytest.mark.parametrize("attack", ["alie", "sign_flip", "ipm"])
def test_resilience_bound_holds(attack):
    n, f, d = 10, 2, 60
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        x = 1.0 + _points(n, d, 10 + seed)
        mask = choose_byzantine(n, f, g)
        sent = get_attack(attack)(x, mask)
        err = float((R.smea(sent, f=f) - x[~mask].mean(0)).pow(2).sum())
        assert err <= R.resilience_bound(x[~mask], f) * (1 + 1e-12)


def test_top_eigenvalue_equals_covariance_spectrum():
    x = _points(6, 9, 7)
    cov = np.cov(x.numpy().T, bias=True)
    assert abs(float(R.top_eigenvalue(x)) - np.linalg.eigvalsh(cov)[-1]) < 1e-12


def test_gaussian_mechanism():
    # hand case: B = 1, m = 50, ε = 0.5, δ = 1e-5: (2/50)·√(2 ln 125000)/0.5
    assert R.classic_sigma(1.0, 50, 0.5, 1e-5) == pytest.approx(0.04 * math.sqrt(2 * math.log(125000)) / 0.5, rel=1e-15)
    sigma = R.gaussian_sigma(1.0, 50, 0.5, 1e-5)
    assert sigma < R.classic_sigma(1.0, 50, 0.5, 1e-5)       # the PLD calibration is tighter than Dwork–Roth
    eps = accounting.epsilon(1.0, sigma / 0.04, 1, 1e-5, accountant="pld")
    assert eps <= 0.5 + 1e-6 and eps > 0.49
    assert R.honest_dp_error(100, 0.1, 10, 2) == pytest.approx(100 * 0.01 / 8, rel=1e-15)


def test_private_robust_mean_without_attack_averages_the_private_means():
    g = torch.Generator().manual_seed(0)
    pts = 0.1 * torch.randn(6, 20, 5, generator=g, dtype=torch.float64)
    out = R.private_robust_mean(pts, 0, epsilon=2.0, delta=1e-5, radius=1.0, generator=g)
    assert torch.allclose(out["estimate"], out["honest"].mean(0), rtol=0, atol=1e-14)


def test_bad_input_raises():
    x = _points(6, 3, 0)
    with pytest.raises(ValueError, match="2f < n"):
        R.smea(x, f=3)
    with pytest.raises(ValueError, match="epsilon < 1"):
        R.classic_sigma(1.0, 10, 2.0, 1e-5)
    with pytest.raises(ValueError, match="shape"):
        R.smea(x[0], f=0)


def test_smea_in_the_method_rule_slot():
    # f = 0: SMEA in the round pipeline is uniform-weight FedAvg; f = 2 with ALIE runs end to end
    import functools
    import fedlab_nb as fl
    from fedlab_nb.methods.robustness.robust_aggregation import robust_method
    from fedlab_nb.core.method import LocalObjective, Method, ServerSGD, UniformWeighting
    fed = fl.federate("digits", partition="iid", n_clients=6, seed=0)
    kw = dict(rounds=2, clients_per_round=6, local_epochs=1, batch_size=32, lr=0.1, seed=0, progress=False)
    smea0 = Method("smea", LocalObjective(), UniformWeighting(), functools.partial(R.smea, f=0), ServerSGD(lr=1.0))
    a, b = fl.simulate(smea0, fed, **kw), fl.simulate(robust_method("mean"), fed, **kw)
    assert list(a["test_acc"]) == list(b["test_acc"])
    smea2 = Method("smea", LocalObjective(), UniformWeighting(), functools.partial(R.smea, f=2), ServerSGD(lr=1.0))
    h = fl.simulate(smea2, fed, attack=get_attack("alie"), byzantine=[0, 1], **kw)
    assert len(h) >= 2 and h["test_acc"].notna().all()
