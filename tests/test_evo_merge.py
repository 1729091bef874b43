"""Evolutionary merge (fedlab_nb/methods/beyond/evolutionary_merge.py): the search-space special cases (< 1e-12), the elitist
validation guarantee, DARE keyed masks and the error messages."""
import numpy as np
import pytest
import torch

from fedlab_nb import merging
from fedlab_nb.methods.beyond import evolutionary_merge as EVO
from fedlab_nb.methods.beyond.pcb_merging import mlp
from fedlab_nb.models import flatten_params


def _setup(k=3):
    torch.manual_seed(0)
    model = mlp([6, 5, 4, 3]).double()
    theta0 = flatten_params(model).detach()
    g = torch.Generator().manual_seed(1)
    taus = torch.randn(k, theta0.numel(), generator=g, dtype=torch.float64)
    return model, theta0, taus


def test_layer_slices_cover_each_linear():
    model, theta0, _ = _setup()
    layers = EVO.layer_slices(model)
    assert [s.stop - s.start for s in layers] == [6 * 5 + 5, 5 * 4 + 4, 4 * 3 + 3]
    assert layers[0].start == 0 and layers[-1].stop == theta0.numel()


def test_special_cases_average_and_task_arithmetic():
    model, theta0, taus = _setup()
    layers = EVO.layer_slices(model)
    avg = EVO.layerwise_merge(theta0, taus, np.full((3, 3), 1 / 3), layers)
    assert (avg - merging.plain_average(theta0 + taus)).abs().max() < 1e-12
    for lam in (0.2, 1.3):
        ta = EVO.layerwise_merge(theta0, taus, np.full((3, 3), lam), layers)
        assert (ta - merging.task_arithmetic(theta0, taus, lam)).abs().max() < 1e-12


def test_per_layer_weights_act_on_their_layer_only():
    model, theta0, taus = _setup()
    layers = EVO.layer_slices(model)
    w = np.zeros((3, 3))
    w[1, 2] = 2.0
    out = EVO.layerwise_merge(theta0, taus, w, layers)
    assert torch.equal(out[:layers[2].start], theta0[:layers[2].start])
    assert torch.allclose(out[layers[2]], theta0[layers[2]] + 2 * taus[1, layers[2]])


def test_dare_rate_zero_is_no_dare_and_masks_are_keyed():
    model, theta0, taus = _setup()
    layers, w = EVO.layer_slices(model), np.full((3, 3), 0.5)
    plain = EVO.layerwise_merge(theta0, taus, w, layers)
    assert torch.equal(EVO.layerwise_merge(theta0, taus, w, layers, [0, 0, 0], dare_seed=4), plain)
    a = EVO.layerwise_merge(theta0, taus, w, layers, [0.5, 0.3, 0.1], dare_seed=4)
    assert torch.equal(a, EVO.layerwise_merge(theta0, taus, w, layers, [0.5, 0.3, 0.1], dare_seed=4))
    assert not torch.equal(a, EVO.layerwise_merge(theta0, taus, w, layers, [0.5, 0.3, 0.1], dare_seed=5))


@pytest.mark.parametrize("dare", [False, True])
def test_elitist_search_never_ends_below_its_starts(dare):
    model, theta0, taus = _setup()
    layers = EVO.layer_slices(model)
    target = EVO.layerwise_merge(theta0, taus, np.array([[0.2, 1.5, 0.7], [1.1, 0.1, 0.4], [0.6, 0.9, 1.8]]), layers)
    score = lambda th: -float((th - target).square().sum())
    starts = [np.full((3, 3), 1 / 3), np.full((3, 3), 0.8)]
    res = EVO.evolve_merge(score, theta0, taus, layers, starts, budget=400, dare=dare, seed=0)
    assert len(res.scores) == 400 and res.scores[:2] == res.start_scores
    assert res.score >= max(res.start_scores) and res.score == max(res.scores)
    bests = [max(res.scores[:b]) for b in (2, 50, 400)]
    assert bests == sorted(bests)
    best = EVO.layerwise_merge(theta0, taus, res.weights, layers, res.dare_rates, 0)
    assert score(best) == pytest.approx(res.score)
    if not dare:  # a quadratic in 9 weights: CMA-ES gets close within 400 evaluations
        assert res.score > 0.01 * max(res.start_scores)


def test_errors_name_the_fix():
    model, theta0, taus = _setup()
    layers = EVO.layer_slices(model)
    with pytest.raises(ValueError, match="weights must be"):
        EVO.layerwise_merge(theta0, taus, np.ones((2, 3)), layers)
    with pytest.raises(ValueError, match="layers must cover"):
        EVO.layerwise_merge(theta0, taus, np.ones((3, 2)), layers[:2])
    with pytest.raises(ValueError, match="budget"):
        EVO.evolve_merge(lambda th: 0.0, theta0, taus, layers, [np.ones((3, 3))] * 3, budget=2)
