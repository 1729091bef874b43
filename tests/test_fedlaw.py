"""FedLAW (Li et al., ICML 2023): γ = 1 with data-size λ is FedAvg, the proxy-loss gradient in (g, l) against
finite differences, the fixed-γ path, client coherence on a hand-computed case, bad input."""
import math

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.method import RoundInfo, weighted_mean
from fedlab_nb.methods.basics.fedavg import fedavg
from fedlab_nb.methods.weights.fedlaw import (FedLAWRule, ProxyFinetuneRule, ShrinkRule, client_coherence, fedavg_shrink,
                                      federate_with_proxy, fedlaw, proxy_loss)
from fedlab_nb.models import MLP, MLPBN, param_spec


def _info(theta, m, sizes=None):
    sizes = torch.tensor([1.0] * m) if sizes is None else sizes
    return RoundInfo(round=0, client_ids=np.arange(m), sizes=sizes, steps=torch.ones(m), num_clients=m, lr=0.1,
                     theta=theta)


def _problem(seed=0, m=3):
    g = torch.Generator().manual_seed(seed)
    model = MLP(4, 3, hidden=(5,)).double()
    d = sum(p.numel() for p in model.parameters())
    theta = torch.randn(d, generator=g, dtype=torch.float64)
    updates = 0.3 * torch.randn(m, d, generator=g, dtype=torch.float64)
    x = torch.randn(12, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    return model, theta, updates, x, y


def test_gamma_one_with_size_weights_is_fedavg_bit_for_bit():
    model, theta, updates, _, _ = _problem()
    sizes = torch.tensor([10.0, 30.0, 60.0], dtype=torch.float64)
    rule = ShrinkRule(1.0)
    agg, state = rule.aggregate(rule.init_state(theta, 3), updates, sizes, _info(theta, 3, sizes))
    assert torch.equal(agg, weighted_mean(updates, sizes))
    assert float(state["gamma"]) == 1.0
    torch.testing.assert_close(state["lam"], sizes / sizes.sum())


def test_gamma_one_run_equals_fedavg_run():
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.5, seed=0)
    kw = dict(rounds=3, local_epochs=1, batch_size=32, lr=0.1, seed=0, progress=False)
    a = fl.simulate(fedavg(), fed, "logreg", **kw)
    b = fl.simulate(fedavg_shrink(1.0), fed, "logreg", **kw)
    assert a["test_acc"].tolist() == b["test_acc"].tolist() and a["train_loss"].tolist() == b["train_loss"].tolist()


def test_untrained_fedlaw_starts_at_fedavg_weights():
    # g = 0, l = log p: γ = 1 and λ = softmax(log p) = p (to rounding)
    model, theta, updates, x, y = _problem()
    sizes = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    rule = FedLAWRule(model=model, proxy=(x, y), learn_gamma=False, learn_lambda=False)
    agg, state = rule.aggregate(rule.init_state(theta, 3), updates, sizes, _info(theta, 3, sizes))
    torch.testing.assert_close(agg, weighted_mean(updates, sizes), rtol=1e-12, atol=1e-12)
    assert float(state["gamma"]) == 1.0


def test_proxy_loss_gradient_matches_finite_differences():
    model, theta, updates, x, y = _problem()
    spec = param_spec(model)
    g = torch.tensor(-0.1, dtype=torch.float64, requires_grad=True)
    l = torch.tensor([0.2, -0.5, 0.1], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g_, l_: proxy_loss(model, spec, theta, updates, g_, l_, x, y), (g, l),
                                    eps=1e-6, atol=1e-8, rtol=1e-6)


def test_fixed_gamma_shrinks_the_aggregate():
    _, theta, updates, _, _ = _problem()
    rule = ShrinkRule(0.9)
    agg, state = rule.aggregate(rule.init_state(theta, 3), updates, None, _info(theta, 3))
    torch.testing.assert_close(theta + agg, 0.9 * (theta + updates.mean(0)), rtol=1e-12, atol=1e-12)
    assert rule.metrics(state)["gamma"] == pytest.approx(0.9)


