"""Gradient tracking over noisy links (fedlab_nb/methods/more/vra_dgt.py): invariants, reduction to DGT, errors."""
import numpy as np
import pytest
import torch

from fedlab_nb import gossip
from fedlab_nb.methods.more import vra_dgt as V

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup():
    r = np.random.default_rng(0)
    x = r.normal(size=(120, 5))
    y = (x @ r.normal(size=5) + 0.5 * r.normal(size=120) > 0).astype(float)
    p = V.split_problem(x, y, nodes=6, lam=0.1)
    return p, gossip.metropolis_weights(gossip.ring(6)), V.optimum(p)


def test_optimum_is_stationary(setup):
    p, _, xs = setup
    grad = V.local_gradients(p, xs.expand(1, p.nodes, p.dim)).mean(1)
    assert float(grad.abs().max()) < 1e-12


@pytest.mark.parametrize("gamma", [1.0, 0.5, V.harmonic(10.0, 10.0)])
def test_tracking_invariant_over_exact_links(setup, gamma):
    p, w, xs = setup
    out = V.gradient_tracking(p, w, 300, 0.2, gamma, x_star=xs)
    assert float(out["track"].max()) < 1e-26  # squared error per coordinate


def test_exact_dgt_converges_linearly(setup):
    p, w, xs = setup
    out = V.gradient_tracking(p, w, 600, 0.2, 1.0, x_star=xs)
    assert float(out["mse"][0, -1]) < 1e-20


def test_zero_noise_equals_exact_bit_for_bit(setup):
    p, w, xs = setup
    a = V.gradient_tracking(p, w, 100, 0.2, 1.0, x_star=xs)
    b = V.gradient_tracking(p, w, 100, 0.2, 1.0, channel="gaussian", sigma=0.0, x_star=xs)
    assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])


def test_equals_plain_dgt(setup):
    p, w, xs = setup
    out = V.gradient_tracking(p, w, 100, 0.2, 1.0, x_star=xs)
    wt, x = torch.as_tensor(w), torch.zeros(p.nodes, p.dim, dtype=torch.float64)
    grad = lambda z: V.local_gradients(p, z[None])[0]
    y = grad(x)
    for _ in range(100):
        x_new = wt @ x - 0.2 * y
        y = wt @ y + grad(x_new) - grad(x)
        x = x_new
    assert float((out["x"][0] - x).abs().max()) < 1e-13


def test_noise_sum_variance_matches_prediction(setup):
    """One noisy mix adds Σ_i Σ_{j≠i} w_ij ξ_ij to the node sum: variance σ² Σ_{i≠j} w_ij² per coordinate."""
    p, w, _ = setup
    wt = torch.as_tensor(w)
    u = torch.zeros(4000, p.nodes, p.dim, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    total = V.noisy_mix(wt, u, "gaussian", 0.5, g).sum(1)
    predicted = 0.25 * float((w ** 2).sum() - (np.diag(w) ** 2).sum())
    assert abs(float(total.var()) / predicted - 1) < 0.05
    lap = V.noisy_mix(wt, u, "laplace", 0.5, g).sum(1)
    assert abs(float(lap.var()) / predicted - 1) < 0.05


def test_storm_estimator_is_exact_with_full_batches(setup):
    """With every row in the minibatch the STORM-type estimator equals the full gradient."""
    p, w, xs = setup
    rows = p.a.shape[1]
    full = V.gradient_tracking(p, w, 50, 0.2, 0.5, x_star=xs)
    x_old = torch.randn(1, p.nodes, p.dim, dtype=torch.float64)
    x_new = x_old + 0.1
    idx = torch.arange(rows).expand(1, p.nodes, rows)
    d = V._estimate(p, x_old, x_new, V.local_gradients(p, x_old), 0.3, idx)
    assert torch.allclose(d, V.local_gradients(p, x_new), atol=1e-13, rtol=0)
    assert full["mse"].shape == (1, 51)


def test_loglog_slope_recovers_power():
    k = torch.arange(1, 1001, dtype=torch.float64)
    assert abs(V.loglog_slope(k, 3.0 / k, 10, 1000) + 1) < 1e-12


def test_errors(setup):
    p, w, _ = setup
    with pytest.raises(ValueError, match="channel"):
        V.gradient_tracking(p, w, 5, 0.1, channel="radio")
    with pytest.raises(ValueError, match="sigma"):
        V.gradient_tracking(p, w, 5, 0.1, channel="gaussian", sigma=-1)
    with pytest.raises(ValueError, match="nodes"):
        V.gradient_tracking(p, gossip.metropolis_weights(gossip.ring(4)), 5, 0.1)
    with pytest.raises(ValueError, match="doubly stochastic"):
        V.gradient_tracking(p, np.full((6, 6), 0.2), 5, 0.1)
    with pytest.raises(ValueError, match="batch"):
        V.gradient_tracking(p, w, 5, 0.1, batch=10 ** 6)
    with pytest.raises(ValueError, match="lam"):
        V.split_problem(np.ones((10, 2)), np.ones(10), 2, lam=0)
    with pytest.raises(ValueError, match="0/1"):
        V.split_problem(np.ones((10, 2)), np.arange(10), 2, lam=0.1)
    with pytest.raises(ValueError, match="harmonic"):
        V.harmonic(0, 1)
    with pytest.raises(ValueError, match="fewer than 3"):
        V.loglog_slope([1, 2], [1.0, 0.5], 1, 2)
