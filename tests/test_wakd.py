"""WAKD (fedlab_nb/methods/beyond/wakd.py): the running mean, SWAD's window, the KD loss and the training entry."""
import numpy as np
import pytest
import torch

from fedlab_nb.methods.beyond import wakd
from fedlab_nb.models import make_model


def test_running_mean_equals_stored_mean_float64():
    g = torch.Generator().manual_seed(0)
    iterates = torch.randn(700, 300, generator=g, dtype=torch.float64) * 5 + 2
    run = wakd.RunningMean()
    for th in iterates:
        run.update(th)
    assert run.n == 700
    assert float((run.mean - iterates.mean(0)).abs().max()) < 1e-12


def test_swad_window_on_hand_made_curve():
    # converges at 3 (2.0 = min of 2.0, 2.1, 2.2), threshold 1.3 * 2.1 = 2.73, six losses above it at 9..14 -> end 14 - 6
    curve = [5, 4, 3, 2.0, 2.1, 2.2, 1.9, 2.0, 2.5, 3.5, 3.6, 3.7, 3.8, 3.9, 4.0, 4.1]
    assert wakd.swad_window(curve, n_converge=3, n_tolerance=6, tolerance_ratio=0.3) == (3, 8)
    # a valley that never dies: the window runs to the last checkpoint
    assert wakd.swad_window([3, 2, 1, 1.1, 1.2, 1.0, 1.05, 1.1]) == (2, 7)
    # strictly decreasing: never converges
    assert wakd.swad_window([5, 4, 3, 2, 1]) is None
    # a larger tolerance ratio keeps more of the rise: threshold 2 * 2.1 = 4.2 is never exceeded
    assert wakd.swad_window(curve, tolerance_ratio=1.0) == (3, 15)


def test_swad_window_rejects_bad_parameters():
    with pytest.raises(ValueError, match="n_converge"):
        wakd.swad_window([1, 2, 3], n_converge=0)


def test_kd_loss_matches_formula_and_vanishes_on_equal_logits():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(8, 10, generator=g, dtype=torch.float64), torch.randn(8, 10, generator=g, dtype=torch.float64)
    T = 5.0
    pt, ps = torch.softmax(t / T, 1), torch.softmax(s / T, 1)
    manual = T ** 2 * (pt * (pt.log() - ps.log())).sum(1).mean()
    assert abs(float(wakd.kd_loss(s, t, T)) - float(manual)) < 1e-12
    assert abs(float(wakd.kd_loss(t, t, T))) < 1e-12
    with pytest.raises(ValueError, match="temperature"):
        wakd.kd_loss(s, t, 0.0)


def test_train_student_wakd_is_the_mean_of_the_iterates_from_the_start():
    torch.manual_seed(0)
    x, y = torch.rand(64, 6), torch.randint(0, 3, (64,))
    model = make_model("mlp", (6,), 3, hidden=(4,))
    run = wakd.train_student(model, None, x, y, val=(x, y, None), iterations=12, avg_start=5, eval_every=4,
                             lr=0.05, batch_size=16, seed=3)
    # replay the same steps and keep the iterates
    from fedlab_nb.models import flatten_params, param_spec, unflatten
    from torch.func import functional_call
    w = flatten_params(model).clone().requires_grad_(True)
    opt, g, its = torch.optim.Adam([w], lr=0.05), torch.Generator().manual_seed(3), []
    for idx in wakd._batches(64, 16, 12, g):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(functional_call(model, unflatten(w, param_spec(model)), (x[idx],)), y[idx]).backward()
        opt.step()
        its.append(w.detach().clone())
    assert torch.allclose(run.last, its[-1])
    assert torch.allclose(run.wakd, torch.stack(its[4:]).mean(0), atol=1e-6)
    assert len(run.val_losses) == 3


def test_train_student_rejects_bad_start():
    model = make_model("mlp", (6,), 3, hidden=(4,))
    x, y = torch.rand(8, 6), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match="avg_start"):
        wakd.train_student(model, None, x, y, val=(x, y, None), iterations=10, avg_start=11)
