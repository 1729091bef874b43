"""Sub-posterior combination (fedlab_nb/methods/beyond/smc_fusion.py): the exact Gaussian product first (float64), then
Consensus Monte Carlo, the samplers and the tree-SMC analogue on a conjugate target."""
import numpy as np
import pytest
from scipy import integrate, stats

from fedlab_nb.methods.beyond import smc_fusion as sf


def test_gaussian_product_matches_quadrature_in_1d():
    mus, sds = np.array([[-0.4], [1.1], [2.5]]), np.array([0.5, 1.7, 0.8])
    mean, cov = sf.gaussian_product(mus, (sds ** 2)[:, None, None])
    dens = lambda t: np.prod(stats.norm.pdf(t, mus[:, 0], sds))  # noqa: E731
    z = integrate.quad(dens, -40, 40, epsabs=1e-14, epsrel=1e-13)[0]
    m = integrate.quad(lambda t: t * dens(t), -40, 40, epsabs=1e-14, epsrel=1e-13)[0] / z
    v = integrate.quad(lambda t: (t - m) ** 2 * dens(t), -40, 40, epsabs=1e-14, epsrel=1e-13)[0] / z
    assert abs(mean[0] - m) < 1e-10 and abs(cov[0, 0] - v) < 1e-10


def test_gaussian_product_in_2d_against_the_completed_square():
    rng = np.random.default_rng(0)
    mus = rng.normal(size=(4, 2))
    covs = np.stack([a @ a.T + 0.1 * np.eye(2) for a in rng.normal(size=(4, 2, 2))])
    mean, cov = sf.gaussian_product(mus, covs)
    # the product's log-density minus the Gaussian's must be constant in θ
    thetas = rng.normal(size=(5, 2)) * 3
    def log_prod(t):
        return sum(stats.multivariate_normal.logpdf(t, m, c) for m, c in zip(mus, covs))
    diff = log_prod(thetas) - stats.multivariate_normal.logpdf(thetas, mean, cov)
    assert np.ptp(diff) < 1e-10
    with pytest.raises(ValueError, match="covs"):
        sf.gaussian_product(mus, covs[:, :1])


def test_consensus_monte_carlo_with_exact_precisions_is_the_linear_map():
    rng = np.random.default_rng(1)
    draws = rng.normal(size=(3, 50, 2))
    prec = np.stack([np.eye(2) * k for k in (1.0, 2.0, 3.0)])
    out = sf.consensus_monte_carlo(draws, precisions=prec)
    assert np.allclose(out, (1 * draws[0] + 2 * draws[1] + 3 * draws[2]) / 6, atol=1e-12)
    with pytest.raises(ValueError, match="precisions"):
        sf.consensus_monte_carlo(draws, precisions=prec[:2])
    with pytest.raises(ValueError, match="samples"):
        sf.consensus_monte_carlo(draws[:, :2])


def test_ess_and_split_rhat():
    assert sf.ess(np.zeros(10)) == pytest.approx(10)
    assert sf.ess(np.r_[0.0, -np.inf * np.ones(9)]) == pytest.approx(1)
    rng = np.random.default_rng(2)
    same = rng.normal(size=(4, 2000, 1))
    assert abs(sf.split_rhat(same)[0] - 1) < 0.01
    shifted = same + np.arange(4)[:, None, None]
    assert sf.split_rhat(shifted)[0] > 1.5


def test_rwm_targets_a_gaussian():
    rng = np.random.default_rng(3)
    draws, acc = sf.rwm(lambda t: -0.5 * ((t - 2.0) ** 2).sum(1) / 0.25, np.zeros((8, 1)), 4000, 1.2 * 0.5 * np.eye(1),
                        rng, burn=500)
    assert 0.2 < acc.mean() < 0.8
    assert abs(draws.mean() - 2.0) < 0.05 and abs(draws.std() - 0.5) < 0.05


def test_tree_smc_recovers_a_conjugate_product():
    # four Poisson-log-rate sub-posteriors a_c θ − b_c e^θ; the product is log Gamma(Σa, Σb), drawn exactly
    rng = np.random.default_rng(4)
    a, b = np.array([0.3, 2.25, 1.25, 4.25]), np.array([3.25, 3.25, 3.25, 3.25])
    leaves = [np.log(rng.gamma(ac, 1 / bc, size=(3000, 1))) for ac, bc in zip(a, b)]
    log_group = lambda ls, t: (a[list(ls)].sum() * t - b[list(ls)].sum() * np.exp(t))[:, 0]  # noqa: E731
    root, nodes = sf.tree_smc(leaves, log_group, rng, n_moves=5, n_particles=2000)
    truth = np.log(rng.gamma(a.sum(), 1 / b.sum(), size=100_000))
    assert len(nodes) == 3 and {n["level"] for n in nodes} == {1, 2}
    assert sf.marginal_w1(root[:, 0], truth) < 0.03
    with pytest.raises(ValueError, match="ess_fraction"):
        sf.tree_smc(leaves, log_group, rng, ess_fraction=1.5)
