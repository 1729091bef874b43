"""DCA / DCWA (fedlab_nb.methods.beyond.dca): layouts and parameter counts, the M = 1 identity in float64, combinations,
plain training = merging.fit, the consistency KL against torch."""
import pytest
import torch

from fedlab_nb import merging
from fedlab_nb.methods.beyond import dca as D
from fedlab_nb.models import flatten_params, make_model


def _mlp(hidden=(6, 5), d=4, c=3):
    torch.manual_seed(0)
    return make_model("mlp", (d,), c, hidden=hidden).double()


def test_parameter_counts_match_a_deep_ensemble():
    model = _mlp()
    d = 4 * 6 + 6 + 6 * 5 + 5 + 5 * 3 + 3
    assert D.parameter_counts(model, 4) == {"base": d, "dca": 4 * d, "ensemble": 4 * d, "components": 3, "proposals": 64}
    assert D.parameter_counts(model, 4, [[0], [1, 2]])["proposals"] == 16
    assert [s.stop - s.start for s in D.layer_slices(model)] == [30, 35, 18]


def test_components_must_partition_the_layers():
    with pytest.raises(ValueError, match="partition"):
        D.component_slices(_mlp(), [[0], [1]])


def test_m1_dcwa_logits_are_the_mean_of_the_copies_logits():
    model = make_model("logreg", (9,), 4).double()
    g = torch.Generator().manual_seed(0)
    copies = torch.randn(5, 9 * 4 + 4, generator=g, dtype=torch.float64)
    x = torch.randn(20, 9, generator=g, dtype=torch.float64)
    mean_logits = torch.stack([merging.logits(model, c, x) for c in copies]).mean(0)
    assert (merging.logits(model, D.dcwa(copies), x) - mean_logits).abs().max() < 1e-12


def test_combine_takes_each_layer_from_its_copy():
    model = _mlp()
    d = sum(p.numel() for p in model.parameters())
    copies = torch.arange(3, dtype=torch.float64)[:, None].repeat(1, d)  # copy k is the constant k
    comps = D.component_slices(model)
    theta = D.combine(copies, comps, [2, 0, 1])
    layers = D.layer_slices(model)
    assert [float(theta[s].unique()) for s in layers] == [2.0, 0.0, 1.0]
    coarse = D.component_slices(model, [[0], [1, 2]])
    assert [float(D.combine(copies, coarse, [1, 2])[s].unique()) for s in layers] == [1.0, 2.0, 2.0]
    assert len(D.proposals(copies, comps)) == 27
    assert len(D.proposals(copies, comps, max_proposals=10, generator=torch.Generator().manual_seed(0))) == 10


def test_one_copy_is_plain_training_with_merging_fit():
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (40,), generator=g)
    ref = merging.fit(model, None, x, y, epochs=3, lr=1e-2, batch_size=8, optimizer="adam", seed=5)
    w, snaps = D.train_dca(model, x, y, copies=1, epochs=3, lr=1e-2, batch_size=8, seed=5, snapshot_epochs=[2, 3])
    assert w.shape == (1, ref.numel()) and (w[0] - ref).abs().max() < 1e-12
    assert len(snaps) == 2 and torch.equal(snaps[1], w[0]) and torch.equal(D.swa(snaps), (snaps[0] + snaps[1]) / 2)


def test_copies_start_equal_and_only_chosen_copies_learn():
    model = _mlp()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)
    w0, _ = D.train_dca(model, x, y, copies=3, epochs=0)
    assert torch.equal(w0, flatten_params(model).repeat(3, 1))
    w, _ = D.train_dca(model, x, y, copies=3, epochs=2, lr=1e-2, batch_size=4, repeats=2, consistency=True, seed=0)
    assert not torch.equal(w[0], w[1])  # different combinations drove the copies apart


def test_consistency_kl_matches_torch():
    g = torch.Generator().manual_seed(3)
    p, q = torch.randn(10, 5, generator=g, dtype=torch.float64), torch.randn(10, 5, generator=g, dtype=torch.float64)
    ref = torch.nn.functional.kl_div(torch.log_softmax(q, -1), torch.log_softmax(p, -1), log_target=True,
                                     reduction="batchmean")
    assert abs(float(D.consistency_kl(p, q) - ref)) < 1e-12
    assert float(D.consistency_kl(p, p)) == pytest.approx(0, abs=1e-15)


def test_bad_arguments_name_the_parameter():
    model = _mlp()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="copies"):
        D.train_dca(model, x, y, copies=0)
    with pytest.raises(ValueError, match="snapshot"):
        D.swa([])
