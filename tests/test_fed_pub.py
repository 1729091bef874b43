"""FED-PUB (fedlab_nb/methods/personalisation/fed_pub.py): similarity weights, personalised averages, proxy embedding, masks and
regularisers, the two-group SBM and the batched loop."""
import importlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedlab_nb.methods.personalisation import graphs as G
from fedlab_nb.core.registry import lookup
P = importlib.import_module("fedlab_nb.methods.personalisation.fed_pub")   # the package exports the factory under the same name


@pytest.fixture(scope="module")
def tiny():
    return P.two_group_sbm([0, 1], n_communities=4, nodes=40, n_feat=6, p_same=0.2, p_diff=0.05, p_out=0.05)


def test_registered_with_the_official_defaults():
    cfg = lookup("fed_pub").factory()
    assert (cfg.scale, cfg.l1, cfg.loc_l2, cfg.lr, cfg.masks) == (10.0, 1e-3, 1e-3, 1e-2, True)


def test_scale_zero_gives_uniform_alpha_and_the_plain_mean():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    cos, alpha = P.similarity_weights(emb, 0.0)
    assert torch.equal(alpha, torch.full_like(alpha, 1 / 5))
    params = {"w": torch.randn(3, 5, 4, 2, generator=g, dtype=torch.float64)}
    avg = P.personalised_average(params, alpha)["w"]
    assert torch.allclose(avg, params["w"].mean(1, keepdim=True).expand_as(avg), atol=1e-15)
    assert torch.allclose(cos.diagonal(dim1=-2, dim2=-1), torch.ones(3, 5, dtype=torch.float64))


def test_alpha_is_a_row_softmax_of_scaled_cosine():
    emb = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0]])
    cos, alpha = P.similarity_weights(emb, 10.0)
    expect = torch.exp(10 * cos) / torch.exp(10 * cos).sum(1, keepdim=True)
    assert torch.allclose(alpha, expect, atol=1e-12) and torch.allclose(alpha.sum(1), torch.ones(3, dtype=alpha.dtype))
    assert alpha[0, 1] > alpha[0, 2]           # the similar client gets the larger weight
    identity = P.personalised_average({"w": torch.arange(6.0).reshape(3, 2)}, torch.eye(3, dtype=torch.float64))
    assert torch.equal(identity["w"], torch.arange(6.0).reshape(3, 2))
    with pytest.raises(ValueError, match="scale"):
        P.similarity_weights(emb, -1.0)


def test_proxy_is_a_function_of_the_seed_and_blockwise_embedding_is_exact():
    a1, x1 = P.proxy_graph(3, 4)
    a2, x2 = P.proxy_graph(3, 4)
    assert torch.equal(a1, a2) and torch.equal(x1, x2) and a1.shape == (5, 100, 100)
    assert not torch.equal(x1, P.proxy_graph(4, 4)[1])
    params = G.gcn_init(4, 7, 3, torch.Generator().manual_seed(0))
    full_a = torch.block_diag(*a1)                       # the whole block-diagonal proxy graph
    full = G.gcn_forward(params, full_a, x1.reshape(-1, 4), embedding=True).mean(0)
    assert torch.allclose(P.functional_embedding(params, None, a1, x1), full, atol=1e-5)


def test_prune_zeroes_small_mask_entries_only():
    m = {"conv1.weight": torch.tensor([1e-4, -5e-4, 2e-3, -1.0])}
    assert torch.equal(P.prune(m, 1e-3)["conv1.weight"], torch.tensor([0.0, 0.0, 2e-3, -1.0]))


def _loss_grads(cfg, tiny, anchor_shift=0.1):
    params = {k: v.clone().requires_grad_(True) for k, v in P.initial_params(tiny, 5).items()}
    masks = {k: torch.ones_like(params[k]).requires_grad_(True) for k in G.WEIGHTS}
    anchor = {k: v.detach() + anchor_shift for k, v in params.items()}
    loss = P.local_loss(cfg, params, masks, anchor, tiny.a_hat, tiny.x, tiny.y, tiny.train)
    grads = torch.autograd.grad(loss, list(params.values()) + list(masks.values()))
    return loss, grads