def test_learning_lowers_the_proxy_loss():
    model, theta, updates, x, y = _problem(seed=1)
    spec = param_spec(model)
    rule = FedLAWRule(model=model, proxy=(x, y), epochs=40, lr=0.05)
    agg, state = rule.aggregate(rule.init_state(theta, 3), updates, None, _info(theta, 3))
    g, lam = torch.log(state["gamma"]), state["lam"]
    learned = proxy_loss(model, spec, theta, updates, g, torch.log(lam), x, y)
    start = proxy_loss(model, spec, theta, updates, torch.tensor(0.0, dtype=torch.float64),
                       torch.log(torch.full((3,), 1 / 3, dtype=torch.float64)), x, y)
    assert float(learned) < float(start)
    assert float(lam.sum()) == pytest.approx(1.0) and (lam > 0).all()


def test_client_coherence_hand_computed():
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    local, pairwise = client_coherence(u)
    # pairwise cosines 0, 1/√2, 1/√2; the mean update (2/3, 2/3) points along (1, 1)
    assert pairwise == pytest.approx(math.sqrt(2) / 3)
    torch.testing.assert_close(local, torch.tensor([1 / math.sqrt(2), 1 / math.sqrt(2), 1.0], dtype=torch.float64))


def test_fedlaw_runs_and_logs_gamma_and_lambda():
    fed, proxy = federate_with_proxy("digits", n_proxy=40, n_clients=4, alpha=0.5, seed=0)
    model = fl.models.make_model("mlp", fed.dataset.input_shape, 10, hidden=(16,))
    h = fl.simulate(fedlaw(proxy, model, epochs=2), fed, model, rounds=2, local_epochs=1, lr=0.1, seed=0,
                    progress=False)
    assert {"gamma", "coherence", "lam0", "lam3"} <= set(h.columns)
    assert np.isfinite(h["gamma"]).all() and h[[f"lam{k}" for k in range(4)]].sum(axis=1).round(6).eq(1).all()
    assert np.bincount(proxy[1].numpy(), minlength=10).tolist() == [4] * 10  # class-balanced, as the official code


def test_proxy_rows_are_held_by_no_client():
    fed, (x, y) = federate_with_proxy("digits", n_proxy=50, n_clients=5, alpha=0.5, seed=3)
    train = fed.dataset.x_train
    proxy_rows = {int(i) for i in torch.cdist(x, train).argmin(1)}
    client_rows = set(np.concatenate(list(fed.partition)).tolist())
    assert len(proxy_rows) == 50 and not proxy_rows & client_rows
    assert len(client_rows) == len(fed.dataset.y_train) - 50


def test_proxy_finetune_lowers_the_proxy_loss_from_fedavg():
    model, theta, updates, x, y = _problem(seed=2)
    spec = param_spec(model)
    rule = ProxyFinetuneRule(model=model, proxy=(x, y), epochs=10, lr=0.1)
    agg, _ = rule.aggregate(rule.init_state(theta, 3), updates, None, _info(theta, 3))
    zero, even = torch.tensor(0.0, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    fedavg_loss = proxy_loss(model, spec, theta, updates, zero, even, x, y)
    tuned = proxy_loss(model, spec, theta + agg, torch.zeros_like(updates), zero, even, x, y)
    assert float(tuned) < float(fedavg_loss)


def test_bad_input():
    model, theta, updates, x, y = _problem()
    with pytest.raises(ValueError, match="gamma"):
        ShrinkRule(0.0)
    with pytest.raises(ValueError, match="proxy"):
        FedLAWRule(model=model, proxy=None)
    with pytest.raises(ValueError, match="model"):
        FedLAWRule(model=None, proxy=(x, y))
    with pytest.raises(ValueError, match="BatchNorm"):
        FedLAWRule(model=MLPBN(4, 3), proxy=(x, y))
    with pytest.raises(ValueError, match="epochs"):
        FedLAWRule(model=model, proxy=(x, y), epochs=0)
    with pytest.raises(ValueError, match="lr"):
        FedLAWRule(model=model, proxy=(x, y), lr=0.0)
    rule = ShrinkRule(0.95)
    with pytest.raises(ValueError, match="weights"):
        rule.aggregate(rule.init_state(theta, 3), updates, torch.tensor([1.0, -1.0, 1.0]), _info(theta, 3))
    with pytest.raises(ValueError, match="n_proxy"):
        federate_with_proxy("digits", n_proxy=0)
    with pytest.raises(ValueError, match="classes"):
        federate_with_proxy("digits", n_proxy=5)
    with pytest.raises(ValueError, match="updates"):
        client_coherence(torch.zeros(3))
