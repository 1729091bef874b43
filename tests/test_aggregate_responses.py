"""Learning from aggregate responses: the per-bag identity, the estimators' closed forms against a numerical
minimiser (scipy L-BFGS-B), the exact bias/variance path against direct formulas, and the DP noise scale."""
import numpy as np
import pytest
from scipy.optimize import minimize

from fedlab_nb.methods.privacy import aggregate_responses as A


def _data(n=60, d=4, k=3, seed=0, bagging="random"):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    theta_star = rng.standard_normal(d)
    y = x @ theta_star + rng.standard_normal(n)
    bags = A.make_bags(bagging, x, k, rng)
    return x, y, bags, A.bag_means(y, bags), theta_star


@pytest.mark.parametrize("bagging", A.BAGGINGS)
def test_identity_per_bag_and_losses(bagging):
    x, y, bags, ybar, _ = _data(bagging=bagging)
    theta = np.random.default_rng(1).standard_normal(x.shape[1]) * 3
    f = x @ theta
    assert max(abs(A.identity_residual(yb, f[b])) for yb, b in zip(ybar, bags)) < 1e-9
    gap = A.instance_loss(theta, x, ybar, bags) - A.bag_loss(theta, x, ybar, bags) \
        - A.within_bag_variance(theta, x, bags)
    assert abs(gap) < 1e-10


def test_identity_residual_is_not_trivially_zero():
    # a wrong decomposition (forgetting the factor k) must leave a residual: the check can fail
    f = np.array([1.0, 4.0, -2.0])
    wrong = np.sum((0.5 - f) ** 2) - ((0.5 - f.mean()) ** 2 + np.sum((f - f.mean()) ** 2))
    assert abs(wrong) > 0.1 and abs(A.identity_residual(0.5, f)) < 1e-12


def test_endpoints_of_interpolating_estimator():
    x, y, bags, ybar, _ = _data()
    assert np.allclose(A.interpolating_estimator(x, ybar, bags, 0.0), A.bag_level_estimator(x, ybar, bags),
                       atol=1e-10, rtol=0)
    assert np.allclose(A.interpolating_estimator(x, ybar, bags, 1.0), A.instance_level_estimator(x, ybar, bags),
                       atol=1e-10, rtol=0)
    # and the two ends really differ (the check is not vacuous)
    assert np.abs(A.bag_level_estimator(x, ybar, bags) - A.instance_level_estimator(x, ybar, bags)).max() > 1e-2


@pytest.mark.parametrize("rho", [0.0, 0.3, 1.0])
def test_closed_form_equals_numerical_minimiser(rho):
    x, y, bags, ybar, _ = _data(seed=2)
    fun = lambda t: A.interpolating_loss(t, x, ybar, bags, rho)
    res = minimize(fun, np.zeros(x.shape[1]), method="L-BFGS-B", options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 2000})
    closed = A.interpolating_estimator(x, ybar, bags, rho)
    assert np.abs(res.x - closed).max() < 1e-5
    assert fun(closed) <= res.fun + 1e-12


def test_rho_path_matches_direct_formulas():
    x, y, bags, ybar, theta_star = _data(n=90, d=5, k=3, seed=3)
    path = A.RhoPath(x, bags)
    g_bag, g, _ = A.normal_matrices(x, ybar, bags)
    for rho in (0.0, 0.2, 1.0):
        m_inv = np.linalg.inv((1 - rho) * g_bag + rho * g)
        bias2 = np.sum((m_inv @ g_bag @ theta_star - theta_star) ** 2)
        var = 2.0 * np.trace(m_inv @ g_bag @ m_inv)
        assert path.bias2(rho, theta_star) == pytest.approx(bias2, rel=1e-8, abs=1e-14)
        assert path.variance(rho, 2.0) == pytest.approx(var, rel=1e-8)


def test_variance_against_monte_carlo():
    # the exact conditional variance vs. the spread of θ̂ over fresh noise draws (fixed X, bags)
    x, _, bags, _, theta_star = _data(n=120, d=3, k=4, seed=4)
    rng = np.random.default_rng(5)
    ys = x @ theta_star + rng.standard_normal((4000, len(x)))
    ybars = ys[:, bags].mean(2)
    est = A.solve_many(x, bags, 0.5, ybars)
    mc_var = np.sum(est.var(0))
    assert A.RhoPath(x, bags).variance(0.5, 1.0) == pytest.approx(mc_var, rel=0.08)


def test_dp_noise_scale_and_release():
    assert A.dp_noise_scale(5, 2.0, 3.0) == pytest.approx(2 * 3.0 / (5 * 2.0))
    rng = np.random.default_rng(0)
    y = rng.standard_normal(5000) * 10
    bags = A.random_bags(5000, 5, rng)
    rel = A.dp_bag_responses(y, bags, epsilon=1.0, clip=2.0, rng=rng, draws=50)
    noise = rel - np.clip(y, -2, 2)[bags].mean(1)
    b = A.dp_noise_scale(5, 1.0, 2.0)
    assert np.mean(np.abs(noise)) == pytest.approx(b, rel=0.02)       # Laplace(b): E|η| = b
    assert A.default_clip(2000, 2.0) == pytest.approx(2.0 * np.sqrt(np.log(2000)))


def test_sensitivity_bound_holds():
    # changing one response moves its clipped bag mean by at most 2·clip/k
    rng = np.random.default_rng(1)
    y = rng.standard_normal(20) * 5
    bags = A.random_bags(20, 4, rng)
    y2 = y.copy()
    y2[bags[0, 0]] = -y[bags[0, 0]] * 100
    diff = np.abs(np.clip(y, -1, 1)[bags].mean(1) - np.clip(y2, -1, 1)[bags].mean(1)).max()
    assert diff <= 2 * 1.0 / 4 + 1e-15


def test_clear_errors():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="must divide"):
        A.random_bags(10, 3, rng)
    with pytest.raises(ValueError, match="positive integer"):
        A.random_bags(10, 0, rng)
    with pytest.raises(ValueError, match="bagging must be one of"):
        A.make_bags("kmeans", np.zeros((4, 2)), 2, rng)
    x, y, bags, ybar, _ = _data()
    with pytest.raises(ValueError, match="rho must be in"):
        A.interpolating_estimator(x, ybar, bags, 1.5)
    with pytest.raises(ValueError, match="epsilon must be a finite number > 0"):
        A.dp_noise_scale(2, 0.0, 1.0)
    with pytest.raises(ValueError, match="every index"):
        A.bag_means(y, bags[:-1])
    with pytest.raises(ValueError, match="at least d="):
        A.bag_level_estimator(np.zeros((6, 4)), np.zeros(2), np.arange(6).reshape(2, 3))
    few_bags = A.RhoPath(np.random.default_rng(0).standard_normal((12, 6)), np.arange(12).reshape(3, 4))
    assert np.isinf(few_bags.variance(0.0)) and np.isnan(few_bags.bias2(0.0, np.ones(6)))
    assert np.isfinite(few_bags.variance(0.5))
