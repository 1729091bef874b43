"""FedCE (fedlab_nb/methods/weights/fedce.py): the weight rule on a hand-computed case, the leave-one-out identity of the
minus model, the gradient score, and the error messages."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.weights.fedce import (FedCEWeighting, fedce, fedce_weights, gradient_similarity,
                                     leave_one_out_average, minus_models)

torch.set_num_threads(1)
D = torch.float64


def test_weights_hand_computed_times_and_plus():
    a = torch.tensor([1.0, 1.0, 2.0], dtype=D)       # normalised: 1/4, 1/4, 1/2
    b = torch.tensor([1.0, 3.0, 0.0], dtype=D)       # normalised: 1/4, 3/4, 0 -> clipped to 1e-3
    # times: products 1/16, 3/16, 5e-4 -> /sum (0.2505) -> no clip needed, renormalised sum is already one
    prod = torch.tensor([1 / 16, 3 / 16, 0.5e-3], dtype=D)
    assert torch.allclose(fedce_weights(a, b, "times"), prod / prod.sum(), atol=1e-15)
    # plus: sums 1/2, 1, 0.501 -> /2.001
    s = torch.tensor([0.5, 1.0, 0.501], dtype=D)
    assert torch.allclose(fedce_weights(a, b, "plus"), s / s.sum(), atol=1e-15)


def test_clipped_weights_are_renormalised():
    c = fedce_weights(torch.tensor([1.0, 1e-9], dtype=D), torch.tensor([1.0, 1e-9], dtype=D))
    assert c[1] > 0 and float(c.sum()) == pytest.approx(1.0, abs=1e-15)
    assert torch.allclose(c, torch.tensor([1.0, 1e-3], dtype=D) / 1.001, atol=1e-15)


def test_minus_model_is_leave_one_out_average_float64():
    g = torch.Generator().manual_seed(0)
    local = torch.randn(5, 40, generator=g, dtype=D)
    coef = torch.rand(5, generator=g, dtype=D)
    coef = coef / coef.sum()
    theta = coef @ local
    err = (minus_models(theta, coef, local) - leave_one_out_average(coef, local)).abs().max()
    assert err < 1e-12


def test_gradient_similarity_matches_explicit_cosine():
    g = torch.Generator().manual_seed(1)
    deltas = torch.randn(4, 10, generator=g, dtype=D)
    coef = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=D)
    for k in range(4):
        others = sum(coef[j] * deltas[j] for j in range(4) if j != k)
        want = torch.nn.functional.cosine_similarity(deltas[k], others, dim=0)
        assert float(gradient_similarity(deltas, coef)[k]) == pytest.approx(float(want), abs=1e-12)


def test_copies_get_identical_weights():
    deltas = torch.randn(3, 8, generator=torch.Generator().manual_seed(2), dtype=D)
    deltas = torch.cat([deltas, deltas[2:]])
    a = 1 - gradient_similarity(deltas, torch.full((4,), 0.25, dtype=D))
    c = fedce_weights(a, torch.tensor([0.2, 0.4, 0.3, 0.3], dtype=D))
    assert c[2] == c[3]


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="mode must be 'times'"):
        fedce_weights(torch.ones(2), torch.ones(2), mode="max")
    with pytest.raises(ValueError, match="coef: every weight"):
        minus_models(torch.zeros(3), torch.tensor([1.0, 0.0]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="consensus must be"):
        FedCEWeighting(torch.nn.Linear(2, 2), [], consensus="mean")
    with pytest.raises(ValueError, match="val must be"):
        fedce(torch.nn.Linear(2, 2), val=3)


def test_partial_participation_is_refused():
    fed = fl.federate("digits", "iid", n_clients=4, seed=0)
    torch.manual_seed(0)
    model = fl.models.make_model("logreg", fed.input_shape, fed.num_classes)
    with pytest.raises(ValueError, match="every client in every round"):
        fl.simulate(fedce(model, fed), fed, model, rounds=1, clients_per_round=2, progress=False)


def test_run_weights_sum_to_one_and_are_logged():
    fed = fl.federate("digits", "iid", n_clients=3, seed=0)
    torch.manual_seed(0)
    model = fl.models.make_model("logreg", fed.input_shape, fed.num_classes)
    h = fl.simulate(fedce(model, fed), fed, model, rounds=2, progress=False)
    c = h[[f"fedce_c{k}" for k in range(3)]].to_numpy()
    assert np.allclose(c.sum(1), 1.0)
    assert np.allclose(c[0], c[0].mean(), atol=0.2)   # round 0: b is uniform, only a differs
