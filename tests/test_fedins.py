"""FedIns (fedlab_nb.methods.labels.fedins): SSF at gamma = 1, beta = 0 is the backbone, identical entries are one SSF,
P = 1 trains as federated SSF, the top-k selection and key loss, upload bytes, the domain mix, and clear errors."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

import fedlab_nb as fl
from fedlab_nb.core.registry import lookup
from fedlab_nb.data.federated import FederatedDataset
from fedlab_nb.methods.labels.fedins import (KeyMatchingObjective, SSFPoolMLP, all_domains, domain_pairs, effective_entries,
                                      federated_ssf, fedins, head_only, mixed_domain_clients, routing, select_entries,
                                      sent_floats, usage)
from fedlab_nb.models import flatten_params, make_model, param_spec, unflatten

torch.set_num_threads(1)
KW = dict(rounds=2, local_epochs=1, batch_size=32, lr=0.1, seed=0, progress=False)


@pytest.fixture(scope="module")
def backbone():
    torch.manual_seed(0)
    return make_model("mlp", (1, 8, 8), 10, hidden=(16, 8))


@pytest.fixture(scope="module")
def fed():
    ds = fl.load_dataset("digits")
    clients, _ = mixed_domain_clients(ds.x_train[:400], ds.y_train[:400], ds.input_shape, 4, seed=0)
    return FederatedDataset.from_clients(clients, test=(ds.x_test, ds.y_test), num_classes=10)


def test_identity_ssf_reproduces_the_backbone(backbone):
    x = torch.rand(50, 64)
    model = SSFPoolMLP(backbone, pool_size=4, top_k=2, init_std=0.0)
    with torch.no_grad():
        assert torch.allclose(model(x), backbone(x), atol=1e-6)
        assert torch.allclose(model.backbone_logits(x), backbone(x), atol=1e-6)


def test_identical_entries_are_one_ssf(backbone):
    x = torch.rand(50, 64)
    one = SSFPoolMLP(backbone, pool_size=1, top_k=1, init_std=0.3, seed=1)
    pool = SSFPoolMLP(backbone, pool_size=6, top_k=3, init_std=0.3, seed=2)
    p1 = dict(one.named_parameters())
    with torch.no_grad():
        for name, p in pool.named_parameters():
            if name != "keys":  # the keys stay different: the selection must not matter
                p.copy_(p1[name].expand_as(p))
        assert torch.allclose(pool(x), one(x), atol=1e-5)


def test_selection_is_the_top_k_cosine_average():
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(20, 5, generator=g), torch.randn(7, 5, generator=g)
    weights, cos = select_entries(q, keys, 3)
    assert torch.allclose(cos, F.cosine_similarity(q[:, None], keys[None], dim=-1), atol=1e-6)
    assert torch.allclose(weights.sum(1), torch.ones(20))
    assert ((weights > 0).sum(1) == 3).all()
    top = cos.topk(3, dim=1).indices
    assert torch.equal(weights.gather(1, top), torch.full((20, 3), 1 / 3))
    w2, _ = select_entries(3.0 * q, 0.5 * keys, 3)  # cosine: scale-free
    assert torch.equal(weights, w2)


def test_key_loss_value_and_gradient_reach_only_the_keys(backbone):
    x = torch.rand(30, 64)
    model = SSFPoolMLP(backbone, pool_size=5, top_k=2)
    params = {n: p.detach() for n, p in model.named_parameters()}
    weights, cos = select_entries(model.query(x), params["keys"], 2)
    expected = 1 - (cos * (weights > 0)).sum(1)
    assert torch.allclose(model.matching_loss(x, params["keys"]), expected, atol=1e-6)
    g = grad(lambda p: KeyMatchingObjective(0.5).extra_loss(model, p, x, None, None, None).mean())(params)
    assert g["keys"].abs().sum() > 0
    assert all(float(g[n].abs().sum()) == 0 for n in g if n != "keys")
    used = weights.sum(0) > 0
    assert (g["keys"][~used] == 0).all()  # an unselected key gets no pull


def test_pool_of_one_trains_as_federated_ssf(backbone, fed):
    a = SSFPoolMLP(backbone, pool_size=1, top_k=1, seed=3)
    b = SSFPoolMLP(backbone, pool_size=1, top_k=1, seed=3)
    ha = fl.simulate(fedins(), fed, a, **KW)
    hb = fl.simulate(federated_ssf(), fed, b, **KW)
    spec = param_spec(a)
    ta, tb = unflatten(ha.theta, spec), unflatten(hb.theta, spec)
    assert all(torch.allclose(ta[n], tb[n], atol=1e-6) for n in ta if n != "keys")
    assert not torch.equal(ta["keys"], tb["keys"])  # the key loss did move FedIns's key
    assert ha.test_acc.tolist() == pytest.approx(hb.test_acc.tolist(), abs=1e-9)


def test_vmap_and_loop_agree(backbone, fed):
    runs = [fl.simulate(fedins(), fed, SSFPoolMLP(backbone, 4, 2, seed=0), backend=b, **KW) for b in ("vmap", "loop")]
    assert torch.allclose(runs[0].theta, runs[1].theta, atol=1e-5)


def test_upload_bytes_are_the_pools_heads_and_keys(backbone, fed):
    model = SSFPoolMLP(backbone, pool_size=4, top_k=2)
    floats = 4 * (2 * (16 + 8) + 10 * 8 + 10 + 8)
    assert sent_floats(model, fedins()) == floats == flatten_params(model).numel()
    assert sent_floats(model, federated_ssf()) == floats - 4 * 8
    assert sent_floats(model, head_only()) == 4 * (10 * 8 + 10)
    h = fl.simulate(fedins(), fed, model, **{**KW, "rounds": 1})
    assert int(h.bytes_up.iloc[0]) == fed.num_clients * 4 * floats


def test_head_only_keeps_the_identity_ssf(backbone, fed):
    model = SSFPoolMLP(backbone, pool_size=1, top_k=1, init_std=0.0)
    h = fl.simulate(head_only(), fed, model, **KW)
    t = unflatten(h.theta, param_spec(model))
    assert torch.equal(t["ssf_scale0"], torch.ones_like(t["ssf_scale0"]))
    assert torch.equal(t["ssf_shift1"], torch.zeros_like(t["ssf_shift1"]))
    assert not torch.equal(t["head_weight"], dict(model.named_parameters())["head_weight"].detach())


def test_routing_usage_and_effective_entries(backbone):
    model = SSFPoolMLP(backbone, pool_size=5, top_k=2, init_std=0.5)
    sel = routing(model, flatten_params(model), torch.rand(40, 64))
    assert sel.shape == (40, 2) and (sel[:, 0] != sel[:, 1]).all()
    shares = usage(sel, 5)
    assert shares.sum() == pytest.approx(1.0)
    assert effective_entries(np.full(4, 0.25)) == pytest.approx(4.0)
    assert effective_entries(np.array([1.0, 0, 0])) == pytest.approx(1.0)


def test_mixed_domain_clients():
    ds = fl.load_dataset("digits")
    clients, pairs = mixed_domain_clients(ds.x_train[:120], ds.y_train[:120], ds.input_shape, 6, seed=0)
    assert [tuple(p) for p in pairs] == domain_pairs(6) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert sum(len(y) for _, y in clients) == 120
    x_inv = clients[1][0][1::2]          # client 1: (original, inverted); odd rows inverted
    assert (x_inv >= 0).all() and (x_inv <= 1).all()
    x, y, d = all_domains(ds.x_test[:10], ds.y_test[:10], ds.input_shape, seed=0)
    assert x.shape == (40, 64) and torch.equal(y[:10], y[20:30]) and list(np.bincount(d)) == [10] * 4
    assert torch.allclose(x[20:30], 1 - ds.x_test[:10])


def test_registered():
    entry = lookup("fedins")
    assert entry.claims == "fedins" and entry.notebook == "fedins" and entry.kind == "method"


def test_bad_arguments_are_named(backbone):
    with pytest.raises(ValueError, match="pool_size"):
        SSFPoolMLP(backbone, pool_size=0)
    with pytest.raises(ValueError, match="top_k"):
        SSFPoolMLP(backbone, pool_size=2, top_k=3)
    with pytest.raises(ValueError, match="backbone"):
        SSFPoolMLP(make_model("logreg", (64,), 10))
    with pytest.raises(ValueError, match="init_std"):
        SSFPoolMLP(backbone, init_std=-1.0)
    with pytest.raises(ValueError, match="key_weight"):
        fedins(key_weight=-0.1)
    with pytest.raises(ValueError, match="SSFPoolMLP"):
        KeyMatchingObjective().extra_loss(backbone, {}, torch.rand(2, 64), None, None, None)
    from fedlab_nb.methods.labels.fedins import apply_domain
    with pytest.raises(ValueError, match="domain"):
        apply_domain(torch.rand(2, 64), 7, (1, 8, 8), torch.Generator())
