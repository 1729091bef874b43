"""FedLoGe: the simplex ETF identity, the static sparse classifier, the three separated gradients of one local
step, GA-FR and LA-FR against direct computations, and clear errors."""
import importlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb.models import flatten_params, param_spec, representation, unflatten

fedloge = importlib.import_module("fedlab_nb.methods.personalisation.fedloge")


@pytest.mark.parametrize("h,C", [(10, 10), (32, 10), (64, 3)])
def test_simplex_etf_identity(h, C):
    M = fedloge.simplex_etf(h, C, torch.Generator().manual_seed(0))
    target = C / (C - 1) * (torch.eye(C, dtype=M.dtype) - 1.0 / C)
    assert (M.T @ M - target).abs().max() < 1e-12          # equal unit norms, pairwise cosine −1/(C−1)
    assert torch.allclose(M.sum(1), torch.zeros(h, dtype=M.dtype), atol=1e-12)   # columns centred


def test_etf_needs_enough_features():
    with pytest.raises(ValueError, match="widen the model"):
        fedloge.simplex_etf(5, 10)


def test_sse_c_is_static_sparse_and_seeded():
    a = fedloge.sse_classifier(3, 16, 10, sparsity=0.6, steps=200)
    b = fedloge.sse_classifier(3, 16, 10, sparsity=0.6, steps=200)
    assert torch.equal(a, b) and not torch.equal(a, fedloge.sse_classifier(4, 16, 10, 0.6, 200))
    assert (a == 0).sum() >= int(0.6 * 16 * 10)
    g = torch.Generator().manual_seed(0)
    etf = fedloge.simplex_etf(16, 10, g).float()
    fitted = fedloge.fit_sparse_etf(etf, 0.6, g, steps=300, lr=1e-3)   # a faster schedule than the official
    assert (fitted == 0).sum() >= 96                       # the zeroed entries stay zero
    g = torch.Generator().manual_seed(0)
    fedloge.simplex_etf(16, 10, g)
    start = fedloge.fit_sparse_etf(etf, 0.6, g, steps=0)   # the same mask, not re-fitted
    assert (start != 0).sum() == (fitted != 0).sum() == 64
    assert ((fitted.norm(dim=0) - 0.1).abs() < 0.5 * (start.norm(dim=0) - 0.1).abs()).all()   # pulled toward 0.1
    cos = lambda E: ((E / E.norm(dim=0)).T @ (E / E.norm(dim=0)) - 2 * torch.eye(10)).max()
    assert cos(fitted) < cos(start)                        # the largest pairwise cosine falls: wider angles
    dense = fedloge.sse_classifier(0, 16, 10, sparsity=0.0)
    assert torch.equal(dense, fedloge.simplex_etf(16, 10, torch.Generator().manual_seed(
        int(fl.utils.rng(0, fedloge.SSE_C, 0).integers(2**62)))).float())


def _fed():
    return fl.federate("digits", "iid", n_clients=2, seed=0)


def test_one_local_step_separates_the_three_gradients():
    fed, lr = _fed(), 0.1
    h = fl.simulate(fl.get_method("fedloge", sparsity=0.0), fed, model="mlp", model_kwargs={"hidden": (16,)},
                    rounds=1, clients_per_round=None, local_steps=1, batch_size=10_000, lr=lr, seed=0, progress=False)
    model = h.model
    spec = param_spec(model)
    torch.manual_seed(0)
    theta0 = flatten_params(fl.engine.server.build_model("mlp", fed, 0, {"hidden": (16,)}))
    E = fedloge.sse_classifier(0, 16, 10, sparsity=0.0)
    sl, _, _ = fedloge.head_slice(spec)
    new, heads = [], []
    for x, y in fed.client_train:
        w = theta0.clone().requires_grad_(True)
        p = unflatten(w, spec)
        z = representation(model, p, x).flatten(1)
        backbone = F.cross_entropy(z @ E, y)
        aux = F.cross_entropy(F.linear(z.detach(), p["body.2.weight"], p["body.2.bias"]), y)
        g, = torch.autograd.grad(backbone + aux, w)
        new.append(theta0 - lr * g)
        l0 = theta0[sl].clone().requires_grad_(True)
        C, hh = 10, 16
        local = F.cross_entropy(F.linear(z.detach(), l0[:C * hh].view(C, hh), l0[C * hh:]), y)
        heads.append(theta0[sl] - lr * torch.autograd.grad(local, l0)[0])
    n = torch.tensor(fed.sizes, dtype=torch.float32)
    expected = (n[:, None] * torch.stack(new)).sum(0) / n.sum()
    assert torch.allclose(h.theta, expected, atol=1e-6)
    assert torch.allclose(h.store.all("cpu")["lhead"], torch.stack(heads), atol=1e-6)
    assert h.theta.numel() == sum(int(np.prod(s)) for _, s in spec)   # the SSE-C is not a parameter


def test_ga_fr_equal_row_norms_bias_kept():
    spec = [("body.0.weight", (4, 3)), ("body.0.bias", (4,)), ("body.2.weight", (5, 4)), ("body.2.bias", (5,))]
    theta = torch.randn(12 + 4 + 20 + 5, generator=torch.Generator().manual_seed(1))
    out = fedloge.realign_global(theta, spec)
    W = out[16:36].view(5, 4)
    assert torch.allclose(W.norm(dim=1), torch.full((5,), 1.7))
    W0 = theta[16:36].view(5, 4)
    assert torch.allclose(W / W.norm(dim=1, keepdim=True), W0 / W0.norm(dim=1, keepdim=True))
    assert torch.equal(out[:16], theta[:16]) and torch.equal(out[36:], theta[36:])


def test_la_fr_norm_transfer_and_mask():
    C, h, K = 4, 3, 2
    g = torch.Generator().manual_seed(2)
    gh, lh = torch.randn(C * h + C, generator=g), torch.randn(K, C * h + C, generator=g)
    counts = torch.tensor([[5.0, 0, 2, 1], [0.0, 0, 0, 0]])
    out = fedloge.personal_heads(gh, lh, counts, C, h)
    z = torch.randn(7, h, generator=g)
    for k in range(K):
        Wl, bl = lh[k, :C * h].view(C, h), lh[k, C * h:]
        Wg, bg = gh[:C * h].view(C, h), gh[C * h:]
        Wt = Wg * Wl.norm(dim=1, keepdim=True)          # ĝ_k: W_g rows scaled by the local head's row norms
        logits = F.linear(z, Wl, bl) + F.linear(z, Wt, bg)
        got = F.linear(z, out[k, :C * h].view(C, h), out[k, C * h:])
        if k == 0:
            assert torch.allclose(got[:, [0, 2, 3]], logits[:, [0, 2, 3]], atol=1e-5)
            assert (got.argmax(1) != 1).all()               # the class never seen in training is masked
        else:
            assert torch.allclose(got, logits, atol=1e-5)   # nothing seen yet: no mask


def test_personal_models_are_scored():
    h = fl.simulate(fl.get_method("fedloge", etf_steps=50), _fed(), model="mlp", model_kwargs={"hidden": (16,)},
                    rounds=2, batch_size=32, lr=0.1, seed=0, progress=False)
    assert 0 <= h.final("personal_acc_mean") <= 1


@pytest.mark.parametrize("kw,match", [({"sparsity": 1.0}, "sparsity"), ({"sparsity": -0.1}, "sparsity"),
                                      ({"etf_steps": 1.5}, "etf_steps")])
def test_bad_knobs(kw, match):
    with pytest.raises(ValueError, match=match):
        fl.get_method("fedloge", **kw)
