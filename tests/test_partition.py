import numpy as np
import pytest

from fedlab_nb.data import partition as P
from fedlab_nb.data import FederatedDataset, load_dataset

LABELS = np.repeat(np.arange(10), 100)  # 1,000 samples, 10 balanced classes


def _assert_disjoint_complete(parts, n):
    allrows = np.concatenate(list(parts))
    assert len(allrows) == len(np.unique(allrows)), "clients share a sample"
    assert len(allrows) == n, "some sample was dropped or duplicated"


@pytest.mark.parametrize("name,kw", [("iid", {}), ("dirichlet", {"alpha": 0.3}), ("shards", {"shards_per_client": 2}),
                                     ("quantity_skew", {"sigma": 1.0}), ("quantity_skew", {"kind": "dirichlet", "alpha": 1.0}),
                                     ("feature_skew", {"kind": "noise"})])
def test_disjoint_complete_and_seeded(name, kw):
    a = P.make_partition(name, LABELS, 10, seed=3, **kw)
    b = P.make_partition(name, LABELS, 10, seed=3, **kw)
    assert len(a) == 10
    _assert_disjoint_complete(a, len(LABELS))
    assert all((x == y).all() for x, y in zip(a, b)), "same seed must give the same partition"


def test_pathological_classes_per_client():
    parts = P.pathological(LABELS, 10, classes_per_client=3, seed=0)
    assert [len(np.unique(LABELS[p])) for p in parts] == [3] * 10
    _assert_disjoint_complete(parts, len(LABELS))  # 10 clients × 3 slots cover all 10 classes


def test_shards_label_count():
    parts = P.shards(LABELS, 10, shards_per_client=2, seed=0)
    assert max(len(np.unique(LABELS[p])) for p in parts) <= 2


def test_iid_sizes_balanced():
    assert set(P.iid(LABELS, 7).sizes) <= {142, 143}


def test_dirichlet_min_size_honoured():
    parts = P.dirichlet(LABELS, 20, alpha=0.5, seed=1, min_size=15)
    assert parts.sizes.min() >= 15


def test_quantity_skew_sizes_skewed_labels_iid():
    parts = P.quantity_skew(LABELS, 10, sigma=1.5, seed=0, min_size=5)
    assert parts.sizes.min() >= 5 and parts.sizes.max() > 3 * parts.sizes.min()


def test_label_skew_grows_as_alpha_falls():
    ds = load_dataset("digits")
    emd = [np.mean([FederatedDataset(ds, P.dirichlet(ds.y_train.numpy(), 10, a, seed=s, min_size=5)).heterogeneity()
                    for s in range(3)]) for a in (100.0, 1.0, 0.1)]
    assert emd[0] < emd[1] < emd[2], emd
    assert emd[0] < 0.15 and emd[2] > 0.8


def test_natural_groups():
    groups = np.array([2, 0, 2, 1, 0, 2])
    parts = P.natural(groups)
    assert [list(p) for p in parts] == [[1, 4], [3], [0, 2, 5]]


def test_feature_skew_changes_inputs_per_client():
    ds = load_dataset("digits")
    fed = FederatedDataset(ds, P.feature_skew(ds.y_train.numpy(), 4, kind="noise", strength=1.0), test_fraction=0.0)
    x0, _ = fed.client_train[0]
    x3, _ = fed.client_train[3]
    assert torch_close(x0, ds.x_train[fed.train_idx[0]])  # client 0: strength·0 = no noise
    assert not torch_close(x3, ds.x_train[fed.train_idx[3]])


def torch_close(a, b):
    import torch
    return torch.allclose(a, b)


@pytest.mark.parametrize("call,match", [
    (lambda: P.dirichlet(LABELS, 10, alpha=0), "alpha must be > 0"),
    (lambda: P.dirichlet(LABELS, 10, alpha=-1), "alpha must be > 0"),
    (lambda: P.iid(LABELS, 2000), "exceeds the 1000 samples"),
    (lambda: P.iid(LABELS, 0), "n_clients must be a positive integer"),
    (lambda: P.pathological(LABELS, 5, classes_per_client=11), "classes_per_client=11"),
    (lambda: P.quantity_skew(LABELS, 5, sigma=-1), "sigma must be >= 0"),
    (lambda: P.dirichlet(LABELS, 10, alpha=0.5, min_size=-3), "min_size must be >= 0"),
    (lambda: P.dirichlet(LABELS, 100, alpha=0.01, min_size=10, max_tries=3), "lower min_size"),
    (lambda: P.natural(np.array([0, 1]), n_clients=3), "exceeds the 2 natural groups"),
    (lambda: P.make_partition("nope", LABELS, 3), "unknown partition"),
])
def test_impossible_requests_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
