"""Locational local DP (fedlab_nb.methods.beyond.locational_dp): exact LDP ratios, unbiasedness, variance, calibration."""
import numpy as np
import pytest

from fedlab_nb.methods.beyond import locational_dp as L


@pytest.mark.parametrize("k", [2, 5, 42])
@pytest.mark.parametrize("eps", [0.5, 1.0, 8.0])
def test_grr_ratio_is_exactly_e_to_epsilon(eps, k):
    assert abs(L.max_log_ratio(L.grr_channel(eps, k)) - eps) < 1e-12
    assert np.allclose(L.grr_channel(eps, k).sum(1), 1.0, atol=1e-15)


def test_official_one_hot_bit_flips_cost_two_epsilon():
    for eps in (0.5, 2.0):
        assert abs(L.unary_flip_log_ratio(eps, 5) - 2 * eps) < 1e-12


def test_debiased_counts_unbiased_exactly_and_variance_by_simulation():
    c, k, eps = np.array([30.0, 50.0, 20.0]), 3, 1.0
    assert np.abs(L.debias_counts(L.expected_reports(c, eps, k), c.sum(), eps, k) - c).max() < 1e-12
    rng = np.random.default_rng(0)
    values = np.repeat(np.arange(k), c.astype(int))
    sims = np.array([L.debias_counts(np.bincount(L.randomized_response(values, k, eps, rng), minlength=k),
                                     len(values), eps, k) for _ in range(4000)])
    ratio = sims.var(0, ddof=1) / L.debiased_variance(c, len(values), eps, k)
    assert np.all(np.abs(ratio - 1) < 0.1)
    assert np.all(np.abs(sims.mean(0) - c) < 4 * np.sqrt(L.debiased_variance(c, len(values), eps, k) / 4000))


def test_randomized_response_against_dp_accounting():
    import dp_accounting as dpa
    for eps, k in [(1.0, 2), (2.0, 5)]:
        noise = k / (np.exp(eps) + k - 1)          # dp-accounting's parameter: w.p. `noise` report uniform
        acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE).compose(
            dpa.RandomizedResponseDpEvent(noise, k))   # local DP: one user replaced by another
        assert abs(acc.get_epsilon(1e-12) - eps) < 1e-3


def test_analytic_gaussian_matches_dp_accounting_and_is_below_classic():
    import dp_accounting as dpa
    for eps in (0.5, 2.0):
        sigma = L.gaussian_sigma(eps, 1e-5, 1.0)
        acc = dpa.pld.PLDAccountant().compose(dpa.GaussianDpEvent(sigma))
        assert abs(acc.get_epsilon(1e-5) - eps) < 2e-3
    assert L.gaussian_sigma(0.5, 1e-5, 3.0) < L.gaussian_sigma(0.5, 1e-5, 3.0, "classic")
    assert abs(L.gaussian_sigma(0.5, 1e-5, 3.0) - 3 * L.gaussian_sigma(0.5, 1e-5, 1.0)) < 1e-9


def test_noisy_argmax_channel_and_debias():
    rng = np.random.default_rng(1)
    C = L.noisy_argmax_channel(1.0, 4)
    assert np.allclose(C.sum(1), 1.0, atol=1e-9)
    v = rng.integers(0, 4, 100000)
    r = L.noisy_argmax(v, 4, 1.0, rng)
    emp = np.array([np.bincount(r[v == i], minlength=4) / np.sum(v == i) for i in range(4)])
    assert np.abs(emp - C).max() < 0.01
    c = np.array([10.0, 60.0, 20.0, 10.0])
    assert np.abs(L.channel_debias(c @ C, C) - c).max() < 1e-9


def test_local_vs_central_scaling():
    assert abs(L.central_count_std(1.0) - np.sqrt(2)) < 1e-15
    assert L.local_count_std(4000, 1000, 1.0) / L.local_count_std(1000, 250, 1.0) == pytest.approx(2.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="epsilon"):
        L.grr_probabilities(0.0, 2)
    with pytest.raises(ValueError, match="k"):
        L.grr_channel(1.0, 1)
    with pytest.raises(ValueError, match="values must lie"):
        L.randomized_response([0, 3], 3, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="analytic"):
        L.gaussian_sigma(2.0, 1e-5, 1.0, "classic")
