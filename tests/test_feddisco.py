"""FedDisco weights: a hand-computed case, the all-zero guard, bad input, and the plug-in into the engine."""
import numpy as np
import pytest
import scipy.stats
import torch

import fedlab_nb as fl
from fedlab_nb.core.method import RoundInfo
from fedlab_nb.methods.weights.feddisco import FedDiscoWeighting, disco_weights, discrepancy, feddisco

BALANCED_AND_ONE_CLASS = np.array([[5, 5], [10, 0]])   # n = 10 each; uniform target (1/2, 1/2)


def test_hand_computed_weights_l1_and_kl():
    # l1: d = (0, 1); KL: d = (0, log 2) / log 2 = (0, 1). raw = (0.5 + 0.1, 0.5 − 0.5 + 0.1) = (0.6, 0.1)
    for metric in ("l1", "kl"):
        d = discrepancy(BALANCED_AND_ONE_CLASS, metric=metric)
        np.testing.assert_allclose(d, [0.0, 1.0], atol=1e-12)
        np.testing.assert_allclose(disco_weights([10, 10], d, a=0.5, b=0.1), [6 / 7, 1 / 7], rtol=1e-12)


def test_l2_and_cosine_hand_values():
    np.testing.assert_allclose(discrepancy(BALANCED_AND_ONE_CLASS, metric="l2"), [0.0, np.sqrt(0.5)], atol=1e-12)
    np.testing.assert_allclose(discrepancy(BALANCED_AND_ONE_CLASS, metric="cosine"), [0.0, 1 - np.sqrt(0.5)],
                               atol=1e-12)


def test_kl_matches_scipy_entropy():
    counts = np.array([[3, 1, 0, 6], [1, 1, 1, 1], [0, 0, 9, 1], [2, 5, 2, 1]])
    t = np.array([0.1, 0.2, 0.3, 0.4])
    kl = np.array([scipy.stats.entropy(c / c.sum(), t) for c in counts])
    np.testing.assert_allclose(discrepancy(counts, t, "kl"), kl / kl.sum(), rtol=1e-12)


def test_all_zero_weights_fall_back_to_data_size_with_a_warning():
    d = discrepancy(np.array([[30, 0], [0, 10]]), metric="l1")      # d = (1, 1): 0.75 − 10 < 0, 0.25 − 10 < 0
    with pytest.warns(RuntimeWarning, match="every weight"):
        w = disco_weights([30, 10], d, a=10.0, b=0.0)
    np.testing.assert_allclose(w, [0.75, 0.25])


def test_weight_decreases_with_discrepancy_at_fixed_size():
    w = disco_weights(np.full(5, 20.0), np.linspace(0, 0.3, 5), a=0.5, b=0.1)
    assert np.all(np.diff(w) < 0) and np.isclose(w.sum(), 1.0)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="metric"):
        discrepancy(BALANCED_AND_ONE_CLASS, metric="emd")
    with pytest.raises(ValueError, match="no empty row"):
        discrepancy(np.array([[0, 0], [1, 1]]))
    with pytest.raises(ValueError, match="target"):
        discrepancy(BALANCED_AND_ONE_CLASS, target=[0.9, 0.3])
    with pytest.raises(ValueError, match="sizes"):
        disco_weights([10, 0], [0.1, 0.2])
    with pytest.raises(ValueError, match="a must be"):
        FedDiscoWeighting(BALANCED_AND_ONE_CLASS, a=float("nan"))
    with pytest.raises(ValueError, match="base"):
        feddisco(counts=BALANCED_AND_ONE_CLASS, base="scaffold")
    with pytest.raises(ValueError, match="exactly one"):
        feddisco()


def test_weighting_uses_only_the_rounds_clients():
    counts = np.array([[5, 5], [10, 0], [0, 7]])
    wt = FedDiscoWeighting(counts, a=0.5, b=0.1, metric="l1")
    info = RoundInfo(round=1, client_ids=np.array([0, 1]), sizes=torch.tensor([10.0, 10.0]),
                     steps=torch.ones(2), num_clients=3, lr=0.1)
    w, _ = wt(wt.init_state(torch.zeros(1), 3), info)
    torch.testing.assert_close(w, torch.tensor([6 / 7, 1 / 7]))
    with pytest.raises(ValueError, match="histograms for 3 clients"):
        wt.init_state(torch.zeros(1), 4)


def test_plugin_with_a_b_zero_is_the_host_method():
    torch.set_num_threads(1)
    fed = fl.federate("digits", "dirichlet", n_clients=6, alpha=0.3, seed=0)
    kw = dict(model="logreg", rounds=2, clients_per_round=3, local_epochs=1, batch_size=32, lr=0.1, seed=0,
              progress=False)
    for base in ("fedavg", "fedprox"):
        host = fl.simulate(fl.get_method(base), fed, **kw)
        disco = fl.simulate(feddisco(fed, base=base, a=0.0, b=0.0), fed, **kw)
        np.testing.assert_allclose(disco["test_acc"].to_numpy(), host["test_acc"].to_numpy())
        torch.testing.assert_close(disco.theta, host.theta)


def test_niid2_partition_is_the_official_split():
    from fedlab_nb.methods.weights.feddisco import niid2_partition
    labels = np.repeat(np.arange(10), 60)                     # 60 per class: 6 shards of 10
    parts = niid2_partition(labels, seed=0)
    assert [len(p) for p in parts] == [100] * 6
    for i, p in enumerate(parts[:5]):
        assert set(labels[p]) == {2 * i, 2 * i + 1}
    assert np.bincount(labels[parts[5]], minlength=10).tolist() == [10] * 10
    assert len(np.unique(np.concatenate(parts))) == 600
    with pytest.raises(ValueError, match="10 classes"):
        niid2_partition(np.repeat(np.arange(4), 10))


def test_niid2_is_a_named_partitioner():
    import fedlab_nb as fl
    from fedlab_nb.data import make_partition
    from fedlab_nb.methods.weights.feddisco import niid2_partition
    labels = np.repeat(np.arange(10), 60)
    named, direct = make_partition("niid2", labels, 6, seed=2), niid2_partition(labels, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(named.parts if hasattr(named, "parts") else named,
                                                       direct.parts if hasattr(direct, "parts") else direct))
    assert fl.federate("digits", partition="niid2", n_clients=6, seed=0).num_clients == 6
    with pytest.raises(ValueError, match="n_iid"):
        make_partition("niid2", labels, 6, n_iid=6)
    with pytest.raises(ValueError, match="multiple of 5"):
        make_partition("niid2", labels, 7, n_iid=1)
