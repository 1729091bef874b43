import numpy as np
import pandas as pd
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.engine import History, NonFiniteUpdateError
from fedlab_nb.engine.client import batch_schedule
from fedlab_nb.methods import RoundInfo, weighted_mean
from fedlab_nb.methods.heterogeneity.scaffold import ControlVariateObjective
from fedlab_nb.utils import rng

KW = dict(model="logreg", rounds=3, clients_per_round=4, lr=0.1, progress=False, backend="loop")


def test_weighted_mean_exact():
    u = torch.tensor([[1.0, 2.0], [3.0, -4.0], [5.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 7.0], dtype=torch.float64)
    expected = (1 * u[0] + 2 * u[1] + 7 * u[2]) / 10
    assert torch.allclose(weighted_mean(u, w), expected, rtol=0, atol=1e-14)


def test_fedavg_of_identical_updates_is_that_update():
    method = fl.get_method("fedavg")
    theta = torch.zeros(5)
    state = method.init_state(theta, 10)
    delta = torch.randn(5)
    info = RoundInfo(0, np.arange(4), torch.tensor([3.0, 50.0, 7.0, 1.0]), torch.ones(4), 10, 0.1)
    agg, state = method.aggregate(state, delta.repeat(4, 1), info)
    new_theta, _ = method.server_step(state, theta, agg)
    assert torch.allclose(new_theta, delta, atol=1e-7)


def test_scaffold_control_variates():
    """Client: c_k⁺ = c_k − c − Δ_k/(τ_k η) (option II), sending Δc_k = c_k⁺ − c_k; server: c ← c + (|S|/N)·mean(Δc)."""
    from fedlab_nb.core.messages import Messages
    obj = ControlVariateObjective()
    theta = torch.zeros(3)
    state = obj.init_state(theta, 4)
    state["c"] = torch.tensor([0.1, 0.2, 0.3])
    down = obj.broadcast(state)
    cstate = {"c_k": torch.stack([obj.client_state(theta)["c_k"]] * 2)}
    deltas = torch.tensor([[1.0, 0.0, -1.0], [2.0, 2.0, 2.0]])
    info = RoundInfo(0, np.array([0, 2]), torch.ones(2), torch.tensor([2.0, 4.0]), 4, 0.5)
    assert torch.allclose(obj.context(down, cstate), state["c"].repeat(2, 1))  # c − c_k with c_k = 0
    extra, new = obj.finish(deltas, down, cstate, info.steps, info.lr)
    c_k0 = -state["c"] - deltas[0] / (2 * 0.5)
    c_k2 = -state["c"] - deltas[1] / (4 * 0.5)
    assert torch.allclose(new["c_k"][0], c_k0) and torch.allclose(new["c_k"][1], c_k2)
    assert torch.allclose(extra["delta_c"], new["c_k"])  # the old c_k were 0
    c = obj.server_update(state, Messages({"delta": deltas, **extra}, info.client_ids), info)["c"]
    assert torch.allclose(c, state["c"] + (2 / 4) * (c_k0 + c_k2) / 2)


def test_batch_schedule_epochs_and_steps():
    g = np.random.default_rng(0)
    b = batch_schedule(10, 4, 2, None, g)
    assert [len(x) for x in b] == [4, 4, 2, 4, 4, 2]
    assert sorted(np.concatenate(b[:3])) == list(range(10))
    assert len(batch_schedule(10, 4, 1, 7, g)) == 7


@pytest.mark.parametrize("keys", [(0,), (0, 3, 2, 7), (2**32 - 1, 5), (2**32, 1), (12345678901234, 0, 9)])
def test_keyed_rng_is_numpys_default_rng_of_the_keys(keys):
    # the fast path (keys as uint32 words) must draw exactly the stream default_rng(list of keys) draws
    ours, numpys = rng(*keys), np.random.default_rng(list(keys))
    assert ours.permutation(64).tolist() == numpys.permutation(64).tolist()
    assert (ours.integers(2**62, size=8) == numpys.integers(2**62, size=8)).all()
    with pytest.raises(ValueError):
        rng(-1)


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "scaffold", "fednova", "fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_methods_learn_and_are_deterministic(digits_fed, method):
    kw = {"server_lr": 0.1} if method in ("fedadam", "fedyogi", "fedadagrad") else {}
    run = lambda: fl.simulate(fl.get_method(method, **kw), digits_fed, seed=1, **{**KW, "rounds": 4, "lr": 0.3})
    a, b = run(), run()
    pd.testing.assert_frame_equal(pd.DataFrame(a), pd.DataFrame(b))
    assert a.final("test_acc") > 0.4, "four rounds on digits should beat chance (0.1) clearly"
    assert list(a.columns) == ["round", "n_sampled", "train_loss", "test_loss", "test_acc", "client_acc_mean",
                               "client_acc_std", "client_acc_p10", "bytes_up", "bytes_down"]


def test_different_seed_differs(digits_fed):
    a = fl.simulate("fedavg", digits_fed, seed=1, **KW)
    b = fl.simulate("fedavg", digits_fed, seed=2, **KW)
    assert not np.allclose(a["test_loss"], b["test_loss"])


def test_checkpoint_resume_equals_uninterrupted(digits_fed, tmp_path):
    full = fl.simulate("scaffold", digits_fed, seed=0, **{**KW, "rounds": 5})
    ckpt = tmp_path / "run.pt"

    def crash(r, theta, row):
        if r == 3:
            raise KeyboardInterrupt  # the run is killed after round 3 was checkpointed

    with pytest.raises(KeyboardInterrupt):
        fl.simulate("scaffold", digits_fed, seed=0, checkpoint=ckpt, callback=crash, **{**KW, "rounds": 5})
    resumed = fl.simulate("scaffold", digits_fed, seed=0, checkpoint=ckpt, resume=True, **{**KW, "rounds": 5})
    pd.testing.assert_frame_equal(pd.DataFrame(full), pd.DataFrame(resumed))
    assert torch.equal(full.theta, resumed.theta)


def test_resume_refuses_other_config(digits_fed, tmp_path):
    ckpt = tmp_path / "run.pt"
    fl.simulate("fedavg", digits_fed, seed=0, checkpoint=ckpt, **KW)
    with pytest.raises(ValueError, match="different run configuration"):
        fl.simulate("fedavg", digits_fed, seed=0, checkpoint=ckpt, resume=True, **{**KW, "lr": 0.2})


def test_nonfinite_update_names_client_and_round(digits_fed):
    def poison(updates, byz, generator=None):
        updates = updates.clone()
        updates[byz] = float("nan")
        return updates

    with pytest.raises(NonFiniteUpdateError, match=r"round 1: client\(s\) \[\d+"):
        fl.simulate("fedavg", digits_fed, attack=poison, byzantine=range(8), **KW)
    h = fl.simulate("fedavg", digits_fed, attack=poison, byzantine=[0, 1], on_nonfinite="drop",
                    **{**KW, "clients_per_round": None})
    assert np.isfinite(h.final("test_loss"))


def test_eval_every_and_history_roundtrip(digits_fed, tmp_path):
    h = fl.simulate("fedavg", digits_fed, eval_every=2, **{**KW, "rounds": 5})
    assert h["test_acc"].isna().tolist() == [True, False, True, False, False]  # the last round is always evaluated
    path = h.save(tmp_path / "h.csv")
    back = History.load(path)
    pd.testing.assert_frame_equal(pd.DataFrame(h), pd.DataFrame(back))
    assert back.meta["method"] == "fedavg"


def test_bernoulli_sampler_allows_empty_rounds(digits_fed):
    from fedlab_nb.engine import BernoulliSampler
    h = fl.simulate("fedavg", digits_fed, clients_per_round=BernoulliSampler(np.full(8, 0.2)),
                    **{k: v for k, v in KW.items() if k != "clients_per_round"})
    assert (h["n_sampled"] >= 0).all() and len(h) == 3


@pytest.mark.parametrize("kw,match", [({"rounds": 0}, "rounds must be an integer"), ({"lr": -1.0}, "lr must be a number > 0"),
                                      ({"clients_per_round": 99}, "clients_per_round=99"),
                                      ({"backend": "gpu"}, "backend must be"), ({"stragglers": 2.0}, "stragglers")])
def test_bad_simulate_arguments(digits_fed, kw, match):
    with pytest.raises(ValueError, match=match):
        fl.simulate("fedavg", digits_fed, **{**KW, **kw})


def test_unknown_method_and_model(digits_fed):
    with pytest.raises(ValueError, match="did you mean 'fedprox'"):
        fl.get_method("fedprx")
    with pytest.raises(ValueError, match="unknown model"):
        fl.simulate("fedavg", digits_fed, **{**KW, "model": "resnet"})


def test_stragglers_do_less_work(digits_fed):
    from fedlab_nb.engine.server import RunConfig, _local_jobs
    ids = np.arange(8)
    full = _local_jobs(digits_fed, ids, RunConfig(seed=0, local_epochs=3), 0, None)
    part = _local_jobs(digits_fed, ids, RunConfig(seed=0, local_epochs=3, stragglers=1.0), 0, None)
    steps_full, steps_part = [len(j.batches) for j in full], [len(j.batches) for j in part]
    assert all(1 <= p <= f for p, f in zip(steps_part, steps_full)) and sum(steps_part) < sum(steps_full)
    for a, b in zip(full, part):  # a straggler does a prefix of the same work
        assert all((x == y).all() for x, y in zip(a.batches, b.batches))
    h = fl.simulate("fednova", digits_fed, stragglers=1.0, **KW)
    assert np.isfinite(h.final("test_acc"))


def test_run_one_liner():
    h = fl.run("fedavg", "digits", "dirichlet", clients=5, rounds=2, partition_kwargs={"alpha": 1.0},
               model="logreg", progress=False)
    assert len(h) == 2


def test_drop_stragglers_removes_their_updates(digits_fed):
    from fedlab_nb.engine.server import RunConfig, _stragglers
    h = fl.simulate("fedavg", digits_fed, stragglers=0.5, drop_stragglers=True, **{**KW, "clients_per_round": None})
    late = [len(_stragglers(8, RunConfig(seed=0, stragglers=0.5), r)) for r in range(3)]
    assert h["n_sampled"].tolist() == [8 - n for n in late] == [4, 4, 4]
