"""fedlab_nb.methods.labels.quantize: the uniform symmetric (narrow-range) b-bit quantiser with a zero level, stochastic
rounding, the STE, per-layer scales on weights only, bytes."""
import math

import pytest
import torch

from fedlab_nb.methods.communication.compression import QSGD
from fedlab_nb.models import flatten_params, make_model, param_spec
from fedlab_nb.methods.labels.quantize import (check_bits, decode, dequantize, encode, fake_quantize, fake_quantize_flat, layer_ranges,
                                layer_slices, levels, model_bytes, payload_bytes, quantize, quantize_flat,
                                quantize_levels, step)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_grid_has_2_to_the_b_minus_1_levels_with_zero_and_is_idempotent(bits):
    w = torch.linspace(-1, 1, 20001)
    q = quantize(w, bits)
    assert q.unique().numel() == levels(bits) == 2 ** bits - 1
    assert (q == 0).any() and torch.equal(quantize(torch.zeros(3), bits), torch.zeros(3))
    assert torch.equal(quantize(q, bits), q)
    assert (q - w).abs().max() <= step(bits, 1.0) / 2 + 1e-6


def test_levels_are_the_symmetric_grid():
    assert torch.allclose(quantize(torch.linspace(-3, 3, 1001), 2).unique(), torch.tensor([-3.0, 0.0, 3.0]))
    assert torch.allclose(quantize(torch.linspace(-3, 3, 1001), 3).unique(), torch.tensor([-3.0, -2, -1, 0, 1, 2, 3]))
    w = torch.tensor([0.0, 0.4, -2.0])  # a zero weight stays exactly zero next to a large one
    assert quantize(w, 4)[0] == 0


def test_32_bits_is_the_identity_and_r_zero_gives_zero():
    w = torch.randn(100)
    assert quantize(w, 32) is w and fake_quantize(w, 32) is w
    assert torch.equal(quantize(torch.zeros(5), 4), torch.zeros(5))


def test_stochastic_rounding_is_unbiased_and_keyed():
    g = torch.Generator().manual_seed(0)
    w = torch.full((200_000,), 0.3)
    q = quantize(w, 2, R=1.0, stochastic=True, generator=g)
    se = q.std() / math.sqrt(len(q))
    assert abs(q.mean() - 0.3) < 3 * se
    assert torch.allclose(q.unique(), torch.tensor([0.0, 1.0]))  # the two levels around 0.3 on {−1, 0, 1}
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(quantize(w[:100], 3, 1.0, True, g1), quantize(w[:100], 3, 1.0, True, g2))


def test_nearest_rounding_mse_is_delta_squared_over_12():
    g = torch.Generator().manual_seed(1)
    w = torch.rand(400_000, generator=g, dtype=torch.float64) * 2 - 1
    for bits in (2, 4, 6):
        mse = ((quantize(w, bits, R=1.0) - w) ** 2).mean()
        assert abs(mse / (step(bits, 1.0) ** 2 / 12) - 1) < 0.02


def test_ste_passes_the_gradient_straight_through():
    w = torch.randn(50, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = fake_quantize(w, 2)
    assert torch.allclose(y.detach(), quantize(w.detach(), 2), atol=1e-6)  # w + (Q − w): Q up to one rounding
    (y * torch.arange(50.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(50.0))


def test_flat_quantisation_uses_one_range_per_layer_and_keeps_biases():
    model = make_model("mlp", (64,), 10, hidden=(16,))
    spec, theta = param_spec(model), flatten_params(model)
    q = quantize_flat(theta, spec, 3)
    for (name, _), s in zip(spec, layer_slices(spec)):
        assert torch.equal(q[s], theta[s] if name.endswith("bias") else quantize(theta[s], 3))
    assert torch.equal(layer_ranges(q, spec), layer_ranges(theta, spec))
    theta = theta.clone().requires_grad_()
    fq = fake_quantize_flat(theta, spec, 3)
    assert torch.allclose(fq.detach(), q, atol=1e-6)
    fq.sum().backward()
    assert torch.equal(theta.grad, torch.ones_like(theta))


def test_wire_format_round_trips_and_bytes_match():
    w = torch.randn(1001)
    for bits in (2, 4, 8, 12):
        blob = encode(w, bits)
        assert len(blob) == payload_bytes(1001, bits) == 4 + math.ceil(1001 * bits / 8)
        assert torch.allclose(decode(blob, 1001, bits), quantize(w, bits))
    model = make_model("mlp", (64,), 10, hidden=(16,))
    spec = param_spec(model)
    assert model_bytes(spec, 32) == 4 * flatten_params(model).numel()
    assert model_bytes(spec, 4) == sum(4 * math.prod(s) if n.endswith("bias") else 4 + math.ceil(math.prod(s) * 4 / 8)
                                       for n, s in spec)


def test_levels_round_trip_and_match_qsgd_level_width():
    w = torch.randn(300)
    ell, R = quantize_levels(w, 4)
    assert ell.min() >= 0 and ell.max() <= 14 and torch.equal(ell, ell.round())
    assert torch.allclose(dequantize(ell, 4, R), quantize(w, 4))
    assert QSGD(s=15).bits == 4  # the same fixed-width packing of 16 levels as QSGD with s = 15


@pytest.mark.parametrize("bad", [0, 1, 17, 31, 2.0, True, "4"])
def test_bad_bits_are_rejected(bad):
    with pytest.raises(ValueError, match="bits must be"):
        check_bits(bad)


def test_other_argument_errors():
    with pytest.raises(ValueError, match="generator"):
        quantize(torch.randn(4), 2, stochastic=True)
    with pytest.raises(ValueError, match="R"):
        quantize(torch.randn(4), 2, R=-1.0)
    with pytest.raises(ValueError, match="full precision"):
        step(32, 1.0)
    with pytest.raises(ValueError, match="flat vector"):
        quantize_flat(torch.randn(7), [("w", torch.Size([2, 2]))], 2)
