import pytest
import torch

from fedlab_nb.models import CNN, MLP, flatten_params, load_flat, make_model, num_params, param_spec, unflatten


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_cnn_shapes(shape):
    m = CNN(shape, 10)
    x = torch.randn(4, torch.tensor(shape).prod().item())
    assert m(x).shape == (4, 10)


def test_flat_roundtrip():
    m = MLP(64, 10, hidden=(32, 16))
    flat = flatten_params(m)
    assert flat.shape == (num_params(m),)
    parts = unflatten(flat, param_spec(m))
    assert all(torch.equal(parts[n], p) for n, p in m.named_parameters())
    m2 = load_flat(MLP(64, 10, hidden=(32, 16)), flat)
    assert torch.equal(flatten_params(m2), flat)


def test_unflatten_wrong_size():
    m = MLP(4, 2, hidden=(3,))
    with pytest.raises(ValueError, match="parameters"):
        unflatten(torch.zeros(5), param_spec(m))


def test_make_model_errors():
    with pytest.raises(ValueError, match="CNN needs an image"):
        make_model("cnn", (30,), 2)
    assert isinstance(make_model("mlp", (1, 8, 8), 10), MLP)
