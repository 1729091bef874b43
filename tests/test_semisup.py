"""The semi-supervised split and the torch augmentations of fedlab_nb.data.semisup."""
import numpy as np
import pytest
import torch
from scipy import ndimage

import fedlab_nb as fl
from fedlab_nb.data.semisup import (SemiSupervisedDataset, labelled_masks, random_erase, random_shift,
                                    semi_supervised, strong_augment, stratified_counts, weak_augment)


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "dirichlet", n_clients=6, alpha=0.3, seed=1)


def test_stratified_counts_total_and_proportions():
    counts = np.array([50, 30, 0, 20])
    c = stratified_counts(counts, 0.1)
    assert c.sum() == 10 and list(c) == [5, 3, 0, 2]
    assert stratified_counts(np.array([3, 1]), 0.01).sum() == 1  # at least one label
    assert (stratified_counts(np.array([7, 2, 9]), 1.0) == [7, 2, 9]).all()


def test_masks_are_keyed_stratified_and_partition_the_rows(fed):
    m1, m2, m3 = labelled_masks(fed, 0.2, seed=3), labelled_masks(fed, 0.2, seed=3), labelled_masks(fed, 0.2, seed=4)
    assert all((a == b).all() for a, b in zip(m1, m2))
    assert any((a != c).any() for a, c in zip(m1, m3))
    y = fed.dataset.y_train.numpy()
    for idx, m in zip(fed.train_idx, m1):
        hist = np.bincount(y[idx], minlength=10)
        assert (np.bincount(y[idx][m], minlength=10) == stratified_counts(hist, 0.2)).all()
    ss = SemiSupervisedDataset(fed, m1)
    for k in range(fed.num_clients):
        lab, unl = set(ss.train_idx[k]), set(ss.unlabelled_idx[k])
        assert not lab & unl and lab | unl == set(fed.train_idx[k])
        assert len(ss.client_train[k][1]) == len(lab) and len(ss.client_unlabelled[k][0]) == len(unl)
        assert torch.equal(ss.client_unlabelled[k][1], fed.dataset.y_train[ss.unlabelled_idx[k]])
    assert (ss.sizes == [m.sum() for m in m1]).all()
    assert np.allclose(ss.labelled_fraction, [m.mean() for m in m1])


def test_split_errors(fed):
    for bad in (0, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="fraction"):
            semi_supervised(fed, bad)
    masks = labelled_masks(fed, 0.1)
    with pytest.raises(ValueError, match="one entry per client"):
        SemiSupervisedDataset(fed, masks[:-1])
    masks[0] = np.zeros_like(masks[0])
    with pytest.raises(ValueError, match="no labelled row"):
        SemiSupervisedDataset(fed, masks)
    masks[0] = masks[0].astype(int)
    with pytest.raises(ValueError, match="boolean array"):
        SemiSupervisedDataset(fed, masks)


def test_shift_matches_scipy_shift():
    """Every shifted row equals scipy.ndimage.shift of the image by one of the 9 integer offsets (zero fill)."""
    x = torch.rand(40, 1 * 6 * 7)
    out = random_shift(x, (1, 6, 7), torch.Generator().manual_seed(0), max_shift=1)
    offsets = [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1)]
    used = set()
    for xi, oi in zip(x.reshape(40, 6, 7).numpy(), out.reshape(40, 6, 7).numpy()):
        hits = [d for d in offsets if np.array_equal(ndimage.shift(xi, d, order=0, cval=0.0), oi)]
        assert hits, "a shifted row is no integer shift of its image"
        used.add(hits[0])
    assert len(used) > 3  # the offsets do vary
    assert torch.equal(random_shift(x, (1, 6, 7), torch.Generator(), max_shift=0), x)


def test_erase_is_one_rectangle_of_the_right_size():
    x = torch.ones(50, 2 * 10 * 10)
    out = random_erase(x, (2, 10, 10), torch.Generator().manual_seed(1), scale=(0.1, 0.3)).reshape(50, 2, 10, 10)
    for img in out:
        zero = (img[0] == 0)
        assert torch.equal(zero, img[1] == 0)  # all channels
        rows, cols = zero.any(1).nonzero().flatten(), zero.any(0).nonzero().flatten()
        box = zero[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
        assert box.all() and int(zero.sum()) == box.numel()  # one filled rectangle
        assert 5 <= zero.sum() <= 40  # 10-30 % of 100 pixels, rounding of the sides allowed


def test_strong_augment_keyed_and_clipped():
    x = torch.rand(20, 64)
    a = strong_augment(x, (1, 8, 8), torch.Generator().manual_seed(5))
    b = strong_augment(x, (1, 8, 8), torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == x.shape and a.min() >= 0 and a.max() <= 1
    assert not torch.equal(a, weak_augment(x, (1, 8, 8), torch.Generator().manual_seed(5)))


def test_augment_errors():
    x, g = torch.rand(3, 64), torch.Generator()
    with pytest.raises(ValueError, match="input_shape"):
        weak_augment(x, (64,), g)
    with pytest.raises(ValueError, match="rows of 49"):
        weak_augment(x, (1, 7, 7), g)
    with pytest.raises(ValueError, match="generator"):
        weak_augment(x, (1, 8, 8), 0)
    with pytest.raises(ValueError, match="max_shift"):
        random_shift(x, (1, 8, 8), g, max_shift=-1)
    with pytest.raises(ValueError, match="scale"):
        random_erase(x, (1, 8, 8), g, scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="noise_std"):
        strong_augment(x, (1, 8, 8), g, noise_std=-0.1)
