"""FedCPA (Han et al., ICCV 2023): critical sets, set similarity, scores → weights, the rule on a planted attack."""
import numpy as np
import pytest
import scipy.stats
import torch

from fedlab_nb.core.method import RoundInfo
from fedlab_nb.methods.robustness.fedcpa import (CriticalParameterRule, RootTrustRule, cpa_scores, critical_sets, fedcpa,
                                      fltrust_method, foolsgold_weights, set_similarity, weight_mask)


def test_critical_sets_pick_largest_and_smallest():
    imp = torch.tensor([[5.0, 0.1, 3.0, 0.2, 4.0, 1.0, 2.0, 0.3, 0.4, 0.5]])
    top, bot = critical_sets(imp, frac=0.2)      # k = 2
    assert top[0].nonzero().flatten().tolist() == [0, 4]
    assert bot[0].nonzero().flatten().tolist() == [1, 3]


def test_set_similarity_hand_case_against_scipy():
    imp_i = torch.tensor([9.0, 8.0, 7.0, 1.0, 0.5, 0.1])
    imp_j = torch.tensor([8.0, 9.0, 0.2, 7.0, 0.4, 0.1])
    top_i, bot_i = critical_sets(imp_i[None], frac=0.5)
    top_j, bot_j = critical_sets(imp_j[None], frac=0.5)
    # top_i = {0,1,2}, top_j = {0,1,3}: Jaccard 2/4; bottom_i = {3,4,5}, bottom_j = {2,4,5}: Jaccard 2/4
    r_top = scipy.stats.pearsonr([9.0, 8.0], [8.0, 9.0])[0]
    r_bot = scipy.stats.pearsonr([0.5, 0.1], [0.4, 0.1])[0]
    want = ((r_top + 1) / 2 + (r_bot + 1) / 2) / 2 + 0.5
    got = set_similarity(imp_i, imp_j, (top_i[0], bot_i[0]), (top_j[0], bot_j[0]))
    assert got == pytest.approx(want, abs=1e-12)
    same = set_similarity(imp_i, imp_i, (top_i[0], bot_i[0]), (top_i[0], bot_i[0]))
    assert same == pytest.approx(2.0)


def test_pearson_guard_on_tiny_overlap():
    imp_i, imp_j = torch.tensor([3.0, 2.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 2.0, 3.0])
    t_i, b_i = critical_sets(imp_i[None], 0.25)
    t_j, b_j = critical_sets(imp_j[None], 0.25)
    assert set_similarity(imp_i, imp_j, (t_i[0], b_i[0]), (t_j[0], b_j[0])) == pytest.approx(0.5)  # 0.5 corr, 0 Jaccard


def test_foolsgold_map():
    w = foolsgold_weights(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64))
    assert w.tolist() == pytest.approx([0.0, 0.5, 1.0])
    v = 0.25
    w = foolsgold_weights(torch.tensor([0.0, v, 1.0], dtype=torch.float64))
    assert float(w[1]) == pytest.approx(max(0.0, np.log(v / (1 - v)) + 0.5))
    assert foolsgold_weights(torch.ones(4)).tolist() == [1.0] * 4


def _planted(m=10, bad=2, d=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(d, generator=g)
    shared = torch.randn(d, generator=g)             # the paper's premise: benign clients share a common direction plus noise
    benign = shared + 0.1 * torch.randn(m - bad, d, generator=g)
    attack = torch.randn(d, generator=g).expand(bad, d)   # identical colluders, unrelated to the benign direction
    return theta, torch.cat([attack, benign]), bad


def test_planted_identical_attackers_get_lowest_weights():
    theta, updates, bad = _planted()
    rule = CriticalParameterRule(frac=0.05)
    state = rule.init_state(theta, updates.shape[0])
    # two rounds: the second uses the previous round's reference as the global step
    for r in range(2):
        info = RoundInfo(round=r, client_ids=np.arange(updates.shape[0]), sizes=torch.ones(10), steps=torch.ones(10),
                         num_clients=10, lr=0.1, theta=theta)
        agg, state = rule.aggregate(state, updates, None, info)
        theta = theta + agg
        scores, w = state["score"], state["w"]
        assert scores[:bad].max() < scores[bad:].min()
        assert w[:bad].max() == 0 < w[bad:].min()
    assert torch.isfinite(agg).all()
    assert set(rule.metrics(state)) >= {"cpa_score0", "cpa_w9"}


def test_weight_mask_skips_biases():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    mask = weight_mask(model)
    assert mask.tolist() == [True] * 6 + [False] * 2 + [True] * 2 + [False]
    assert fedcpa(model).rule.mask.sum() == 8


def test_bad_input_errors():
    with pytest.raises(ValueError, match="frac"):
        critical_sets(torch.rand(2, 10), frac=0.0)
    with pytest.raises(ValueError, match="shape"):
        critical_sets(torch.rand(10), frac=0.1)
    with pytest.raises(ValueError, match="frac"):
        CriticalParameterRule(frac=0.9)
    rule = CriticalParameterRule(mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="weight_mask"):
        rule.init_state(torch.zeros(7), 3)
    rule = CriticalParameterRule()
    state = rule.init_state(torch.zeros(4), 2)
    info = RoundInfo(0, np.arange(2), torch.ones(2), torch.ones(2), 2, 0.1, theta=torch.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        rule.aggregate(state, torch.tensor([[1.0, float("nan"), 0, 0], [0, 0, 0, 1.0]]), None, info)


def test_scores_permutation_equivariant():
    imp = torch.rand(5, 200, generator=torch.Generator().manual_seed(1))
    glob = torch.rand(200, generator=torch.Generator().manual_seed(2))
    s = cpa_scores(imp, glob, 0.05)
    assert s.shape == (5,) and torch.isfinite(s).all()
    perm = torch.tensor([4, 2, 0, 1, 3])
    assert torch.allclose(cpa_scores(imp[perm], glob, 0.05), s[perm])


def test_fltrust_root_update_is_one_sgd_step_on_the_root_set():
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1] * 4)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rule = RootTrustRule(model, (x, y), lr=0.1, epochs=1, batch_size=8)   # one full batch: one gradient step
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
    g0 = rule.server_update(theta, torch.Generator().manual_seed(0))
    assert torch.allclose(g0, -0.1 * grads, atol=1e-6)
    with pytest.raises(ValueError, match="root"):
        fltrust_method(model, (x[:0], y[:0]))
