"""Dense graph pieces (fedlab_nb/methods/personalisation/graphs.py): SBM sampler, community split, planted-partition graph, Â, the GCN."""
import numpy as np
import pytest
import torch
from scipy.linalg import eigh

from fedlab_nb.methods.personalisation import graphs as G
from fedlab_nb.models import flatten_params, param_spec, unflatten


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_sbm_is_symmetric_without_self_loops_and_follows_its_probabilities():
    labels = np.tile(np.arange(2), 20)
    communities = np.repeat(np.arange(2), 20)
    adj = G.sample_sbm(labels, communities, p_same=1.0, p_diff=0.0, p_out=0.0, rng=_rng())
    assert np.array_equal(adj, adj.T) and not adj.diagonal().any()
    expect = (labels[:, None] == labels[None, :]) & (communities[:, None] == communities[None, :])
    np.fill_diagonal(expect, False)
    assert np.array_equal(adj.astype(bool), expect)   # p = 1 / 0 make the draw deterministic


def test_sbm_edge_rates_match_p():
    n = 400
    labels, communities = np.zeros(n, int), np.repeat([0, 1], n // 2)
    adj = G.sample_sbm(labels, communities, p_same=0.2, p_diff=0.0, p_out=0.05, rng=_rng(1))
    inside = adj[:200, :200][np.triu_indices(200, 1)].mean()
    across = adj[:200, 200:].mean()
    assert inside == pytest.approx(0.2, abs=0.01) and across == pytest.approx(0.05, abs=0.005)


def test_split_drops_exactly_the_cross_community_edges():
    communities = np.repeat(np.arange(3), 10)
    adj = G.sample_sbm(np.zeros(30, int), communities, 0.5, 0.5, 0.3, _rng(2))
    nodes, blocks, dropped = G.split_communities(adj, communities)
    cross = (communities[:, None] != communities[None, :])
    assert dropped == int(adj[cross].sum()) // 2 > 0
    for idx, block in zip(nodes, blocks):
        assert np.array_equal(block, adj[np.ix_(idx, idx)])


def test_random_partition_graph_without_p_out_is_block_diagonal():
    adj = G.random_partition_graph([5, 7], p_in=1.0, p_out=0.0, rng=_rng())
    expect = np.zeros((12, 12), int)
    expect[:5, :5] = expect[5:, 5:] = 1
    np.fill_diagonal(expect, 0)
    assert np.array_equal(adj, expect)


def test_normalized_adjacency_entries_and_top_eigenvector():
    adj = G.sample_sbm(np.zeros(25, int), np.zeros(25, int), 0.2, 0.2, 0.0, _rng(3))
    a_hat = G.normalized_adjacency(adj, dtype=torch.float64).numpy()
    d = adj.sum(1) + 1.0                       # degrees of A + I
    assert np.allclose(a_hat, (adj + np.eye(25)) / np.sqrt(np.outer(d, d)), atol=1e-15)
    # Â sqrt(d) = sqrt(d): the top eigenvalue of Â is 1 with eigenvector D^{1/2} 1 (scipy's eigensolver agrees)
    assert np.allclose(a_hat @ np.sqrt(d), np.sqrt(d), atol=1e-12)
    assert eigh(a_hat, eigvals_only=True)[-1] == pytest.approx(1.0, abs=1e-12)


def test_normalized_adjacency_keeps_batch_dims_and_checks_input():
    adj = np.stack([G.random_partition_graph([4], 0.5, 0.0, _rng(s)) for s in range(3)])
    batched = G.normalized_adjacency(adj)
    assert torch.equal(batched[1], G.normalized_adjacency(adj[1]))
    with pytest.raises(ValueError, match="square"):
        G.normalized_adjacency(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="symmetric"):
        G.normalized_adjacency(np.triu(np.ones((3, 3)), 1))


def test_gcn_forward_matches_the_node_wise_gcn_formula():
    g = torch.Generator().manual_seed(0)
    adj = G.sample_sbm(np.zeros(8, int), np.zeros(8, int), 0.4, 0.4, 0.0, _rng(4))
    a_hat = G.normalized_adjacency(adj, dtype=torch.float64)
    p = {k: v.double() + 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64)
         for k, v in G.gcn_init(3, 5, 2, g).items()}
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    deg = adj.sum(1) + 1

    def conv(h, w, b):   # x'_i = Σ_{j ∈ N(i) ∪ {i}} (d_i d_j)^{-1/2} W x_j + b (Kipf & Welling)
        out = []
        for i in range(8):
            nbrs = [j for j in range(8) if adj[i, j] or i == j]
            out.append(sum(w @ h[j] / np.sqrt(deg[i] * deg[j]) for j in nbrs) + b)
        return torch.stack(out)
    h1 = torch.relu(conv(x, p["conv1.weight"], p["conv1.bias"]))
    h2 = conv(h1, p["conv2.weight"], p["conv2.bias"])
    logits = torch.relu(h2) @ p["clsif.weight"].T + p["clsif.bias"]
    assert torch.allclose(G.gcn_forward(p, a_hat, x, embedding=True), h2, atol=1e-12)
    assert torch.allclose(G.gcn_forward(p, a_hat, x), logits, atol=1e-12)


