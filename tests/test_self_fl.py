"""Self-FL (Chen et al., NeurIPS 2022): the hierarchical-Gaussian closed forms against Monte Carlo (float64),
the method-of-moments estimate, early stopping and the uncertainty-weighted rule."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.messages import Messages
from fedlab_nb.core.method import RoundInfo
from fedlab_nb.methods.personalisation.self_fl import (UncertaintyWeightedMean, closed_form_mse, early_stop, empirical_bayes,
                                       moment_sigma0_sq, posterior_mean, precision_weights, sample_hierarchy,
                                       shrinkage)

SIGMA_SQ = torch.tensor([1 / 5, 1 / 20, 1 / 60, 1 / 200], dtype=torch.float64)


@pytest.mark.parametrize("tau", [0.1, 0.5])
def test_closed_form_mse_matches_monte_carlo_and_orders_the_estimators(tau):
    s0, runs = tau ** 2, 200_000
    means, local = sample_hierarchy(1.0, s0, SIGMA_SQ, runs, 1, torch.Generator().manual_seed(3))
    means, local = means[..., 0], local[..., 0]                                   # [runs, K]
    w = precision_weights(SIGMA_SQ, s0)
    theta_hat = (local @ w)[:, None]
    b = shrinkage(SIGMA_SQ, s0)
    estimates = {"local": local, "global": theta_hat.expand_as(local), "personal": b * local + (1 - b) * theta_hat,
                 "oracle": posterior_mean(local.T, SIGMA_SQ, torch.tensor(1.0, dtype=torch.float64), s0).T}
    cf = closed_form_mse(s0, SIGMA_SQ)
    for name, est in estimates.items():
        err = (est - means) ** 2
        se = err.std(0) / runs ** 0.5
        assert torch.all((err.mean(0) - cf[name]).abs() < 4.5 * se), name
    assert torch.all(cf["personal"] < torch.minimum(cf["local"], cf["global"]))   # the ordering, exactly
    assert torch.all(cf["oracle"] <= cf["personal"])                               # knowing θ can only help
    assert torch.allclose(cf["oracle"], 1 / (1 / s0 + 1 / SIGMA_SQ), rtol=1e-12)


def test_precision_weights_are_the_minimum_variance_combination():
    s0 = 0.3 ** 2
    best = closed_form_mse(s0, SIGMA_SQ)["theta"]
    assert torch.isclose(best, 1 / (1 / (s0 + SIGMA_SQ)).sum(), rtol=1e-12)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        other = closed_form_mse(s0, SIGMA_SQ, weights=torch.rand(4, generator=g, dtype=torch.float64))["theta"]
        assert other >= best
    assert closed_form_mse(s0, SIGMA_SQ, weights=1 / SIGMA_SQ)["theta"] > best       # sample-size weights lose


def test_method_of_moments_is_unbiased_before_clipping():
    s0 = 1.0
    _, local = sample_hierarchy(0.0, s0, SIGMA_SQ, 100_000, 1, torch.Generator().manual_seed(5))
    spread = local[..., 0].var(1, unbiased=True).mean() - SIGMA_SQ.mean()
    assert abs(float(spread) - s0) < 0.02
    one = moment_sigma0_sq(local[0], SIGMA_SQ)
    assert one >= 0 and torch.isinf(moment_sigma0_sq(local[0, :1], SIGMA_SQ[:1]))


def test_empirical_bayes_shrinks_towards_the_precision_weighted_mean():
    local = torch.tensor([[0.0], [1.0], [2.0], [10.0]], dtype=torch.float64)
    personal, theta_hat, s0 = empirical_bayes(local, SIGMA_SQ)
    b = shrinkage(SIGMA_SQ, s0)[:, None]
    assert torch.allclose(personal, b * local + (1 - b) * theta_hat)
    assert torch.allclose(theta_hat, precision_weights(SIGMA_SQ, s0) @ local)


def test_early_stop_takes_round_b_times_T_steps():
    path = torch.stack([torch.full((3,), float(t)) for t in range(11)])    # T = 10, var of 0..10 = 11
    local, sigma_sq, steps = early_stop(path, 11.0 / 3)                    # b = (11/3) / (11/3 + 11) = 0.25
    assert torch.equal(local, path[-1]) and float(sigma_sq) == pytest.approx(11.0)
    assert steps == round(0.25 * 10)
    assert early_stop(path, float("inf"))[2] == 10 and early_stop(path, 0.0)[2] == 1


def test_rule_weights_by_uncertainty_and_broadcasts_sigma0():
    rule = UncertaintyWeightedMean()
    state = rule.init_state(torch.zeros(2), 3)
    assert torch.isinf(rule.broadcast(state)["sigma0_sq"])
    deltas = torch.tensor([[0.0, 0.0], [1.0, 2.0], [4.0, 0.0]])
    sigma_sq = torch.tensor([0.1, 0.5, 1.0])
    info = RoundInfo(0, np.arange(3), torch.ones(3), torch.ones(3), 3, 0.1,
                     messages=Messages({"delta": deltas, "sigma_sq": sigma_sq}, np.arange(3)))
    agg, state = rule.aggregate(state, deltas, torch.ones(3), info=info)
    s0 = moment_sigma0_sq(deltas, sigma_sq)
    w = 1 / (s0 + sigma_sq)
    assert torch.allclose(agg, (w / w.sum()) @ deltas) and torch.isclose(state["sigma0_sq"], s0)
    assert rule.metrics(state) == {"sigma0_sq": pytest.approx(float(s0))}


def test_a_short_run_records_sigma0_and_personal_models():
    fed = fl.federate("digits", "dirichlet", n_clients=6, seed=1, alpha=0.3)
    h = fl.simulate(fl.get_method("self_fl"), fed, model="mlp", model_kwargs={"hidden": (8,)}, rounds=2,
                    clients_per_round=3, batch_size=32, lr=0.1, seed=1, progress=False)
    assert np.isfinite(h["sigma0_sq"].to_numpy()).all() and "personal_acc_mean" in h
    steps = h.store.all("cpu")["steps"]
    T = torch.tensor([-(-len(y) // 32) for _, y in fed.client_train], dtype=steps.dtype)  # one epoch's steps
    assert ((steps >= 0) & (steps <= T)).all() and (steps > 0).any()


def test_negative_variances_are_refused():
    with pytest.raises(ValueError, match="sigma0_sq"):
        closed_form_mse(-0.1, SIGMA_SQ)
    with pytest.raises(ValueError, match="sigma_sq"):
        closed_form_mse(0.1, -SIGMA_SQ)


def test_bad_server_lr_is_refused():
    with pytest.raises(ValueError, match="server_lr"):
        fl.get_method("self_fl", server_lr=0.0)
