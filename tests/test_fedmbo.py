"""FedMBO (fedlab_nb/methods/bilevel/fedmbo.py): closed-form oracles = autodiff oracles, the federated hypergradient
is exact with every client and full batches (the local average is not), convergence, hyper-cleaning data."""
import pytest
import torch

from fedlab_nb.methods.bilevel import fedmbo as F
from fedlab_nb.methods.bilevel.dsbo import QuadraticNodes


def _problem(**kw):
    return F.correlated_quadratic(m=6, p=3, q=4, n=10, seed=0, **kw)


def test_closed_form_oracles_equal_autodiff_oracles():
    problem = _problem(batch=4, target_noise=0.0)
    n_rows = problem.rows.shape[1]
    sample = lambda clients, gen: {"rows": torch.randint(n_rows, (len(clients), 4), generator=gen),
                                   "noise": torch.zeros(len(clients), 4, dtype=torch.float64)}
    auto, exact = F.AutodiffClients(problem.f, problem.g, problem.data, sample), F.QuadraticClients(problem)
    clients = torch.tensor([4, 1, 2])
    x, y = torch.randn(3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    V = torch.randn(3, 4, dtype=torch.float64)
    for name, args in (("grad_y_g", (x, V, clients)), ("hvp", (x, y, V, clients)), ("cross", (x, y, V, clients))):
        a = getattr(auto, name)(*args, torch.Generator().manual_seed(5))
        b = getattr(exact, name)(*args, torch.Generator().manual_seed(5))
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name
    for a, b in zip(auto.grad_f(x, y, clients, torch.Generator()), exact.grad_f(x, y, clients, torch.Generator())):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_federated_hypergradient_is_exact_with_all_clients_and_the_local_average_is_not():
    problem = _problem(batch=10, target_noise=0.0)          # batch = all rows: exact oracles
    oracles, x = F.QuadraticClients(problem), torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)
    y = problem.y_star(x)
    cfg = F.FedMBOConfig(clients_per_round=6, neumann_terms=400, eta=0.2)
    everyone, gen = torch.arange(6), torch.Generator().manual_seed(0)
    exact = problem.hypergradient(x)
    fed = F._hypergradient(oracles, x, y, everyone, cfg, gen)
    local = F._local_hypergradients(oracles, x, y, everyone, cfg, gen)
    assert (fed - exact).norm() < 1e-10 * exact.norm()
    assert (local - exact).norm() > 1e-2 * exact.norm()


def test_full_participation_with_one_local_step_converges_to_the_bilevel_solution():
    problem = _problem(batch=10, target_noise=0.0)
    cfg = F.FedMBOConfig(rounds=1500, clients_per_round=6, local_steps=1, neumann_terms=60, alpha=0.5, beta=0.2, eta=0.2)
    out = F.run_quadratic(problem, cfg, every=1500)
    assert (out["x"] - problem.x_star()).norm() < 1e-6 * problem.x_star().norm()


def test_hyper_cleaning_data():
    hc = F.digits_hyper_cleaning(clients=4, rows=50, val_rows=10, noise=0.4, seed=1)
    assert hc.features.shape == (4, 50, 64) and hc.val_features.shape == (4, 10, 64)
    assert 0.25 < hc.noisy.double().mean() < 0.55
    assert len(hc.test_labels) == 1797 - 4 * 60
    dx, dy = hc.dims
    assert (dx, dy) == (200, 650)
    oracles = hc.oracles()
    y = torch.zeros(dy, dtype=torch.float64)
    g = oracles.grad_y_g(torch.zeros(dx, dtype=torch.float64), y.expand(2, -1), torch.tensor([0, 3]), torch.Generator())
    assert g.shape == (2, dy) and torch.isfinite(g).all()


def test_bad_config_names_the_parameter():
    with pytest.raises(ValueError, match="clients_per_round"):
        F.FedMBOConfig(clients_per_round=10).check(6)
    with pytest.raises(ValueError, match="estimator"):
        F.FedMBOConfig(estimator="mean").check(6)
    with pytest.raises(ValueError, match="eta"):
        F.FedMBOConfig(eta=0).check(6)
