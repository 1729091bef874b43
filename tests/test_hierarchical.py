"""Tree aggregation (fedlab_nb.methods.communication.hierarchical_aggregation) equals the flat weighted mean.

Which equality holds where: with integer-valued updates and weights every float64 addition is exact, so
the tree equals the flat mean bitwise for any shape and order; a one-leaf tree adds in the same order as
`flat_stream_mean`, so those two are bitwise equal on any data; any other tree adds in another order than
the flat matmul `weighted_mean`, so they agree to ≤ 1e-12 relative (float64 non-associativity), not bitwise."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.method import weighted_mean
from fedlab_nb.data.federated import FederatedDataset
from fedlab_nb.methods.communication.hierarchical_aggregation import (TreeAggregator, flat_stream_mean, hierarchical, mean_of_means,
                                            tree_aggregate, tree_groups)
from fedlab_nb.models import make_model

FAN_OUTS = [2, 3, 5, 16, 32, (4, 2), (8, 3, 2)]


def _updates(m=97, d=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(m, d, generator=g, dtype=torch.float64)
    w = torch.randint(1, 500, (m,), generator=g).double()  # unequal weights n_k
    return u, w


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("fan_out", FAN_OUTS)
def test_tree_equals_flat_to_1e12_relative(fan_out):
    u, w = _updates()
    for perm_seed in range(3):  # random arrival orders
        p = torch.randperm(len(u), generator=torch.Generator().manual_seed(perm_seed))
        assert _rel(tree_aggregate(u[p], w[p], fan_out), weighted_mean(u, w)) <= 1e-12


@pytest.mark.parametrize("fan_out", FAN_OUTS)
def test_tree_is_bitwise_flat_when_additions_are_exact(fan_out):
    g = torch.Generator().manual_seed(1)
    u = torch.randint(-1000, 1000, (61, 50), generator=g).double()
    w = torch.randint(1, 100, (61,), generator=g).double()
    p = torch.randperm(61, generator=g)
    assert torch.equal(tree_aggregate(u[p], w[p], fan_out), flat_stream_mean(u, w))


def test_one_leaf_tree_is_bitwise_the_flat_stream():
    u, w = _updates()
    assert torch.equal(tree_aggregate(u, w, fan_out=len(u)), flat_stream_mean(u, w))


def test_leaves_by_client_id_with_empty_leaves():
    u, w = _updates(m=20)
    ids = np.arange(20) * 4  # ids ≡ 0 mod 4: with 8 leaves, leaves 1, 2, 3, 5, 6, 7 get nothing
    groups = tree_groups(20, 2, leaves=8, client_ids=ids)
    assert len(groups[0]) == 2 and sorted(sum(groups[0], [])) == list(range(20))
    agg, levels = tree_aggregate(u, w, 2, leaves=8, client_ids=ids, measure=True)
    assert _rel(agg, weighted_mean(u, w)) <= 1e-12
    assert levels[0].nodes == 2 and levels[-1].nodes == 1


def test_bytes_per_level_are_the_encoded_messages():
    u, w = _updates(m=64, d=100)
    _, levels = tree_aggregate(u, w, 4, measure=True)
    row = (100 + 1) * 8  # a message is d float64 values plus its weight
    assert [lv.nodes for lv in levels] == [16, 4, 1]
    assert [lv.bytes_in for lv in levels] == [64 * row, 16 * row, 4 * row]
    assert [lv.max_fan_in for lv in levels] == [4, 4, 4]


def test_mean_of_means_is_biased_with_unequal_weights_and_exact_with_equal():
    u, w = _updates(m=32)
    assert _rel(mean_of_means(u, w, 4), weighted_mean(u, w)) > 1e-3
    ones = torch.ones(32, dtype=torch.float64)
    assert _rel(mean_of_means(u, ones, 4), weighted_mean(u, ones)) <= 1e-12  # 32 = 4·4·2: equal-size groups


def _digits_f64():
    fed = fl.federate("digits", "dirichlet", n_clients=10, alpha=0.5, seed=0)
    clients = [(x.double().numpy(), y.numpy()) for x, y in fed.client_train]
    return FederatedDataset.from_clients(clients, test=(fed.x_test.double().numpy(), fed.y_test.numpy()))


def test_fedavg_with_the_tree_rule_equals_flat_fedavg_in_float64():
    fed = _digits_f64()

    def model():
        torch.manual_seed(0)
        return make_model("logreg", fed.input_shape, fed.num_classes).double()

    kw = dict(rounds=3, clients_per_round=None, local_epochs=1, lr=0.1, batch_size=16, progress=False)
    flat = fl.simulate(fl.get_method("fedavg"), fed, model(), **kw)
    for fan_out, leaves in ((2, None), (3, None), (16, None), (2, 4)):  # leaves=4: placed by client id
        tree = fl.simulate(hierarchical(fan_out=fan_out, leaves=leaves), fed, model(), **kw)
        assert tree.theta.dtype == torch.float64
        assert _rel(tree.theta, flat.theta) <= 1e-12
        assert tree["test_acc"].tolist() == flat["test_acc"].tolist()
        assert (tree["tree_bytes_L0"] == 10 * (650 + 1) * 8).all()


def test_clear_errors():
    u, w = _updates(m=5)
    with pytest.raises(ValueError, match="fan_out"):
        tree_aggregate(u, w, fan_out=1)
    with pytest.raises(ValueError, match="fan_out"):
        TreeAggregator(fan_out=(4, 0))
    with pytest.raises(ValueError, match="leaves"):
        TreeAggregator(leaves=0)
    with pytest.raises(ValueError, match="non-negative"):
        tree_aggregate(u, -w)
    with pytest.raises(ValueError, match="one entry per update"):
        tree_aggregate(u, w[:3])
    with pytest.raises(ValueError, match="non-empty"):
        tree_aggregate(u[:0], w[:0])
    with pytest.raises(ValueError, match="weighted-mean method"):
        hierarchical("robust", rule="krum")