def test_gcn_batched_equals_per_item_and_masks_multiply_weights():
    g = torch.Generator().manual_seed(1)
    p = G.gcn_init(4, 6, 3, g, batch=(2,))
    adj = np.stack([G.random_partition_graph([5], 0.6, 0.0, _rng(s)) for s in range(2)])
    a_hat, x = G.normalized_adjacency(adj), torch.randn(2, 5, 4, generator=g)
    out = G.gcn_forward(p, a_hat, x)
    for b in range(2):
        assert torch.allclose(out[b], G.gcn_forward({k: v[b] for k, v in p.items()}, a_hat[b], x[b]), atol=1e-6)
    ones = {k: torch.ones_like(p[k]) for k in G.WEIGHTS}
    assert torch.equal(G.gcn_forward(p, a_hat, x, ones), out)
    zero_cls = dict(ones, **{"clsif.weight": torch.zeros_like(p["clsif.weight"])})
    assert torch.equal(G.gcn_forward(p, a_hat, x, zero_cls), p["clsif.bias"].unsqueeze(-2).expand_as(out))


def test_dropout_streams_per_leading_index_are_independent_of_the_batch():
    p = G.gcn_init(3, 4, 2, torch.Generator().manual_seed(0), batch=(2,))
    a_hat, x = torch.eye(5).expand(2, 5, 5), torch.ones(2, 5, 3)
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]
    both = G.gcn_forward(p, a_hat, x, dropout=0.5, generator=gens([7, 8]))
    alone = G.gcn_forward({k: v[1:] for k, v in p.items()}, a_hat[1:], x[1:], dropout=0.5, generator=gens([8]))
    assert torch.allclose(both[1:], alone)
    with pytest.raises(ValueError, match="generators"):
        G.gcn_forward(p, a_hat, x, dropout=0.5, generator=gens([1]))


def test_dense_gcn_module_fits_the_flat_parameter_conventions():
    model = G.DenseGCN(4, 6, 3, torch.Generator().manual_seed(0))
    a_hat, x = G.normalized_adjacency(G.random_partition_graph([7], 0.5, 0.0, _rng())), torch.randn(7, 4)
    flat = flatten_params(model)
    params = unflatten(flat, param_spec(model))
    assert torch.equal(model(x, a_hat), G.gcn_forward(params, a_hat, x))
    out = torch.func.functional_call(model, unflatten(2 * flat, param_spec(model)), (x, a_hat))
    assert out.shape == (7, 3)


def test_argument_errors_name_the_parameter():
    with pytest.raises(ValueError, match="p_out"):
        G.sample_sbm([0, 1], [0, 0], 0.5, 0.5, 1.5, _rng())
    with pytest.raises(ValueError, match="same length"):
        G.sample_sbm([0, 1], [0], 0.5, 0.5, 0.5, _rng())
    with pytest.raises(ValueError, match="sizes"):
        G.random_partition_graph([], 0.5, 0.0, _rng())
    with pytest.raises(ValueError, match="hidden"):
        G.gcn_init(3, 0, 2)
    with pytest.raises(ValueError, match="dropout"):
        G.gcn_forward(G.gcn_init(3, 4, 2), torch.eye(2), torch.ones(2, 3), dropout=1.0)
    with pytest.raises(ValueError, match="gcn_init"):
        G.gcn_forward({}, torch.eye(2), torch.ones(2, 3))
