"""FLIP (Zhang et al., ICLR 2023): trigger inversion, stamping, the rejection rule, the client update."""
import numpy as np
import pytest
import torch

from fedlab_nb.methods.robustness.flip import (FLIPClient, flip, harden_rows, invert_trigger, model_forward,
                                    reject_low_confidence, stamp)
from fedlab_nb.methods.robustness.poison import corner_pattern

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def backdoored():
    """A linear classifier on 3 random-prototype classes (6×6 images) trained with a planted 2×2 corner trigger → 0."""
    g = torch.Generator().manual_seed(0)
    protos = torch.rand(3, 36, generator=g) * 0.6
    y = torch.arange(3).repeat(100)
    x = (protos[y] + 0.1 * torch.randn(300, 36, generator=g)).clamp(0, 0.6)
    pattern = list(corner_pattern((36,), 2))
    xt = x.clone()
    xt[:, pattern] = 1.0
    model = torch.nn.Linear(36, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    xs, ys = torch.cat([x, xt]), torch.cat([y, torch.zeros_like(y)])
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
    assert (model(xt).argmax(1) == 0).float().mean() > 0.95 and (model(x).argmax(1) == y).float().mean() > 0.9
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    return model, theta, x, y, pattern


def test_inversion_recovers_the_planted_trigger(backdoored):
    model, theta, x, y, pattern = backdoored
    f = model_forward(model, theta)
    mask, pat = invert_trigger(f, x[y != 0][:64], 0, steps=200, lam=0.02, generator=torch.Generator().manual_seed(1))
    assert mask.shape == (36,) and 0 <= float(mask.min()) and float(mask.max()) <= 1
    assert float(mask[pattern].sum() / mask.sum()) > 0.5          # most of the mask's mass sits on the trigger
    assert set(mask.topk(2).indices.tolist()) <= set(pattern)     # the strongest entries are trigger pixels (a linear
    # model needs only part of the 2×2 patch: the inversion finds the smallest mask that works)
    assert (f(stamp(x[y != 0], mask, pat)).argmax(1) == 0).float().mean() > 0.9


def test_batched_targets_equal_separate_runs(backdoored):
    model, theta, x, y, _ = backdoored
    f = model_forward(model, theta)
    xs = torch.stack([x[y != t][:20] for t in range(3)])
    g = torch.Generator().manual_seed(3)
    m0, p0 = torch.rand(3, 36, generator=g), torch.rand(3, 36, generator=g)
    m, p = invert_trigger(f, xs, [0, 1, 2], steps=15, lam=0.01, init=(m0, p0))
    assert m.shape == (3, 36) and p.shape == (3, 36)
    for t in range(3):
        mt, pt = invert_trigger(f, xs[t], t, steps=15, lam=0.01, init=(m0[t], p0[t]))
        torch.testing.assert_close(mt, m[t], atol=1e-5, rtol=0)
        torch.testing.assert_close(pt, p[t], atol=1e-5, rtol=0)


def test_stamp_is_the_convex_mix():
    x = torch.rand(4, 9)
    mask = torch.zeros(9)
    mask[[0, 4]] = 1.0
    mask[8] = 0.25
    pattern = torch.full((9,), 0.5)
    out = stamp(x, mask, pattern)
    assert torch.equal(out[:, [0, 4]], torch.full((4, 2), 0.5))
    assert torch.equal(out[:, 1:4], x[:, 1:4])
    torch.testing.assert_close(out[:, 8], 0.75 * x[:, 8] + 0.125)


def test_harden_rows_keeps_labels_and_stamps_the_fraction(backdoored):
    model, theta, x, y, _ = backdoored
    g = np.random.default_rng(0)
    xh = harden_rows(model_forward(model, theta), x, y, 3, g, targets=None, fraction=0.3, rows=16, steps=5,
                     lam=0.01, lr=0.1)
    changed = (xh != x).any(1)
    assert int(changed.sum()) == round(0.3 * len(y))


def test_rejection_rule():
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05], [0.4, 0.35, 0.25], [0.34, 0.33, 0.33]]))
    assert reject_low_confidence(logits, 0.4).tolist() == [False, False, True]
    assert reject_low_confidence(logits, 0.0).tolist() == [False] * 3
    assert reject_low_confidence(logits, 1.0).tolist() == [True] * 3


def test_bad_inputs():
    f = lambda x: x
    with pytest.raises(ValueError, match="threshold"):
        reject_low_confidence(torch.zeros(2, 3), 1.5)
    with pytest.raises(ValueError, match="logits"):
        reject_low_confidence(torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match="x must be"):
        invert_trigger(f, torch.zeros(0, 4), 0)
    with pytest.raises(ValueError, match="lam"):
        invert_trigger(f, torch.zeros(2, 4), 0, lam=-1)
    with pytest.raises(ValueError, match="mask"):
        stamp(torch.zeros(2, 4), torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="fraction"):
        flip(fraction=0)
    with pytest.raises(ValueError, match="steps"):
        FLIPClient(steps=0)
