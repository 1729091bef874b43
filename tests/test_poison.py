"""Data poisoning through the engine hook (fedlab_nb/methods/robustness/poison.py): label flips equal the dataset copy, the
backdoor stamps a keyed fraction of rows, the attack success rate, and errors."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.robustness import poison as P
from fedlab_nb.methods.robustness.robust_aggregation import flip_client_labels


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "dirichlet", n_clients=6, alpha=0.5, seed=0)


def test_label_flip_hook_equals_the_dataset_copy(fed):
    kw = dict(rounds=3, clients_per_round=None, lr=0.1, progress=False, seed=2, backend="loop")
    hook = fl.simulate("fedavg", fed, poison=P.LabelFlip((1, 4), fed.num_classes), **kw)
    copy = fl.simulate("fedavg", flip_client_labels(fed, (1, 4)), **kw)
    assert torch.equal(hook.theta, copy.theta)
    clean = fl.simulate("fedavg", fed, **kw)
    assert not torch.equal(hook.theta, clean.theta)


def test_trigger_stamps_a_keyed_fraction_and_relabels(fed):
    pattern = P.corner_pattern((1, 8, 8), size=2)
    assert len(pattern) == 4 and max(pattern) == 63
    trig = P.PixelTrigger((0,), target=3, pattern=pattern, value=16.0, fraction=0.5)
    x, y = fed.client_train[0]
    x2, y2 = trig(0, 5, x, y, np.random.default_rng(1))
    changed = (x2 != x).reshape(len(x), -1).any(1) | (y2 != y)
    stamped = (x2.reshape(len(x), -1)[:, list(pattern)] == 16.0).all(1)
    assert stamped.sum() == round(0.5 * len(y)) and (y2[stamped] == 3).all()
    assert torch.equal(x2[~stamped], x[~stamped]) and torch.equal(y2[~stamped], y[~stamped])
    assert changed.sum() <= stamped.sum()
    x3, _ = trig(0, 5, x, y, np.random.default_rng(1))
    assert torch.equal(x2, x3)                      # same key, same rows
    assert torch.equal(fed.client_train[0][0], x)    # the federation's own tensors are untouched


def test_backdoor_reaches_history_and_is_learned(fed):
    trig = P.PixelTrigger((0, 1, 2), target=0, pattern=P.corner_pattern((1, 8, 8), 3), value=16.0, fraction=0.5)
    hist = fl.simulate("fedavg", fed, rounds=15, lr=0.1, progress=False, seed=0, poison=trig, eval_every=5)
    assert "asr" in hist.columns and hist.asr.notna().sum() == 3
    clean = fl.simulate("fedavg", fed, rounds=15, lr=0.1, progress=False, seed=0)
    asr_clean = P.attack_success_rate(clean.model, clean.theta, fed.x_test, fed.y_test, trig)
    assert hist.asr.iloc[-1] > asr_clean + 0.3     # the trigger works on the poisoned model, not on a clean one


def test_asr_counts_only_other_classes_and_the_replacement_scale(fed):
    trig = P.PixelTrigger((0,), target=2, pattern=(0, 1))
    assert P.model_replacement_scale(10, 1.0) == 10 and P.model_replacement_scale(10, 0.5) == 20
    with pytest.raises(ValueError, match="target class"):
        P.attack_success_rate(None, None, fed.x_test[:3], torch.full((3,), 2), trig)


def test_bad_poison_names_the_fix(fed):
    with pytest.raises(ValueError, match="fraction"):
        P.PixelTrigger((0,), target=0, pattern=(1,), fraction=0)
    with pytest.raises(ValueError, match="corner_pattern"):
        P.PixelTrigger((0,), target=0, pattern=())
    with pytest.raises(ValueError, match="at least one client"):
        P.LabelFlip((), 10)
    with pytest.raises(ValueError, match="not clients of this federation"):
        fl.simulate("fedavg", fed, rounds=1, progress=False, poison=P.LabelFlip((9,), 10))
    with pytest.raises(TypeError, match="poison must be a callable"):
        fl.simulate("fedavg", fed, rounds=1, progress=False, poison=(1, 2))
