"""Robust methods: worker momentum, stateful centered clipping, label-flip poisoning, attacked runs."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods import RoundInfo
from fedlab_nb.methods.robustness.robust_aggregation import (CenteredClipping, GradientSplitting, WorkerMomentum,
                                      flip_client_labels, honest_sampler, robust_method, robust_rule, run_attack)
from fedlab_nb.methods.robustness.attacks import get_attack
from fedlab_nb.methods.robustness.rules import centered_clip, krum


def _info(ids):
    ids = np.asarray(ids)
    return RoundInfo(0, ids, torch.ones(len(ids)), torch.ones(len(ids)), 5, 0.1)


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "pathological", n_clients=10, seed=0, classes_per_client=2)


def _momentum_round(transform, ids, deltas, cstate):
    from fedlab_nb.core.messages import Messages, TransformContext
    ctx = TransformContext(0, np.asarray(ids), torch.zeros(len(ids), dtype=torch.bool), torch.Generator(), torch.zeros(3))
    msgs, new = transform(Messages({"delta": deltas}, np.asarray(ids)), cstate, ctx)
    return msgs["delta"], new


def test_worker_momentum_keeps_one_ema_per_client():
    """m_k ← β m_k + (1 − β) Δ_k, one m_k per client in the client store, kept while a client is absent."""
    from fedlab_nb.engine.store import ClientStore
    wm = WorkerMomentum(beta=0.5)
    store = ClientStore(wm.client_state(torch.zeros(3)), 5)
    d1 = torch.tensor([[2.0, 0, 0], [0, 4.0, 0]])
    out, new = _momentum_round(wm, [1, 3], d1, store.gather([1, 3], "cpu"))
    store.scatter([1, 3], new)
    assert torch.allclose(out, 0.5 * d1)  # m = β·0 + (1 − β)Δ
    d2 = torch.tensor([[2.0, 0, 0], [0, 0, 8.0]])
    out, new = _momentum_round(wm, [1, 4], d2, store.gather([1, 4], "cpu"))
    store.scatter([1, 4], new)
    assert torch.allclose(out[0], torch.tensor([1.5, 0, 0]))  # 0.5·1 + 0.5·2: client 1's history is used
    assert torch.allclose(out[1], torch.tensor([0, 0, 4.0]))  # client 4 starts from zero
    m = store.all("cpu")["m"]
    assert torch.allclose(m[3], torch.tensor([0, 2.0, 0]))  # absent client 3 keeps its momentum
    assert torch.count_nonzero(m[[0, 2]]) == 0
    with pytest.raises(ValueError, match="beta"):
        WorkerMomentum(beta=1.0)


def test_worker_momentum_attack_sees_momenta(fed):
    """In a real run the engine's attack rewrites the momenta (after the uplink transform), not Δ."""
    seen = []

    def spy(updates, mask, generator=None):
        seen.append((updates.clone(), mask.clone()))
        out = updates.clone()
        out[mask] = 0.0
        return out

    method = robust_method("mean", momentum=0.5)
    ref = robust_method("mean")
    kw = dict(model="logreg", rounds=2, clients_per_round=None, lr=0.1, progress=False, byzantine=[4])
    fl.simulate(method, fed, attack=spy, **kw)
    fl.simulate(ref, fed, attack=lambda u, m, generator=None: seen.append((u.clone(), m.clone())) or u, **kw)
    (mom1, mask1), _, (raw1, _), _ = seen
    assert mask1.tolist() == [k == 4 for k in range(10)]
    assert torch.allclose(mom1, 0.5 * raw1)  # round 1: m = (1 − β)Δ, the attack saw m
def test_centered_clipping_centre_is_previous_aggregate():
    rule = CenteredClipping(tau=0.5, iters=2)
    state = rule.init_state(torch.zeros(4), 3)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    v1, state = rule.aggregate(state, x, None)
    assert torch.allclose(v1, centered_clip(x, center=torch.zeros(4), tau=0.5, iters=2))
    assert torch.equal(state["center"], v1)
    v2, state = rule.aggregate(state, x + 1, None)
    assert torch.allclose(v2, centered_clip(x + 1, center=v1, tau=0.5, iters=2))
    assert not torch.allclose(v2, centered_clip(x + 1, center=torch.zeros(4), tau=0.5, iters=2))
    with pytest.raises(ValueError, match="tau"):
        CenteredClipping(tau=0.0)


