"""The shared merging pieces: exact identities of the merges and the calibration metrics on hand cases."""
import math

import pytest
import torch

from fedlab_nb import merging as mg
from fedlab_nb.data import domains
from fedlab_nb.models import flatten_params, make_model


def _models(K=3, seed=0):
    torch.manual_seed(seed)
    model = make_model("logreg", (4,), 3).double()
    theta0 = flatten_params(model)
    return model, theta0, theta0 + 0.1 * torch.randn(K, len(theta0), dtype=torch.float64)


def test_average_is_task_arithmetic_with_one_over_k():
    model, theta0, thetas = _models()
    taus = mg.task_vectors(thetas, theta0)
    assert torch.allclose(mg.plain_average(thetas), mg.task_arithmetic(theta0, taus, 1 / 3), atol=1e-14)


def test_weight_mix_is_logit_mix_for_linear_models():
    model, theta0, thetas = _models()
    x = torch.randn(20, 4, dtype=torch.float64)
    mix = mg.logits(model, mg.interpolate(theta0, thetas[0], 0.3), x)
    assert torch.allclose(mix, 0.7 * mg.logits(model, theta0, x) + 0.3 * mg.logits(model, thetas[0], x), atol=1e-12)


def test_ties_hand_case():
    taus = torch.tensor([[3.0, -1.0, 0.5, 2.0], [1.0, 2.0, -0.1, -4.0]], dtype=torch.float64)
    # density 0.5 keeps {3, 2} and {2, -4}; signs: +, +, 0, -; disjoint means 3, 2, 0, -4
    assert torch.equal(mg.ties_merge(taus, 0.5), torch.tensor([3.0, 2.0, 0.0, -4.0], dtype=torch.float64))


def test_dare_is_unbiased_and_checks_p():
    tau = torch.ones(200_000, dtype=torch.float64)
    assert abs(float(mg.dare(tau, 0.9, torch.Generator().manual_seed(0)).mean()) - 1) < 0.02
    with pytest.raises(ValueError, match="drop rate p"):
        mg.dare(tau, 1.0, torch.Generator())


def test_calibration_metrics_hand_case():
    p = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]], dtype=torch.float64)
    y = torch.tensor([0, 1, 1])
    assert mg.accuracy(p, y) == pytest.approx(2 / 3)
    assert mg.nll(p, y) == pytest.approx(-(math.log(0.9) + math.log(0.4) + math.log(0.8)) / 3)
    assert mg.brier(p, y) == pytest.approx((0.02 + 0.72 + 0.08) / 3)
    # bins of width 1/15: 0.9 (right), 0.6 (wrong) and 0.8 (right) fall in three different bins
    assert mg.ece(p, y) == pytest.approx((0.1 + 0.6 + 0.2) / 3)
    assert mg.ood_auroc(p[:1], p[1:2]) == 1.0


def test_fit_is_repeatable_and_learns():
    model, theta0, _ = _models()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 4, generator=g, dtype=torch.float64)
    y = x[:, :3].argmax(1)
    a = mg.fit(model, theta0, x, y, epochs=5, lr=0.5, seed=3)
    assert torch.equal(a, mg.fit(model, theta0, x, y, epochs=5, lr=0.5, seed=3))
    assert mg.accuracy(mg.predict_proba(model, a, x), y) > 0.8
    with pytest.raises(ValueError, match="optimizer"):
        mg.fit(model, theta0, x, y, optimizer="lbfgs")


def test_merge_baselines_table():
    model, theta0, thetas = _models()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 4, generator=g, dtype=torch.float64)
    y = x[:, :3].argmax(1)
    table = mg.merge_baselines(model, theta0, thetas, (x, y), {"test": (x, y)}, fisher_data=[(x, y)] * 3)
    assert list(table.index) == ["θ₀", "model 0", "model 1", "model 2", "average", "task arithmetic",
                                 "Fisher merge", "output ensemble"]
    assert table.loc["task arithmetic", "lambda"] in mg.LAMBDA_GRID


def test_domains():
    x = torch.zeros(2, 16)
    x[:, 1] = 1.0  # a pixel in row 0, column 1 of a 4×4 image
    assert torch.equal(domains.rotate(x, (1, 4, 4), 0), x)
    assert torch.equal(domains.invert(domains.invert(x)), x)
    r = domains.rotate(x, (1, 4, 4), 90).reshape(2, 4, 4)
    assert r.sum() > 0 and r[0, 0, 1] < 1
    with pytest.raises(ValueError, match="flat images"):
        domains.rotate(x, (1, 5, 5), 10)
