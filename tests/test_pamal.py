"""Pareto Manifold Learning (fedlab_nb/methods/beyond/pareto_manifold.py): the quadratic Pareto set, the hypervolume, the
multi-forward penalty and the trainer's contracts."""
import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from fedlab_nb.methods.beyond import pareto_manifold as P
from fedlab_nb.models import flatten_params, make_model


def _spd(g, d):
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    return A @ A.T + 0.1 * torch.eye(d, dtype=torch.float64)


def test_quadratic_pareto_set_matches_numerical_minimisation():
    g = torch.Generator().manual_seed(0)
    H1, H2 = _spd(g, 4), _spd(g, 4)
    t1, t2 = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    alphas = [0.0, 0.13, 0.5, 0.87, 1.0]
    closed = P.quadratic_pareto_set(H1, H2, t1, t2, alphas)
    h1, h2, c1, c2 = H1.numpy(), H2.numpy(), t1.numpy(), t2.numpy()
    for a, th in zip(alphas, closed):
        L = lambda x: (a * (x - c1) @ h1 @ (x - c1) + (1 - a) * (x - c2) @ h2 @ (x - c2)) / 2
        res = minimize(L, np.zeros(4), method="BFGS", options={"gtol": 1e-12})
        assert np.abs(res.x - th.numpy()).max() < 1e-6
    assert torch.equal(closed[-1], torch.linalg.solve(H1, H1 @ t1)) and torch.allclose(closed[0], t2, atol=1e-12)


def test_segment_exact_for_proportional_hessians_only():
    g = torch.Generator().manual_seed(1)
    H1, H2 = _spd(g, 5), _spd(g, 5)
    t1, t2 = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    alphas = np.linspace(0, 1, 41)
    on_line = P.quadratic_pareto_set(H1, 3.0 * H1, t1, t2, alphas)
    assert P.segment_distance(on_line, t2, t1).max() < 1e-12
    assert P.segment_distance(P.quadratic_pareto_set(H1, H2, t1, t2, alphas), t2, t1).max() > 0.05


def test_quadratic_pareto_set_rejects_bad_input():
    I = torch.eye(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="alphas"):
        P.quadratic_pareto_set(I, I, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), [1.5])
    with pytest.raises(ValueError, match="shape"):
        P.quadratic_pareto_set(I, I, torch.zeros(2, dtype=torch.float64), torch.ones(3, dtype=torch.float64), [0.5])


def test_hypervolume_hand_example_and_brute_force():
    pts = [(0.2, 0.4), (0.3, 0.2), (0.35, 0.35), (0.6, 0.1)]  # (0.35, 0.35) dominated, (0.6, 0.1) beyond ref
    assert P.hypervolume_2d(pts, (0.5, 0.5)) == pytest.approx(0.3 * 0.1 + 0.2 * 0.2, abs=1e-15)
    rng = np.random.default_rng(0)
    grid = (np.arange(400) + 0.5) / 400
    gx, gy = np.meshgrid(grid, grid)
    for _ in range(3):
        p = rng.uniform(0, 1, (7, 2))
        dominated = ((gx[..., None] >= p[:, 0]) & (gy[..., None] >= p[:, 1])).any(-1)
        assert P.hypervolume_2d(p, (1, 1)) == pytest.approx(dominated.mean(), abs=5e-3)


def test_monotonicity_penalty():
    alphas = torch.tensor([[0.2, 0.8], [0.7, 0.3], [0.5, 0.5]])
    monotone = torch.tensor([[0.9, 0.2], [0.3, 0.7], [0.5, 0.5]])  # each task's loss falls in its own weight
    assert float(P.monotonicity_penalty(alphas, monotone)) == pytest.approx(0.0, abs=1e-7)
    bad = monotone.clone()
    bad[1, 0] = 0.6  # task 0 at α = 0.7 is worse than at α = 0.5: one violation of 0.1
    expected = np.log((np.exp(0.1) + 1) / 2)
    assert float(P.monotonicity_penalty(alphas, bad)) == pytest.approx(expected, rel=1e-5)
    assert float(P.monotonicity_penalty(alphas, monotone, order="official")) > 0  # the literal reading
    with pytest.raises(ValueError, match="order"):
        P.monotonicity_penalty(alphas, monotone, order="up")


def _toy():
    torch.manual_seed(0)
    model = make_model("mlp", (6,), 4, hidden=(8,))
    x = torch.randn(64, 6)
    Y = torch.stack([(x[:, 0] > 0).long(), (x[:, 1] > 0).long()], 1)
    return model, x, Y


def test_trainer_contracts_and_front_endpoints():
    model, x, Y = _toy()
    members = torch.stack([flatten_params(model), flatten_params(model) + 0.1])
    assert torch.equal(P.pamal_train(model, members, x, Y, epochs=0), members)
    with pytest.raises(ValueError, match="members"):
        P.pamal_train(model, members[:1], x, Y)
    with pytest.raises(ValueError, match="num"):
        P.pamal_train(model, members, x, Y, num=0)
    trained = P.pamal_train(model, members, x, Y, epochs=3, batch_size=16, num=3, seed=1)
    again = P.pamal_train(model, members, x, Y, epochs=3, batch_size=16, num=3, seed=1)
    assert torch.equal(trained, again) and not torch.equal(trained, members)
    alphas, errors, losses = P.front(model, trained, x, Y, n_points=5)
    assert alphas.shape == (5, 2) and np.allclose(alphas.sum(1), 1)
    np.testing.assert_allclose(errors[-1], P.evaluate_tasks(model, trained[0], x, Y)[0])  # α = (1, 0): member 0
    np.testing.assert_allclose(losses[0], P.evaluate_tasks(model, trained[1], x, Y)[1], rtol=1e-6)


def test_scalarised_loss_and_cosine():
    model, x, Y = _toy()
    th = flatten_params(model)
    out = model(x)
    L = P.task_losses(out.reshape(len(x), 2, -1), Y)
    assert float(P.scalarised_loss([0.3, 0.7])(out, Y)) == pytest.approx(float(0.3 * L[0] + 0.7 * L[1]), rel=1e-6)
    c = P.task_gradient_cosine(model, th, x, Y)
    assert -1 <= c <= 1
    head = model.body[-1]
    with torch.no_grad():  # two identical heads on the same labels: identical shared gradients, cosine 1
        head.weight[2:], head.bias[2:] = head.weight[:2].clone(), head.bias[:2].clone()
    Y_same = torch.stack([Y[:, 0], Y[:, 0]], 1)
    assert P.task_gradient_cosine(model, flatten_params(model), x, Y_same) == pytest.approx(1.0, abs=1e-6)


def test_multi_mnist_shapes():
    pytest.importorskip("fedlab_nb.data.datasets")
    try:
        xtr, Ytr, xte, Yte = P.multi_mnist(seed=0)
    except Exception as e:  # the offline MNIST-5k copy is missing
        pytest.skip(f"MNIST-5k not available: {e}")
    assert xtr.shape == (4000, 17 * 17) and Ytr.shape == (4000, 2) and xte.shape[1] == 289
    assert int(Ytr.max()) == 9 and float(xtr.max()) <= 1.0
