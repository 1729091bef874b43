"""APFL (Deng, Kamani, Mahdavi 2020): the local step against autograd, the two ends of α, errors."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad

import fedlab_nb as fl
from fedlab_nb.methods.personalisation.apfl import APFLClient, apfl_client, apfl_step, mixture

D, C = 5, 3


def softmax_loss(theta, x, y):
    return F.cross_entropy(x @ theta.view(D, C), y)


@pytest.fixture
def problem():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, D, generator=g, dtype=torch.float64), torch.randint(0, C, (12,), generator=g)
    w, v = torch.randn(D * C, generator=g, dtype=torch.float64), torch.randn(D * C, generator=g, dtype=torch.float64)
    return x, y, w, v


def test_step_matches_autograd_of_the_mixture(problem):
    x, y, w, v = problem
    alpha, lr, alpha_lr = torch.tensor(0.3, dtype=torch.float64), 0.1, 0.05
    w1, v1, a1, _ = apfl_step(softmax_loss, w, v, alpha, x, y, lr, alpha_lr, adaptive=True)
    mix_loss = lambda v_, w_, a_: softmax_loss(a_ * v_ + (1 - a_) * w_, x, y)
    assert torch.allclose(w1, w - lr * grad(softmax_loss)(w, x, y), atol=1e-12)
    assert torch.allclose(v1, v - lr * grad(mix_loss, argnums=0)(v, w, alpha), atol=1e-12)  # ∇_v f(v̄), old α
    assert torch.allclose(a1, alpha - alpha_lr * grad(mix_loss, argnums=2)(v, w, alpha), atol=1e-12)


def test_alpha_is_projected_onto_unit_interval(problem):
    x, y, w, v = problem
    _, _, a_up, _ = apfl_step(softmax_loss, w, v, torch.tensor(0.5, dtype=torch.float64), x, y, 0.1, 1e6, True)
    _, _, a_dn, _ = apfl_step(softmax_loss, v, w, torch.tensor(0.5, dtype=torch.float64), x, y, 0.1, 1e6, True)
    assert {float(a_up), float(a_dn)} == {0.0, 1.0}  # swapping v and w flips the sign of ∂f/∂α


def test_fixed_ends_are_fedavg_and_local_training(problem):
    x, y, w, v = problem
    batches = [np.arange(0, 6), np.arange(6, 12), np.arange(3, 9)]
    zero = torch.tensor(0.0, dtype=torch.float64)
    w0, v0, a0, _ = apfl_client(softmax_loss, w, v, zero, x, y, batches, 0.1, 0.1, adaptive=False)
    w1, v1, a1, _ = apfl_client(softmax_loss, w, v, zero + 1, x, y, batches, 0.1, 0.1, adaptive=False)
    sgd = lambda t: [t := t - 0.1 * grad(softmax_loss)(t, x[b], y[b]) for b in batches][-1]
    assert torch.equal(v0, v) and torch.allclose(w0, sgd(w), atol=1e-12)     # α = 0: v frozen, w is FedAvg's SGD
    assert torch.allclose(v1, sgd(v), atol=1e-12) and float(a0) == 0 and float(a1) == 1   # α = 1: v alone


def test_personal_is_the_mixture_with_the_global_model():
    theta = torch.arange(4.0)
    cstate = {"v": torch.ones(3, 4), "alpha": torch.tensor([0.0, 0.5, 1.0])}
    P = APFLClient().personal(None, theta, cstate, None)
    assert torch.equal(P[0], theta) and torch.equal(P[2], torch.ones(4))
    assert torch.equal(P[1], mixture(torch.ones(4), theta, 0.5))


def test_alpha_zero_reproduces_fedavg_in_a_run():
    fed = fl.federate("digits", "dirichlet", n_clients=6, seed=1, alpha=0.3)
    kw = dict(model="mlp", model_kwargs={"hidden": (8,)}, rounds=2, clients_per_round=3, batch_size=32, lr=0.1,
              seed=1, progress=False)
    a = fl.simulate(fl.get_method("apfl", alpha=0.0, adaptive=False), fed, **kw)
    b = fl.simulate(fl.get_method("fedavg"), fed, **kw)
    assert np.array_equal(a.client_acc["personal model"], b.client_acc["global model"])
    assert a.final("test_acc") == b.final("test_acc")


@pytest.mark.parametrize("kwargs, word", [({"alpha": 1.5}, "alpha"), ({"alpha": -0.1}, "alpha"),
                                          ({"alpha_lr": 0.0}, "alpha_lr")])
def test_bad_arguments_name_the_parameter(kwargs, word):
    with pytest.raises(ValueError, match=word):
        fl.get_method("apfl", **kwargs)
