"""L-DAWA's rule (fedlab_nb/methods/weights/ldawa.py) on hand-computed cases: per-layer cosine weights, the official
code's 1/m normalisation, negative cosines kept, FedAvg when every client is aligned with θ."""
import numpy as np
import pytest
import torch

from fedlab_nb.core.method import RoundInfo
from fedlab_nb.methods.weights.ldawa import LDAWARule, layer_cosines, ldawa

SPEC = [("w", (2,)), ("b", (1,))]   # two layers: a 2-vector and a scalar


def info(theta, m):
    return RoundInfo(0, np.arange(m), torch.ones(m, dtype=theta.dtype), torch.ones(m), m, 0.1, theta)


def run(rule, theta, models, weights=None):
    state = rule.init_state(theta, len(models))
    return rule.aggregate(state, models - theta, weights, info=info(theta, len(models)))


def test_hand_computed_layer_weights():
    theta = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    models = torch.tensor([[1.0, 1.0, 3.0],     # layer w at 45°: δ = 1/√2; layer b parallel: δ = 1
                           [0.0, 2.0, -1.0]],   # layer w at 90°: δ = 0;    layer b opposite: δ = −1
                          dtype=torch.float64)
    new, state = run(LDAWARule(SPEC), theta, models)
    r = 1 / np.sqrt(2)
    assert torch.allclose(state["delta"], torch.tensor([[r, 1.0], [0.0, -1.0]], dtype=torch.float64))
    # θ^l ← (1/m) Σ δ_k^l w_k^l: w = (r·[1, 1] + 0·[0, 2]) / 2; b = (1·3 + (−1)·(−1)) / 2
    assert torch.allclose(new, torch.tensor([r / 2, r / 2, 2.0], dtype=torch.float64))


def test_negative_cosine_is_kept_not_clipped():
    theta = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    models = torch.tensor([[0.0, 0.0, -4.0], [0.0, 0.0, 2.0]], dtype=torch.float64)  # δ_b = −1 and 1
    new, state = run(LDAWARule(SPEC), theta, models)
    assert state["delta"][0, 1] == -1.0
    assert new[2] == pytest.approx((4.0 + 2.0) / 2)   # (−1)(−4) + (1)(2), over m = 2: the sign flips back
    # the flagged convex variant clips negative cosines at 0 instead
    new, _ = run(LDAWARule(SPEC, normalise="delta"), theta, models)
    assert new[2] == pytest.approx(2.0)


def test_aligned_clients_give_fedavg():
    theta = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    models = torch.stack([theta * 1.5, theta * 0.7, theta * 3.0])  # every layer parallel to θ: δ = 1
    new, state = run(LDAWARule(SPEC), theta, models)
    assert torch.allclose(state["delta"], torch.ones(3, 2, dtype=torch.float64))
    assert torch.allclose(new, models.mean(0))
    sizes = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)       # a data-size weighting gives the weighted mean
    new, _ = run(LDAWARule(SPEC), theta, models, weights=sizes)
    assert torch.allclose(new, (sizes / sizes.sum()) @ models)


def test_identical_clients_in_a_layer_give_fedavg_with_delta_normalisation():
    theta = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    models = torch.tensor([[0.3, 0.9, 5.0], [0.3, 0.9, -1.0]], dtype=torch.float64)  # layer w identical, δ < 1
    new, state = run(LDAWARule(SPEC, normalise="delta"), theta, models)
    assert state["delta"][0, 0] == state["delta"][1, 0] < 1
    assert torch.allclose(new[:2], models[0, :2])            # the convex variant returns the common layer
    new, state = run(LDAWARule(SPEC), theta, models)
    assert torch.allclose(new[:2], state["delta"][0, 0] * models[0, :2])   # the official rule shrinks it by δ


def test_zero_layer_has_delta_one():
    theta = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    assert torch.equal(layer_cosines(torch.tensor([[1.0, 2.0]], dtype=torch.float64), theta[:2]),
                       torch.ones(1, dtype=torch.float64))


def test_metrics_and_method():
    theta = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    rule = LDAWARule(SPEC)
    _, state = run(rule, theta, torch.stack([theta, theta]))
    cols = rule.metrics(state)
    assert cols["delta[w]"] == 1.0 and cols["delta[b][1]"] == 1.0 and cols["drift[0]"] == 0.0
    assert ldawa(SPEC).rule.layers == ["w", "b"]


def test_bad_input_errors():
    with pytest.raises(ValueError, match="normalise must be one of"):
        LDAWARule(SPEC, normalise="sum")
    with pytest.raises(ValueError, match="spec is empty"):
        LDAWARule([])
    with pytest.raises(ValueError, match="param_spec"):
        LDAWARule(SPEC).init_state(torch.zeros(5), 2)
    theta = torch.zeros(3)
    with pytest.raises(ValueError, match="needs the broadcast"):
        LDAWARule(SPEC).aggregate({}, torch.zeros(2, 3), None)
    with pytest.raises(ValueError, match="non-negative"):
        LDAWARule(SPEC).aggregate({}, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), info=info(theta, 2))
