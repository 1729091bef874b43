"""Cocktail Party Attack (fedlab_nb/methods/privacy/cpa.py): the gradient identities it rests on, the exact B = 1 case,
ICA on synthetic independent sources, the sign/permutation-invariant scoring, and secure aggregation."""
import numpy as np
import pytest
import torch

from fedlab_nb.models import make_model
from fedlab_nb.methods.privacy import cpa


def _model(d=60, h=48, seed=0):
    torch.manual_seed(seed)
    return make_model("mlp", (d,), 5, hidden=(h,)).double()


def _batch(B, d=60, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, d, generator=g, dtype=torch.float64), torch.randint(0, 5, (B,), generator=g)


def test_single_input_is_recovered_exactly():
    model = _model()
    x, y = _batch(1)
    gw, gb = cpa.fc_gradient_matrix(model, x, y)
    rec = cpa.invert_single(gw, gb)
    cos = torch.nn.functional.cosine_similarity(rec, x[0], dim=0)
    assert cos > 0.999
    assert torch.allclose(rec, x[0], atol=1e-8)  # not only the direction: the values themselves


def test_gradient_is_deltas_times_inputs_and_has_rank_at_most_B():
    model = _model()
    x, y = _batch(6)
    G, gb = cpa.fc_gradient_matrix(model, x, y)
    delta = cpa.first_layer_deltas(model, x, y)
    assert delta.shape == (6, 48)
    assert torch.allclose(G, delta.T @ x, atol=1e-12, rtol=0)
    assert torch.allclose(gb, delta.sum(0), atol=1e-12, rtol=0)
    assert torch.linalg.matrix_rank(G) <= 6


def test_secure_sum_equals_the_union_batch_gradient():
    model = _model()
    x, y = _batch(12)
    parts = [cpa.fc_gradient_matrix(model, x[i:i + 3], y[i:i + 3], reduction="sum")[0] for i in range(0, 12, 3)]
    union = cpa.fc_gradient_matrix(model, x, y, reduction="sum")[0]
    assert torch.allclose(sum(parts), union, atol=1e-12, rtol=0)


def test_cpa_separates_independent_laplace_sources():
    g = torch.Generator().manual_seed(0)
    B, h, d = 8, 40, 3000
    S = torch.distributions.Laplace(0.0, 1.0).sample((B, d)).double()
    G = torch.randn(h, B, generator=g, dtype=torch.float64) @ S  # a random mixing, as Δᵀ mixes the inputs
    # no image prior here: the negentropy term has to do the separating, so it must outweigh the penalty
    rec = cpa.cocktail_party_attack(G, B, tv_weight=0, ne_weight=100, decor_weight=0.1, temperature=5, steps=300)
    assert cpa.matched_correlation(rec, S).mean > 0.95
    assert cpa.matched_correlation(cpa.fastica_unmixing(G, B), S).mean > 0.95  # the library agrees
    assert cpa.matched_correlation(cpa.random_unmixing(G, B, g), S).mean < 0.9


def test_matched_correlation_is_permutation_sign_and_scale_invariant():
    g = torch.Generator().manual_seed(3)
    true = torch.rand(7, 64, generator=g, dtype=torch.float64)
    true = (true - true.min(1, keepdim=True).values) / (true.max(1, keepdim=True).values - true.min(1, keepdim=True).values)
    perm = torch.randperm(7, generator=g)
    signs = torch.tensor([1.0, -1, -1, 1, -1, 1, 1], dtype=torch.float64)[:, None]
    scrambled = true[perm] * signs * 3.7 + 0.5
    m = cpa.matched_correlation(scrambled, true)
    assert m.mean == pytest.approx(1.0, abs=1e-12)
    assert np.array_equal(perm.numpy()[m.index], np.arange(7))  # true i is matched to where it went
    aligned = cpa.align(scrambled, true, m)
    assert np.allclose(aligned, true.numpy(), atol=1e-12)  # images span [0, 1]: min-max scaling gives them back
    q = cpa.image_quality(scrambled, true, (8, 8), m)
    assert np.all(q["ssim"] > 0.999) and np.all(q["psnr"] > 60)  # min-max scaled truth: identical


def test_dp_gradient_without_noise_and_loose_clip_is_the_plain_gradient():
    model = _model()
    x, y = _batch(5)
    gw, gb = cpa.fc_gradient_matrix(model, x, y)
    dw, db = cpa.dp_fc_gradient(model, x, y, clip=1e6, noise_multiplier=0.0)
    assert torch.allclose(dw, gw, atol=1e-10) and torch.allclose(db, gb, atol=1e-10)
    dw1, _ = cpa.dp_fc_gradient(model, x, y, clip=1e-3, noise_multiplier=0.0)
    assert dw1.norm() <= 1e-3 + 1e-12  # the mean of vectors each clipped to 1e-3 (all parameters) is within 1e-3


def test_clear_errors():
    G = torch.randn(10, 30)
    with pytest.raises(ValueError, match="widen the first layer"):
        cpa.cocktail_party_attack(G, 12)
    with pytest.raises(ValueError, match=r"\[h, d\]"):
        cpa.whiten(torch.randn(3, 4, 5), 2)
    with pytest.raises(ValueError, match="image_shape"):
        cpa.cocktail_party_attack(G, 4, image_shape=(5, 5))
    with pytest.raises(ValueError, match="one label per row"):
        cpa.fc_gradient_matrix(_model(), torch.rand(3, 60, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="grad_w must be"):
        cpa.invert_single(torch.randn(4, 6), torch.randn(5))
    with pytest.raises(ValueError, match="nn.Linear"):
        cpa.first_linear(torch.nn.Conv2d(1, 2, 3))


def test_secure_sum_masks_cancel_and_hide_each_message():
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(6, 9, generator=g, dtype=torch.float64) for _ in range(4)]
    total, messages = cpa.secure_sum(grads, seed=0)
    assert torch.allclose(total, sum(grads), atol=4 * 2.0 ** -40, rtol=0)  # fixed-point rounding only
    plain = torch.remainder(torch.round(grads[0] * 2.0 ** 40).to(torch.int64), cpa.SECAGG_PRIME)
    assert not torch.equal(messages[0], plain)
    assert messages[0].double().mean() / cpa.SECAGG_PRIME == pytest.approx(0.5, abs=0.15)  # uniform residues
    with pytest.raises(ValueError, match="frac_bits"):
        cpa.secure_sum([g * 1e9 for g in grads], seed=0)