def test_regularisers_on_parameters_and_the_detached_state_dict_quirk(tiny):
    base = replace(P.fed_pub(dropout=0.0, hidden=5), l1=0.1, loc_l2=0.1)
    loss_on, g_on = _loss_grads(base, tiny)
    loss_quirk, g_quirk = _loss_grads(replace(base, detached_regularisers=True), tiny)
    _, g_plain = _loss_grads(replace(base, l1=0.0, loc_l2=0.0), tiny)
    assert torch.allclose(loss_on, loss_quirk)                       # same value ...
    assert all(torch.allclose(a, b) for a, b in zip(g_quirk, g_plain))   # ... but no gradient, as in the code
    # with the terms on the parameters, the mask gradient gains λ₁ sign(m) = 0.1 (masks are ones)
    n = len(G.WEIGHTS)
    for on, plain in zip(g_on[-n:], g_plain[-n:]):
        assert torch.allclose(on - plain, torch.full_like(on, 0.1), atol=1e-6)
    # and the proximal term's gradient is λ₂ (θ − anchor)/‖θ − anchor‖₂ per tensor: here −λ₂ / sqrt(numel)
    w = g_on[0] - g_plain[0]
    numel = w[0, 0].numel()
    assert torch.allclose(w, torch.full_like(w, -0.1 / np.sqrt(numel)), atol=1e-6)


def test_all_ones_masks_leave_the_received_model_unchanged(tiny):
    params = P.initial_params(tiny, 5)
    ones = {k: torch.ones_like(params[k]) for k in G.WEIGHTS}
    assert torch.equal(G.gcn_forward(params, tiny.a_hat, tiny.x, ones), G.gcn_forward(params, tiny.a_hat, tiny.x))


def test_two_group_sbm_layout(tiny):
    S, K, n = tiny.y.shape
    assert (S, K, n) == (2, 4, 40) and list(tiny.groups) == [0, 0, 1, 1]
    assert (tiny.train.sum(-1) == 8).all() and (tiny.test.sum(-1) == 16).all()
    assert not (tiny.train & tiny.test).any() and all(d > 0 for d in tiny.dropped)
    again = P.two_group_sbm([1], n_communities=4, nodes=40, n_feat=6, p_same=0.2, p_diff=0.05, p_out=0.05)
    assert torch.equal(again.x[0], tiny.x[1]) and torch.equal(again.a_hat[0], tiny.a_hat[1])


def test_group_b_sees_permuted_class_means():
    d = P.two_group_sbm([0], n_communities=2, nodes=1200, n_classes=3, n_feat=5, mean_scale=3.0)
    mean = lambda k, c: d.x[0, k][d.y[0, k] == c].mean(0)
    perm = P._class_permutation(3)
    for c in range(3):   # group B's class c has group A's class perm[c] features (up to sampling noise)
        assert torch.allclose(mean(1, c), mean(0, int(perm[c])), atol=0.3)
        assert not torch.allclose(mean(1, c), mean(0, c), atol=0.5)


def test_loop_fedavg_synchronises_local_does_not_and_seeds_are_batch_independent(tiny):
    cfgs = P.baselines(P.fed_pub(hidden=8))
    avg = P.run_subgraph_fl(cfgs["fedavg"], tiny, 3)
    w = avg.params["conv1.weight"]
    assert torch.allclose(w, w[:, :1].expand_as(w)) and avg.global_acc.shape == (2, 4)
    loc = P.run_subgraph_fl(cfgs["local"], tiny, 3)
    assert not torch.allclose(loc.params["conv1.weight"][:, 0], loc.params["conv1.weight"][:, 1])
    pub = P.run_subgraph_fl(cfgs["fed_pub"], tiny, 3)
    assert pub.alpha.shape == (2, 4, 4) and torch.allclose(pub.alpha.sum(-1), torch.ones(2, 4, dtype=torch.float64))
    assert pub.curve.shape == (3, 2, 4) and ((pub.sparsity >= 0) & (pub.sparsity <= 1)).all()
    one = P.two_group_sbm([1], n_communities=4, nodes=40, n_feat=6, p_same=0.2, p_diff=0.05, p_out=0.05)
    alone = P.run_subgraph_fl(cfgs["fed_pub"], one, 3)
    assert torch.allclose(alone.params["clsif.weight"][0], pub.params["clsif.weight"][1], atol=1e-5)


def test_config_and_data_errors():
    with pytest.raises(ValueError, match="aggregation"):
        P.FedPubConfig(aggregation="median")
    with pytest.raises(ValueError, match="scale"):
        P.FedPubConfig(scale=-1)
    with pytest.raises(ValueError, match="hidden"):
        P.FedPubConfig(hidden=0)
    with pytest.raises(ValueError, match="n_communities"):
        P.two_group_sbm([0], n_communities=3)
    with pytest.raises(ValueError, match="train_frac"):
        P.two_group_sbm([0], train_frac=0.7, test_frac=0.4)
    with pytest.raises(ValueError, match="rounds"):
        P.run_subgraph_fl(P.fed_pub(), P.two_group_sbm([0], n_communities=2, nodes=8), 0)
