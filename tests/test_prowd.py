"""fedlab_nb.methods.labels.prowd: QAT clients at mixed bit-widths, the naive / grouped / ProWD-lite aggregators."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.method import Method
from fedlab_nb.methods.labels.prowd import (apply_dequantiser, bit_widths, deployed_accuracy, fit_dequantiser, group_sampler,
                                     prowd)
from fedlab_nb.models import flatten_params, make_model, param_spec
from fedlab_nb.methods.labels.quantize import model_bytes, quantize_flat


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "dirichlet", n_clients=8, alpha=0.5, seed=0)


def _model(fed, seed=0):
    torch.manual_seed(seed)
    return make_model("mlp", fed.input_shape, fed.num_classes, hidden=(16,))


def _run(method, fed, model, **kw):
    return fl.simulate(method, fed, model, rounds=2, local_epochs=1, lr=0.05, seed=3, progress=False, **kw)


def test_bit_widths_are_contiguous_equal_groups():
    assert bit_widths(12).tolist() == [2] * 3 + [4] * 3 + [8] * 3 + [32] * 3
    with pytest.raises(ValueError, match="n_clients"):
        bit_widths(3)


def test_all_32_bit_clients_are_fedavg(fed):
    model = _model(fed)
    theta0 = flatten_params(model)
    h = _run(prowd(model, [32] * 8, "naive"), fed, model)
    model2 = _model(fed)
    assert torch.equal(flatten_params(model2), theta0)
    h2 = _run(Method("fedavg"), fed, model2)
    assert torch.allclose(h.theta, h2.theta, atol=1e-5)


def test_bytes_are_the_quantised_wire_size(fed):
    model = _model(fed)
    bits = bit_widths(8)
    h = _run(prowd(model, bits, "naive"), fed, model)
    spec = param_spec(model)
    assert int(h["bytes_up"].iloc[0]) == sum(model_bytes(spec, int(b)) + 1 for b in bits)


def test_stochastic_uploads_are_keyed_and_bits_must_match_clients(fed):
    bits = bit_widths(8)
    a = _run(prowd(_model(fed), bits, "naive", stochastic=True), fed, _model(fed))
    b = _run(prowd(_model(fed), bits, "naive", stochastic=True), fed, _model(fed))
    assert torch.equal(a.theta, b.theta)
    with pytest.raises(ValueError, match="bits has 4 entries"):
        _run(prowd(_model(fed), [2, 4, 8, 32], "naive"), fed, _model(fed))


def test_prowd_lite_without_low_bit_clients_is_naive(fed):
    bits = [32] * 8
    a = _run(prowd(_model(fed), bits, "prowd_lite"), fed, _model(fed))
    b = _run(prowd(_model(fed), bits, "naive"), fed, _model(fed))
    assert torch.equal(a.theta, b.theta)


def test_grouped_32_bit_model_is_fp32_only_and_sampler_checks(fed):
    bits = bit_widths(8)
    ids = group_sampler(bits, 32)(0, 8, None)
    assert ids.tolist() == [6, 7]
    with pytest.raises(ValueError, match="bit-width 16"):
        group_sampler(bits, 16)


def test_dequantiser_is_the_bin_centroid_and_reduces_error():
    g = torch.Generator().manual_seed(0)
    spec = [("w", torch.Size([4000])), ("b", torch.Size([50]))]
    w = torch.randn(3, 4050, generator=g)
    table = fit_dequantiser(w, spec, 2)
    assert table.shape == (2, 3)   # 2 bits: the codes of {−R, 0, R}
    q = quantize_flat(w[0], spec, 2)
    d = apply_dequantiser(q, spec, 2, table)
    ref = torch.cat([quantize_flat(v, spec, 2) for v in w[:1]])
    assert ((d - w[0]) ** 2).mean() < ((ref - w[0]) ** 2).mean()
    # fitted on one model, the centroid of a level is the mean of w / R over that level's entries
    t1 = fit_dequantiser(w[:1], spec, 2)
    s = slice(0, 4000)
    R = w[0, s].abs().max()
    top = (q[s] == R)
    assert torch.allclose(t1[0, 2], (w[0, s][top] / R).mean())
    # a bias tensor is sent at full precision: quantize_flat and the dequantiser leave it alone
    bspec = [("fc.weight", torch.Size([4000])), ("fc.bias", torch.Size([50]))]
    qb = quantize_flat(w[0], bspec, 2)
    assert torch.equal(qb[4000:], w[0, 4000:])
    assert torch.equal(apply_dequantiser(qb, bspec, 2, fit_dequantiser(w, bspec, 2))[4000:], w[0, 4000:])
    with pytest.raises(ValueError, match="32-bit"):
        fit_dequantiser(w, spec, 32)


def test_deployed_accuracy_and_factory_errors(fed):
    model = _model(fed)
    acc = deployed_accuracy(model, flatten_params(model), fed.x_test, fed.dataset.y_test)
    assert set(acc) == {2, 4, 8, 32} and all(0 <= v <= 1 for v in acc.values())
    with pytest.raises(ValueError, match="aggregator"):
        prowd(model, bit_widths(8), "grouped")
    with pytest.raises(ValueError, match="bits must be"):
        prowd(model, [3, 33], "naive")
    assert np.isclose(sum(acc.values()) / 4, np.mean(list(acc.values())))
