"""FedPara / pFedPara (fedlab_nb/methods/communication/fedpara.py): the maximal-rank property, parameter counts, the layer's
forward, pFedPara's split into sent and kept factors, and errors on bad ranks."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import fedlab_nb as fl

fp = importlib.import_module("fedlab_nb.methods.communication.fedpara")


def _rank(w: torch.Tensor) -> int:
    return int(torch.linalg.matrix_rank(w.double()))


@pytest.mark.parametrize("m,n,r1,r2", [(40, 30, 3, 4), (64, 50, 5, 5), (30, 30, 2, 7)])
def test_hadamard_rank_is_product_of_ranks(m, n, r1, r2):
    g = torch.Generator().manual_seed(0)
    x1, y1 = torch.randn(m, r1, generator=g, dtype=torch.float64), torch.randn(n, r1, generator=g, dtype=torch.float64)
    x2, y2 = torch.randn(m, r2, generator=g, dtype=torch.float64), torch.randn(n, r2, generator=g, dtype=torch.float64)
    assert r1 * r2 <= min(m, n)
    assert _rank((x1 @ y1.T) * (x2 @ y2.T)) == r1 * r2
    # the same parameter count as a plain low-rank layer: rank r1 + r2, no more
    x, y = torch.cat([x1, x2], 1), torch.cat([y1, y2], 1)
    assert _rank(x @ y.T) == r1 + r2 < r1 * r2


def test_fedpara_layer_full_rank_at_r_min_and_lowrank_bounded():
    m, n = 48, 100
    r = fp.min_full_rank(m, n)
    assert r == 7 and (r - 1) ** 2 < min(m, n) <= r ** 2
    layer = fp.FedParaLinear(n, m, r, generator=torch.Generator().manual_seed(1)).double()
    assert _rank(layer.weight().detach()) == min(m, n)
    low = fp.LowRankLinear(n, m, 2 * r, generator=torch.Generator().manual_seed(1)).double()
    assert _rank(low.weight().detach()) == 2 * r
    assert fp.count_params(layer) == fp.count_params(low) == fp.fedpara_params(m, n, r) == fp.lowrank_params(m, n, 2 * r)


def test_param_count_formulas_match_models():
    for kind in ("fedpara", "pfedpara", "lowrank"):
        model = fp.fedpara_mlp(64, 10, hidden=(32, 16), kind=kind)
        shapes = [(32, 64), (16, 32)] + ([(10, 16)] if kind == "pfedpara" else [])
        count = fp.lowrank_params if kind == "lowrank" else fp.fedpara_params
        expected = sum(count(m, n, r) for (m, n), r in zip(shapes, model.ranks))
        expected += 0 if kind == "pfedpara" else 16 * 10 + 10
        assert fp.count_params(model) == expected
    assert fp.count_params(fp.fedpara_mlp(64, 10, hidden=(32, 16), kind="dense")) == 64 * 32 + 32 + 32 * 16 + 16 + 170


def test_forward_is_linear_with_composed_weight():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 20, generator=g)
    for personal in (False, True):
        layer = fp.FedParaLinear(20, 8, 3, personal=personal, generator=g)
        with torch.no_grad():
            layer.bias.normal_(generator=g)
        w1, w2 = layer.x1 @ layer.y1.T, layer.x2 @ layer.y2.T
        w = w1 * (w2 + 1) if personal else w1 * w2
        torch.testing.assert_close(layer(x), x @ w.T + layer.bias)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight(), layer.bias))


def test_he_variance_at_init():
    layer = fp.FedParaLinear(400, 300, 20, generator=torch.Generator().manual_seed(3))
    assert abs(float(layer.weight().detach().var()) / (2 / 400) - 1) < 0.1


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "pathological", n_clients=6, classes_per_client=2, seed=0)


def test_bytes_are_the_factors_and_pfedpara_keeps_local(fed):
    kw = dict(rounds=2, clients_per_round=None, lr=0.05, seed=0, progress=False)
    dense = fl.simulate(fl.get_method("fedavg"), fed, fp.fedpara_mlp(fed, hidden=(32,), kind="dense"), **kw)
    para_model = fp.fedpara_mlp(fed, hidden=(32,), kind="fedpara")
    para = fl.simulate(fl.get_method("fedpara"), fed, para_model, **kw)
    per_byte = dense.bytes_up.iloc[0] / fp.count_params(dense.model) / fed.num_clients
    assert para.bytes_up.iloc[0] == per_byte * fp.count_params(para_model) * fed.num_clients
    pmodel = fp.fedpara_mlp(fed, hidden=(32,), kind="pfedpara")
    local = sum(p.numel() for n, p in pmodel.named_parameters() if n.endswith(("x2", "y2")))
    pf = fl.simulate(fl.get_method("pfedpara"), fed, pmodel, **kw)
    assert pf.bytes_up.iloc[0] == per_byte * (fp.count_params(pmodel) - local) * fed.num_clients
    assert "personal_acc_mean" in pf.columns
    # the local factors live in the store, one row per client; the global θ keeps its initial X₂, Y₂
    local_rows = pf.store.all("cpu")["local"]
    assert local_rows.shape == (fed.num_clients, local)
    assert not torch.allclose(local_rows[0], local_rows[1])
    theta0 = torch.cat([p.detach().reshape(-1) for p in pmodel.parameters()])
    is_local = torch.cat([torch.full((p.numel(),), n.endswith(("x2", "y2"))) for n, p in pmodel.named_parameters()])
    torch.testing.assert_close(pf.theta[is_local], theta0[is_local])
    assert not torch.allclose(pf.theta[~is_local], theta0[~is_local])


def test_pfedpara_needs_pfedpara_layers(fed):
    with pytest.raises(ValueError, match="matches no parameter"):
        fl.simulate(fl.get_method("pfedpara"), fed, "mlp", rounds=1, progress=False)


def test_bad_ranks_and_ratios():
    with pytest.raises(ValueError, match="rank must be an int"):
        fp.FedParaLinear(10, 8, 9)
    with pytest.raises(ValueError, match="rank must be an int"):
        fp.LowRankLinear(10, 8, 0)
    with pytest.raises(ValueError, match="ratio"):
        fp.rank_for_ratio(10, 8, 1.5)
    with pytest.raises(ValueError, match="one rank per"):
        fp.fedpara_mlp(64, 10, hidden=(32,), ranks=[4, 4])
    with pytest.raises(ValueError, match="kind must be"):
        fp.fedpara_mlp(64, 10, kind="lora")
    assert fp.rank_for_ratio(256, 784) == 16 and fp.rank_for_ratio(256, 784, 0.5) == 49


def test_factories_build_with_defaults():
    assert fl.get_method("fedpara").name == "fedpara"
    assert fl.get_method("pfedpara").groups.local == fp.LOCAL_FACTORS
