"""WiSE-FT / BANG (fedlab_nb.methods.beyond.wise_ft): the three identities in float64, the toy data, BANG's targets."""
import numpy as np
import pytest
import torch

from fedlab_nb import merging
from fedlab_nb.methods.beyond import wise_ft as W
from fedlab_nb.models import make_model

ALPHAS = W.ALPHAS


def _logreg(seed=0, d=12, c=4):
    g = torch.Generator().manual_seed(seed)
    model = make_model("logreg", (d,), c).double()
    n = d * c + c
    return model, torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64), \
        torch.randn(30, d, generator=g, dtype=torch.float64)


def test_identity1_weight_mix_is_logit_mix_for_linear_models():
    model, a, b, x = _logreg()
    for alpha in ALPHAS:
        mixed = merging.logits(model, merging.interpolate(a, b, alpha), x)
        assert (mixed - ((1 - alpha) * merging.logits(model, a, x) + alpha * merging.logits(model, b, x))).abs().max() < 1e-12


def test_identity1_fails_for_an_mlp():
    torch.manual_seed(0)
    model = make_model("mlp", (12,), 4, hidden=(16,)).double()
    g = torch.Generator().manual_seed(1)
    d = sum(p.numel() for p in model.parameters())
    a, b = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    x = torch.randn(30, 12, generator=g, dtype=torch.float64)
    gap = (merging.logits(model, merging.interpolate(a, b, 0.5), x)
           - 0.5 * (merging.logits(model, a, x) + merging.logits(model, b, x))).abs().max()
    assert gap > 1e-3  # the ReLU breaks linearity in the weights


def test_identity2_binary_never_flips_three_classes_can():
    g = torch.Generator().manual_seed(0)
    m0, m1 = -torch.rand(5000, generator=g, dtype=torch.float64), -torch.rand(5000, generator=g, dtype=torch.float64)
    assert all(int((((1 - a) * m0 + a * m1) > 0).sum()) == 0 for a in ALPHAS)
    f0, f1 = torch.tensor([0.9, 1.0, 0.0], dtype=torch.float64), torch.tensor([0.9, 0.0, 1.0], dtype=torch.float64)
    assert f0.argmax() == 1 and f1.argmax() == 2 and (0.5 * (f0 + f1)).argmax() == 0


def test_identity3_overconfidence_is_a_shifted_alpha():
    g = torch.Generator().manual_seed(0)
    f0, f1 = torch.randn(2000, 7, generator=g, dtype=torch.float64), torch.randn(2000, 7, generator=g, dtype=torch.float64)
    for alpha in ALPHAS:
        for c in (0.3, 2.0, 7.0):
            a2 = W.overconfident_alpha(alpha, c)
            scaled, unscaled = (1 - alpha) * f0 + alpha * c * f1, (1 - a2) * f0 + a2 * f1
            assert (scaled - (1 - alpha + alpha * c) * unscaled).abs().max() < 1e-12  # proportional, factor > 0
            assert torch.equal(scaled.argmax(1), unscaled.argmax(1))
    with pytest.raises(ValueError, match="c > 0"):
        W.overconfident_alpha(0.5, 0.0)


def test_scale_last_layer_divides_the_logits():
    torch.manual_seed(0)
    model = make_model("mlp", (10,), 3, hidden=(8,)).double()
    theta = merging.fit(model, None, torch.randn(20, 10).double(), torch.randint(0, 3, (20,)), epochs=0)
    x = torch.randn(15, 10, dtype=torch.float64)
    for t in (0.5, 2.0, 3.0):
        got = merging.logits(model, W.scale_last_layer(model, theta, t), x)
        assert (got - merging.logits(model, theta, x) / t).abs().max() < 1e-12
    with pytest.raises(ValueError, match="temperature"):
        W.scale_last_layer(model, theta, 0)


def test_multicolor_blocks():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(4000, 5), torch.randint(0, 10, (4000,))
    out = W.multicolor_digits(x, y, informative=[0, 1], blocks=4, p=0.8, generator=g)
    assert out.shape == (4000, 5 + 40) and torch.equal(out[:, :5], x)
    colour = out[:, 5:].reshape(4000, 4, 10).argmax(-1)
    assert (out[:, 5:].reshape(4000, 4, 10).sum(-1) == 1).all()
    match = (colour == y[:, None]).double().mean(0)
    assert abs(match[0] - (0.8 + 0.2 / 10)) < 0.03 and abs(match[3] - 0.1) < 0.03  # informative vs random block
    with pytest.raises(ValueError, match="informative"):
        W.multicolor_digits(x, y, informative=[4], blocks=4, generator=g)


def test_mixup_targets_are_mixed_smoothed_distributions():
    rng = np.random.default_rng(0)
    x, y = torch.rand(50, 6, dtype=torch.float64), torch.randint(0, 4, (50,))
    xm, t = W.mixup_targets(x, y, 4, copies=3, beta=0.2, smoothing=0.1, rng=rng)
    assert xm.shape == (150, 6) and t.shape == (150, 4)
    assert (t.sum(1) - 1).abs().max() < 1e-12 and t.min() >= 0.1 / 4 - 1e-12 and t.max() <= 0.9 + 0.025 + 1e-12
    # soft cross-entropy against a one-hot target is the ordinary cross-entropy
    logits = torch.randn(8, 4, dtype=torch.float64)
    yy = torch.randint(0, 4, (8,))
    assert abs(float(W.soft_cross_entropy(logits, torch.nn.functional.one_hot(yy, 4).double())
                     - torch.nn.functional.cross_entropy(logits, yy))) < 1e-12
    with pytest.raises(ValueError, match="smoothing"):
        W.mixup_targets(x, y, 4, smoothing=1.0, rng=rng)


def test_fft_ttf_counts_on_a_constructed_case():
    # a 1-feature "model" whose logits are set directly through a logreg with zero weights and chosen biases
    model = make_model("logreg", (1,), 3).double()
    x, y = torch.zeros(1, 1, dtype=torch.float64), torch.tensor([0])
    th0 = torch.tensor([0, 0, 0, 0.9, 1.0, 0.0], dtype=torch.float64)
    th1 = torch.tensor([0, 0, 0, 0.9, 0.0, 1.0], dtype=torch.float64)
    assert W.fft_ttf(model, th0, th1, x, y) == {"FFT": 1, "TTF": 0, "FF": 1, "TT": 0}
