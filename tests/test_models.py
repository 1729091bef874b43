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


# --- MaxPool2x2: the CNNs' pool, faster on CPU, results equal to nn.MaxPool2d(2) bit for bit -------------
def _pool_inputs():
    """Random, tied (values on a 0.5 grid: many windows hold two equal maxima), NaN and odd-sized inputs."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(6, 5, 12, 12, generator=g)
    tied = (rand * 2).round() / 2
    nan = rand.clone()
    nan[0, 0, 3, 4] = float("nan")
    odd = torch.randn(3, 4, 7, 9, generator=g, dtype=torch.float64)
    return {"random": rand, "tied": tied, "nan": nan, "odd_float64": odd}


@pytest.mark.parametrize("name", ["random", "tied", "nan", "odd_float64"])
def test_maxpool2x2_equals_torch_forward_and_backward(name):
    from fedlab_nb.models import MaxPool2x2
    x = _pool_inputs()[name]
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = torch.nn.MaxPool2d(2)(a), MaxPool2x2()(b)
    grad = torch.randn(ya.shape, dtype=ya.dtype, generator=torch.Generator().manual_seed(1))
    ya.backward(grad)
    yb.backward(grad)
    assert yb.is_contiguous()
    assert torch.equal(ya.nan_to_num(7.0), yb.nan_to_num(7.0)) and torch.equal(a.grad, b.grad)


def test_maxpool2x2_ties_decide_the_gradient():
    """The tied input really tests the argmax: a pool that sends a tie's gradient to the last maximum differs."""
    x = _pool_inputs()["tied"].requires_grad_()
    torch.nn.MaxPool2d(2)(x).sum().backward()
    flipped = x.detach().flip(-1).requires_grad_()
    torch.nn.MaxPool2d(2)(flipped).sum().backward()
    assert not torch.equal(x.grad, flipped.grad.flip(-1))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func jvp, inside torch
def test_maxpool2x2_under_vmap_grad_jvp_and_double_backward():
    """What the engine's torch.func paths do with a CNN: vmap over clients of a gradient, Per-FedAvg's
    forward-over-reverse HVP, and a second derivative by autograd: all equal to nn.MaxPool2d's."""
    from torch.func import grad, jvp, vmap
    from fedlab_nb.models import MaxPool2x2
    g = torch.Generator().manual_seed(2)
    xs = (torch.randn(4, 3, 2, 8, 8, generator=g) * 2).round() / 2      # 4 clients × 3 rows, ties included
    w = torch.randn(4, 2, 4, 4, generator=g)
    v = torch.randn(4, 2, 4, 4, generator=g)

    def loss(pool):
        return lambda w, x: (pool(torch.tanh(x) * w.repeat_interleave(2, -1).repeat_interleave(2, -2)) ** 2).sum()

    ref, ours = loss(torch.nn.MaxPool2d(2)), loss(MaxPool2x2())
    assert torch.equal(vmap(grad(ref))(w, xs), vmap(grad(ours))(w, xs))
    assert torch.equal(vmap(grad(ref, argnums=1))(w, xs), vmap(grad(ours, argnums=1))(w, xs))
    hvp = lambda f: vmap(lambda w, x, v: jvp(lambda w_: grad(f)(w_, x), (w,), (v,))[1])(w, xs, v)
    assert torch.equal(hvp(ref), hvp(ours))
    second = []
    for f in (ref, ours):
        w0 = w[0].clone().requires_grad_()
        (gw,) = torch.autograd.grad(f(w0, xs[0]), w0, create_graph=True)
        second.append(torch.autograd.grad((gw * v[0]).sum(), w0)[0])
    assert torch.equal(*second)


def test_cnn_uses_maxpool2x2_with_unchanged_parameter_names():
    from fedlab_nb.models import CNN, CNNBN, MaxPool2x2
    for model in (CNN((1, 28, 28), 10), CNNBN((1, 28, 28), 10)):
        assert sum(isinstance(m, MaxPool2x2) for m in model.modules()) == 2
    assert list(CNN((1, 28, 28), 10).state_dict()) == ["features.0.weight", "features.0.bias", "features.3.weight",
                                                       "features.3.bias", "head.1.weight", "head.1.bias",
                                                       "head.3.weight", "head.3.bias"]
