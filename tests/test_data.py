import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.data import DatasetNotAvailable, load_dataset


@pytest.mark.parametrize("name,n,d,c", [("digits", 1797, 64, 10), ("breast_cancer", 569, 30, 2), ("wine", 178, 13, 3),
                                        ("mnist5k", 5000, 784, 10)])
def test_bundled_loaders(name, n, d, c):
    ds = load_dataset(name)
    assert len(ds.y_train) + len(ds.y_test) == n
    assert ds.x_train.shape[1] == d and ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.num_classes == c and set(ds.y_train.unique().tolist()) == set(range(c))


def test_mnist5k_is_shuffled_and_scaled():
    ds = load_dataset("mnist5k")
    assert 0 <= ds.x_train.min() and ds.x_train.max() <= 1
    assert len(set(ds.y_train[:50].tolist())) > 5  # not sorted by label


def test_fashion_mnist_offline():
    try:
        ds = load_dataset("fashion_mnist", max_train=1000)
    except DatasetNotAvailable as e:
        pytest.skip(str(e))
    assert ds.x_train.shape == (1000, 784) and len(ds.y_test) == 10000 and ds.input_shape == (1, 28, 28)


def test_missing_dataset_says_how_to_get_it(tmp_path):
    with pytest.raises(DatasetNotAvailable, match="fedlab-nb data fetch mnist"):
        load_dataset("mnist", root=str(tmp_path))
    with pytest.raises(DatasetNotAvailable, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion_mnist", root=str(tmp_path))


def test_unknown_dataset_suggests():
    with pytest.raises(ValueError, match="did you mean|Did you mean"):
        load_dataset("mnist5")


def test_synthetic_heterogeneity_and_groups():
    ds = load_dataset("synthetic", alpha=1.0, beta=1.0, num_clients=10, seed=0)
    assert set(np.unique(ds.groups_train)) == set(range(10))
    fed = fl.federate(ds, "natural")
    assert fed.num_clients == 10
    iid = fl.federate(load_dataset("synthetic", iid=True, num_clients=10), "natural")
    assert fed.heterogeneity() > iid.heterogeneity()


def test_federated_dataset_stats(digits_fed):
    h = digits_fed.label_histogram()
    assert h.shape == (8, 10) and h.sum() == digits_fed.sizes.sum()
    assert 0 < digits_fed.heterogeneity("js") <= 1
    assert list(digits_fed.summary().columns) == ["client", "n_train", "n_test", "classes", "top_class_share"]
    for tr, te in zip(digits_fed.train_idx, digits_fed.test_idx):
        assert not set(tr) & set(te)


def test_list_datasets():
    names = [d["name"] for d in fl.list_datasets()]
    assert {"digits", "mnist5k", "mnist1d", "fashion_mnist", "synthetic"} <= set(names)
