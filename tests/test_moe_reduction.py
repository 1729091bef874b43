"""Distributed MoE / GMM reduction (fedlab_nb.methods.beyond.moe_reduction): exact moment matching first, float64."""
import numpy as np
import pytest
from scipy.optimize import minimize

from fedlab_nb.methods.beyond import moe_reduction as R


def _random_components(rng, n=6, d=2):
    means = rng.normal(size=(n, d)) * 2
    A = rng.normal(size=(n, d, d))
    covs = A @ A.transpose(0, 2, 1) + 0.3 * np.eye(d)
    return rng.random(n) + 0.1, means, covs


def test_moment_matching_is_the_kl_barycenter():
    rng = np.random.default_rng(0)
    w, means, covs = _random_components(rng)
    mu, cov = R.moment_match(w, means, covs)

    def objective(v):  # mean and a Cholesky factor (log-diagonal) of the covariance
        L = np.array([[np.exp(v[2]), 0.0], [v[3], np.exp(v[4])]])
        return R.weighted_kl(w, means, covs, v[:2], L @ L.T)

    res = minimize(objective, np.array([0.0, 0.0, 0.0, 0.0, 0.0]), method="BFGS", options={"gtol": 1e-12})
    L = np.array([[np.exp(res.x[2]), 0.0], [res.x[3], np.exp(res.x[4])]])
    assert np.max(np.abs(res.x[:2] - mu)) < 1e-6
    assert np.max(np.abs(L @ L.T - cov)) < 1e-6
    assert objective(res.x) >= R.weighted_kl(w, means, covs, mu, cov) - 1e-12


def test_kl_is_zero_for_equal_gaussians_and_positive_otherwise():
    rng = np.random.default_rng(1)
    _, means, covs = _random_components(rng, n=2)
    assert abs(R.gaussian_kl(means[0], covs[0], means[0], covs[0])) < 1e-12
    assert R.gaussian_kl(means[0], covs[0], means[1], covs[1]) > 0


def _truth():
    return R.GMM(np.array([0.5, 0.3, 0.2]), np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]]),
                 np.array([np.eye(2), 0.5 * np.eye(2), np.diag([1.0, 0.4])]))


def test_reduction_invariant_to_local_permutations_naive_average_is_not():
    rng = np.random.default_rng(2)
    x = R.sample_gmm(_truth(), 6000, rng)
    parts = np.array_split(rng.permutation(len(x)), 4)
    locals_ = [R.fit_gmm(x[p], 3, seed=m, n_init=1)[0] for m, p in enumerate(parts)]
    sizes = [len(p) for p in parts]
    perm = [g.permuted(rng.permutation(3)) for g in locals_]
    a, _ = R.reduce_gmm(locals_, sizes)
    b, _ = R.reduce_gmm(perm, sizes)
    assert max(np.abs(a.means - b.means).max(), np.abs(a.covs - b.covs).max(), np.abs(a.weights - b.weights).max()) < 1e-12
    shuffled = [g.permuted([1, 2, 0]) if m == 0 else g for m, g in enumerate(locals_)]
    assert np.abs(R.naive_average(shuffled, sizes).means - R.naive_average(locals_, sizes).means).max() > 0.1
    assert R.gmm_error(a, _truth()) < 0.3


def test_mm_objective_never_increases():
    rng = np.random.default_rng(3)
    x = R.sample_gmm(_truth(), 4000, rng)
    parts = np.array_split(rng.permutation(len(x)), 5)
    locals_ = [R.fit_gmm(x[p], 3, seed=m, n_init=1)[0] for m, p in enumerate(parts)]
    _, info = R.reduce_gmm(locals_, [len(p) for p in parts])
    assert np.all(np.diff(info["costs"]) <= 1e-12)


def test_moe_expert_update_is_the_exact_minimiser():
    rng = np.random.default_rng(4)
    X = R.design(rng.uniform(-1, 1, 50))
    big = R.MoE(np.zeros((2, 1)), rng.normal(size=(2, 4)), rng.random(4) + 0.2)
    mass = rng.random((4, 50))
    red = R.MoE(np.zeros((2, 2)), rng.normal(size=(2, 2)), np.ones(2))
    plan, _ = R.transport_plan(big, mass, red, X)
    experts, variances = R.update_experts(big, plan, X)

    def cost(v, k):
        trial = R.MoE(red.gates, red.experts.copy(), red.variances.copy())
        trial.experts[:, k], trial.variances[k] = v[:2], np.exp(v[2])
        return float(np.sum(plan[:, k] * R.expert_kl(big, trial, X)[:, k]))

    for k in range(2):
        res = minimize(cost, np.zeros(3), args=(k,), method="BFGS", options={"gtol": 1e-12})
        assert np.max(np.abs(res.x[:2] - experts[:, k])) < 1e-6
        assert abs(np.exp(res.x[2]) - variances[k]) < 1e-6


def test_gate_irls_matches_sklearn_logistic_regression():
    from sklearn.linear_model import LogisticRegression
    rng = np.random.default_rng(5)
    x = rng.normal(size=400)
    y = (rng.random(400) < 1 / (1 + np.exp(-(0.5 + 2 * x)))).astype(int)
    X = R.design(x)
    gates = R.fit_gate(X, np.eye(2)[1 - y], np.zeros((2, 2)), iters=50)   # class 0 = "y = 1", reference = "y = 0"
    lr = LogisticRegression(C=1e12, tol=1e-12, max_iter=10000).fit(x[:, None], y)
    assert np.allclose(gates[:, 0], [lr.intercept_[0], lr.coef_[0, 0]], atol=1e-4)


def test_moe_em_and_reduction_recover_a_simple_moe():
    truth = R.MoE(np.array([[0.0, 0.0], [4.0, 0.0]]), np.array([[1.0, -1.0], [2.0, -1.5]]), np.array([0.25, 0.25]))
    rng = np.random.default_rng(6)
    x, y = R.sample_moe(truth, 4000, rng)
    g, _ = R.fit_moe(x, y, 2, seed=0, n_init=2)
    assert R.moe_error(g, truth) < 0.5
    parts = np.array_split(rng.permutation(len(x)), 4)
    locals_ = [R.fit_moe(x[p], y[p], 2, seed=m, n_init=2)[0] for m, p in enumerate(parts)]
    red, _ = R.reduce_moe(locals_, [len(p) for p in parts], x[:500], y[:500])
    X = R.design(x)
    assert abs(R.moe_loglik(red, X, y) - R.moe_loglik(g, X, y)) < 0.05


def test_bad_input_errors():
    with pytest.raises(ValueError, match="weights"):
        R.moment_match([-1.0, 1.0], np.zeros((2, 2)), np.stack([np.eye(2)] * 2))
    with pytest.raises(ValueError, match="same number of components"):
        g2 = R.GMM(np.ones(2) / 2, np.zeros((2, 2)), np.stack([np.eye(2)] * 2))
        g3 = R.GMM(np.ones(3) / 3, np.zeros((3, 2)), np.stack([np.eye(2)] * 3))
        R.reduce_gmm([g2, g3], [1, 1])
    with pytest.raises(ValueError, match="one size per local"):
        R.large_mixture([_truth()], [1, 2])