def test_gas_rule_is_keyed_by_round():
    rule = GradientSplitting("coordinate_median", p=4, f=1, seed=3)
    x = torch.randn(7, 20, generator=torch.Generator().manual_seed(1))
    a1, s1 = rule.aggregate(rule.init_state(x[0], 7), x, None)
    a2, _ = rule.aggregate(rule.init_state(x[0], 7), x, None)
    assert torch.equal(a1, a2) and s1 == {"round": 1}


def test_robust_rule_names(fed):
    assert isinstance(robust_rule("cc", tau=2.0), CenteredClipping)
    assert robust_rule("gas_krum", f=2).f == 2
    x = torch.randn(9, 5)
    assert torch.allclose(robust_rule("krum", f=2)(x), krum(x, f=2))
    with pytest.raises(ValueError, match="GAS base rule"):
        robust_rule("gas_nope")
    with pytest.raises(ValueError):
        robust_rule("no_such_rule")


def test_label_flip_copy_changes_only_byzantine_clients(fed):
    poisoned = flip_client_labels(fed, [1, 7])
    for k in range(fed.num_clients):
        x0, y0 = fed.client_train[k]
        x1, y1 = poisoned.client_train[k]
        assert x1 is x0  # features shared
        if k in (1, 7):
            assert torch.equal(y1, fed.num_classes - 1 - y0)
        else:
            assert y1 is y0
    assert torch.equal(poisoned.y_test, fed.y_test)
    assert not torch.equal(fed.client_train[1][1], poisoned.client_train[1][1])  # the original is untouched
    poisoned.to("cpu")  # re-materialising keeps the flip
    assert torch.equal(poisoned.client_train[7][1], fed.num_classes - 1 - fed.client_train[7][1])
    with pytest.raises(ValueError, match="byzantine"):
        flip_client_labels(fed, [10])


def test_honest_sampler_excludes_byzantine():
    assert honest_sampler([0, 3], 5)(0, 5, None).tolist() == [1, 2, 4]


@pytest.mark.parametrize("rule,momentum,attack", [("krum", 0.0, "alie"), ("cc", 0.9, "alie"),
                                                   ("gas_median", 0.0, "gaussian_noise"), ("mean", 0.0, "label_flip")])
def test_attacked_run_is_deterministic(fed, rule, momentum, attack):
    kw = dict(model="logreg", rounds=3, local_steps=1, batch_size=16, lr=0.5, seed=0)
    h1 = run_attack(rule, attack, fed, [2, 5], momentum=momentum, **kw)
    h2 = run_attack(rule, attack, fed, [2, 5], momentum=momentum, **kw)
    assert len(h1) == 3 and np.isfinite(h1["test_acc"]).all()
    assert torch.equal(h1.theta, h2.theta)
    clean = run_attack(rule, "none", fed, [2, 5], momentum=momentum, **kw)
    assert not torch.equal(h1.theta, clean.theta)  # the attack reached the aggregate


def test_sign_flip_breaks_mean_but_not_honest_reference(fed):
    kw = dict(model="logreg", rounds=3, local_steps=1, batch_size=64, lr=1.0, seed=0)
    honest = run_attack("honest_mean", "sign_flip", fed, [0, 1, 2], **kw)
    attacked = fl.simulate(robust_method("mean"), fed, attack=get_attack("sign_flip", scale=10.0),
                           byzantine=[0, 1, 2], clients_per_round=None, progress=False, **kw)
    assert attacked.final("test_loss") > honest.final("test_loss")
    with pytest.raises(ValueError, match="attack must be one of"):
        run_attack("mean", "bitflip", fed, [0], **kw)
