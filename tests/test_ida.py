"""IDA's weights (Yeganeh et al. 2020): hand-computed case, a client at the mean, bad input, the rule in a Method."""
import math

import numpy as np
import pytest
import torch

from fedlab_nb.core.method import RoundInfo
from fedlab_nb.methods.weights.ida import InverseDistanceRule, ida, ida_weights


def test_weights_hand_computed():
    # rows 0, 0, 3 on one axis: mean 1, distances 1, 1, 2 -> inverse 1, 1, 1/2 -> weights 0.4, 0.4, 0.2
    u = torch.tensor([[0.0], [0.0], [3.0]], dtype=torch.float64)
    w, d = ida_weights(u, eps=1e-12)
    torch.testing.assert_close(d, torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64))


def test_weights_two_dimensions_and_sizes():
    # rows (0,0), (4,0), (2,3): mean (2,1); distances sqrt(5), sqrt(5), 2
    u = torch.tensor([[0.0, 0.0], [4.0, 0.0], [2.0, 3.0]], dtype=torch.float64)
    inv = np.array([1 / math.sqrt(5), 1 / math.sqrt(5), 0.5])
    w, _ = ida_weights(u, eps=1e-12)
    np.testing.assert_allclose(w.numpy(), inv / inv.sum(), rtol=1e-9)
    sizes = torch.tensor([10.0, 30.0, 60.0])
    w, _ = ida_weights(u, sizes, eps=1e-12)  # IDA x data size: multiplied, then normalised
    want = inv * sizes.numpy()
    np.testing.assert_allclose(w.numpy(), want / want.sum(), rtol=1e-6)


def test_client_at_mean_is_finite_and_dominates():
    # row 1 is exactly the mean: 1/(0 + eps) is finite, and that client takes (almost) all the weight
    u = torch.tensor([[-1.0, 0.0], [0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    w, d = ida_weights(u, eps=1e-8)
    assert d[1] == 0 and torch.isfinite(w).all()
    assert abs(float(w.sum()) - 1) < 1e-12 and w[1] > 1 - 1e-7


def test_identical_updates_give_uniform_weights():
    u = torch.ones(4, 3)
    w, _ = ida_weights(u)
    torch.testing.assert_close(w, torch.full((4,), 0.25))


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3), "shape"),
    (torch.zeros(0, 2), "shape"),
    (torch.tensor([[float("nan"), 0.0], [1.0, 1.0]]), "NaN"),
])
def test_bad_updates(bad, match):
    with pytest.raises(ValueError, match=match):
        ida_weights(bad)


def test_bad_eps_and_sizes():
    u = torch.randn(3, 2)
    with pytest.raises(ValueError, match="eps"):
        ida_weights(u, eps=0.0)
    with pytest.raises(ValueError, match="sizes"):
        ida_weights(u, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="sizes"):
        ida_weights(u, torch.tensor([1.0, -2.0, 1.0]))
    with pytest.raises(ValueError, match="eps"):
        InverseDistanceRule(eps=-1)


def test_rule_aggregates_and_logs_per_client():
    u = torch.tensor([[0.0], [0.0], [3.0]], dtype=torch.float64)
    rule = InverseDistanceRule(eps=1e-12)
    state = rule.init_state(torch.zeros(1), 5)
    info = RoundInfo(round=0, client_ids=np.array([4, 0, 2]), sizes=torch.ones(3), steps=torch.ones(3),
                     num_clients=5, lr=0.1)
    agg, state = rule.aggregate(state, u, torch.tensor([1.0, 1.0, 100.0]), info=info)
    assert abs(float(agg) - 0.6) < 1e-12           # 0.4·0 + 0.4·0 + 0.2·3; plain IDA ignores sizes
    m = rule.metrics(state)
    assert m["ida_w4"] == pytest.approx(0.4) and m["ida_w2"] == pytest.approx(0.2)
    assert math.isnan(m["ida_w1"]) and m["ida_dist2"] == pytest.approx(2.0)


def test_factory_names():
    assert ida().name == "ida" and ida(with_sizes=True).name == "ida_x_size"
