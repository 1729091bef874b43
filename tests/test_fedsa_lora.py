"""FedSA-LoRA and its variants: only the named LoRA factors move on the wire and on the server, a client's
personal model is the shared factor with its own kept one, the server's A is the n_k-weighted mean of the
clients' A's, the cross-client similarity measure (against scikit-learn), and clear errors."""
import importlib

import numpy as np
import pytest
import torch
from sklearn.metrics.pairwise import cosine_similarity

import fedlab_nb as fl
from fedlab_nb.engine.evaluate import evaluate
from fedlab_nb.lora import LoRALayout, add_lora
from fedlab_nb.models import MLP, flatten_params

fs = importlib.import_module("fedlab_nb.methods.communication.fedsa_lora")  # `fedlab_nb.methods.communication.fedsa_lora` is the factory


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "dirichlet", n_clients=4, alpha=0.5, seed=0)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return MLP(64, 10, hidden=(16, 12))


def _run(fed, base, variant, rounds=2):
    return fs.run_fedsa_lora(fed, base, variant, rank=3, alpha=6.0, rounds=rounds, local_steps=3, batch_size=16,
                             lr=0.2, seed=1)


def _theta0(base):
    return flatten_params(add_lora(base, 3, 6.0, seed=1))


@pytest.fixture(scope="module")
def runs(fed, base):
    return {v: _run(fed, base, v) for v in fs.VARIANTS}


def test_each_variant_sends_exactly_its_factors(runs):
    layout = LoRALayout.of(runs["fedsa"].model)
    n_a = sum(r * k for _, k, r in layout.shapes)
    n_b = sum(d * r for d, _, r in layout.shapes)
    expected = {"fedsa": 4 * n_a, "share_b": 4 * n_b, "share_both": 4 * (n_a + n_b), "local_only": 0}
    for v, h in runs.items():
        per_client = h.bytes_up.to_numpy() / h.n_sampled.to_numpy()
        assert (per_client == expected[v]).all(), (v, per_client)
        assert fs.sent_entries(v, layout) * 4 == expected[v]


def test_unsent_factors_never_move_on_the_server(runs, base):
    theta0 = _theta0(base)
    layout = LoRALayout.of(runs["fedsa"].model)
    a_of = lambda t: torch.cat([a.flatten() for a, _ in layout.split(t)])
    b_of = layout.b_only
    fedsa, share_b, both, local = (runs[v].theta for v in ("fedsa", "share_b", "share_both", "local_only"))
    assert torch.equal(b_of(fedsa), b_of(theta0)) and not torch.equal(a_of(fedsa), a_of(theta0))
    assert torch.equal(a_of(share_b), a_of(theta0)) and not torch.equal(b_of(share_b), b_of(theta0))
    assert not torch.equal(a_of(both), a_of(theta0)) and not torch.equal(b_of(both), b_of(theta0))
    assert torch.equal(local, theta0)


def test_frozen_pretrained_weights_stay_exact(runs, base):
    frozen = dict(base.named_parameters())
    for h in runs.values():
        for name, buf in h.model.named_buffers():
            assert torch.equal(buf, frozen[name]), name


def test_personal_model_is_shared_a_with_own_b(runs):
    h = runs["fedsa"]
    layout = LoRALayout.of(h.model)
    P = fs.personal_factors(h)
    assert P.shape == (4, layout.size)
    for (a, b), (a_srv, _) in zip(layout.split(P), layout.split(h.theta)):
        assert torch.equal(a, a_srv.expand_as(a))                   # everyone's A is the server's
        assert not torch.allclose(b[0], b[1])                      # B's are the clients' own
    assert torch.equal(layout.b_only(P), h.store.all("cpu")["local"])   # ... exactly the stored ones
    # share-B mirrors it; share-both: the global factors are everyone's
    Pb = fs.personal_factors(runs["share_b"])
    assert torch.equal(layout.b_only(Pb), layout.b_only(runs["share_b"].theta).expand(4, -1))
    assert torch.equal(fs.personal_factors(runs["share_both"]), runs["share_both"].theta.expand(4, -1))


def test_reported_personal_accuracy_is_of_the_personal_models(runs, fed):
    h = runs["fedsa"]
    P = fs.personal_factors(h)
    accs = [evaluate(h.model, P[k], *fed.client_test[k])[1] for k in range(4)]
    assert abs(np.mean(accs) - h.final("personal_acc_mean")) < 1e-9


def test_server_a_is_weighted_mean_of_client_a_and_b_stays_local(fed, base):
    """One round of FedSA-LoRA = one round of local-only training (same start, same keyed batches), then
    Ā = Σ n_k A_k / Σ n_k on the server and B_k in each client's store."""
    sa, local = _run(fed, base, "fedsa", rounds=1), _run(fed, base, "local_only", rounds=1)
    layout = LoRALayout.of(sa.model)
    clients = fs.personal_factors(local)
    p = torch.tensor([len(y) for _, y in fed.client_train], dtype=torch.float32)
    p = p / p.sum()
    for (a_srv, _), (a_k, _) in zip(layout.split(sa.theta), layout.split(clients)):
        assert torch.allclose(a_srv, torch.einsum("k,kij->ij", p, a_k), atol=1e-6)
    assert torch.allclose(layout.b_only(fs.personal_factors(sa)), layout.b_only(clients), atol=1e-6)


def test_similarity_matches_sklearn_and_removes_the_start():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 30, generator=g)
    S = cosine_similarity(rows.numpy())
    assert abs(fs.mean_pairwise_cosine(rows) - S[np.triu_indices(5, 1)].mean()) < 1e-6
    model = add_lora(MLP(6, 3, hidden=(5,)), 2, seed=0)
    layout = LoRALayout.of(model)
    start = torch.randn(layout.size, generator=g)
    step = torch.randn(layout.size, generator=g)
    clients = start + torch.stack([(k + 1.0) * step for k in range(3)])    # same direction, different lengths
    sims = fs.factor_similarity(layout, clients, start)
    assert all(abs(v - 1.0) < 1e-6 for d in sims.values() for v in d.values())


def test_clear_errors(fed):
    with pytest.raises(ValueError, match="variant must be one of"):
        fs.fedsa_lora("share_a")
    with pytest.raises(ValueError, match="server_lr"):
        fs.fedsa_lora(server_lr=0)
    with pytest.raises(ValueError, match="K >= 2"):
        fs.mean_pairwise_cosine(torch.ones(1, 3))
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="lora_B.*matches no parameter"):   # a model without LoRA
        fl.simulate(fs.fedsa_lora(), fed, MLP(64, 10, hidden=(8,)), rounds=1, progress=False)
    assert fl.get_method("fedsa_lora", variant="share_b").groups.local == ("*lora_A",)
