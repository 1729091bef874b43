"""Backdoor notebook pieces: the model-replacement identity, the attack success rate, norm clipping, the runner."""
import math

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.method import RoundInfo
from fedlab_nb.methods.robustness.backdoors import (AttackerSampler, LongerTraining, NormClipping, backdoor_run, defence,
                                         norm_clipping_method, replacement_boost)
from fedlab_nb.methods.robustness.robust_aggregation import robust_method
from fedlab_nb.methods.robustness.poison import PixelTrigger, attack_success_rate, corner_pattern
from fedlab_nb.methods.robustness.attacks import get_attack


def _info(m, theta, round=0, seed=0):
    return RoundInfo(round, np.arange(m), torch.ones(m), torch.ones(m), m, 0.1, theta=theta, seed=seed)


def _fedavg_round(theta, deltas, byzantine, server_lr):
    """The library's FedAvg server side on one round: `scaled` attack → uniform mean → server step."""
    m, a = deltas.shape[0], int(byzantine.sum())
    boosted = get_attack("scaled", scale=replacement_boost(m, a, server_lr))(deltas, byzantine)
    method = robust_method("mean", server_lr=server_lr)
    state = method.init_state(theta, m)
    agg, state = method.aggregate(state, boosted, _info(m, theta))
    return method.server_step(state, theta, agg)[0]


@pytest.mark.parametrize("server_lr", [1.0, 0.5, 0.25])
def test_replacement_gives_the_attackers_model_exactly(server_lr):
    # dyadic numbers and γ = m/η a power of two: every operation is exact, so G' == X bit for bit
    theta = torch.tensor([0.5, -1.25, 2.0, 0.0, 3.75], dtype=torch.float64)
    X = torch.tensor([1.0, 0.25, -2.5, 0.125, 3.0], dtype=torch.float64)
    deltas = torch.zeros(4, 5, dtype=torch.float64)
    deltas[2] = X - theta
    new = _fedavg_round(theta, deltas, torch.tensor([False, False, True, False]), server_lr)
    assert torch.equal(new, X)


def test_replacement_identity_random_and_colluding():
    g = torch.Generator().manual_seed(3)
    theta, X = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    deltas = torch.zeros(10, 50, dtype=torch.float64)
    byz = torch.zeros(10, dtype=torch.bool)
    byz[[1, 7]] = True                        # two colluders split γ = m / (η a)
    deltas[byz] = X - theta
    torch.testing.assert_close(_fedavg_round(theta, deltas, byz, 0.3), X, rtol=0, atol=1e-12)


def test_replacement_with_benign_updates_adds_their_scaled_sum():
    g = torch.Generator().manual_seed(4)
    theta, X = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    deltas = 0.01 * torch.randn(5, 8, generator=g, dtype=torch.float64)
    deltas[0] = X - theta
    byz = torch.tensor([True, False, False, False, False])
    expected = X + (0.5 / 5) * deltas[1:].sum(0)        # G' = X + (η/m) Σ_benign Δ_i
    torch.testing.assert_close(_fedavg_round(theta, deltas, byz, 0.5), expected, rtol=0, atol=1e-12)


def test_unboosted_poisoning_moves_the_model_by_one_mth():
    theta = torch.zeros(3, dtype=torch.float64)
    deltas = torch.zeros(4, 3, dtype=torch.float64)
    deltas[0] = torch.tensor([4.0, -8.0, 2.0], dtype=torch.float64)
    method = robust_method("mean")
    state = method.init_state(theta, 4)
    agg, state = method.aggregate(state, deltas, _info(4, theta))
    assert torch.equal(method.server_step(state, theta, agg)[0], deltas[0] / 4)


def test_replacement_boost_values_and_errors():
    assert replacement_boost(20) == 20.0
    assert replacement_boost(20, attackers=4, server_lr=0.5) == 10.0
    with pytest.raises(ValueError, match="attackers"):
        replacement_boost(10, attackers=0)
    with pytest.raises(ValueError, match="server_lr"):
        replacement_boost(10, server_lr=0.0)


# --- attack success rate ---------------------------------------------------------------------------------
class _FirstFeatureVotesTarget(torch.nn.Module):
    """Class 0 when feature `j` > 0.5, else class 1 (a hand-set linear model)."""
    def __init__(self, j):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        with torch.no_grad():
            self.lin.weight.zero_()
            self.lin.bias.copy_(torch.tensor([-5.0, 0.0]))
            self.lin.weight[0, j] = 10.0

    def forward(self, x):
        return self.lin(x)


def test_asr_counts_triggered_non_target_rows_only():
    x = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0.0, 0, 0, 0], [1.0, 0, 0, 0], [0.0, 0, 0, 0]])
    y = torch.tensor([0, 1, 1, 2, 0])          # rows 0 and 4 are of the target class: left out
    trigger = PixelTrigger((0,), target=0, pattern=(3,), value=1.0)
    # a model that ignores the trigger: target iff feature 0 is on → 2 of the 3 non-target rows (rows 1, 3)
    model = _FirstFeatureVotesTarget(0)
    theta = fl.models.flatten_params(model)
    assert attack_success_rate(model, theta, x, y, trigger) == pytest.approx(2 / 3)
    # a model that reads only the trigger pixel: every triggered non-target row becomes the target
    model = _FirstFeatureVotesTarget(3)
    assert attack_success_rate(model, fl.models.flatten_params(model), x, y, trigger) == 1.0
    # ... and the untriggered rows are not: the trigger is what the metric applies
    assert float((model(x[y != 0]).argmax(1) == 0).float().mean()) == 0.0


def test_asr_undefined_when_every_label_is_the_target():
    model = _FirstFeatureVotesTarget(0)
    trigger = PixelTrigger((0,), target=0, pattern=(3,))
    with pytest.raises(ValueError, match="target class"):
        attack_success_rate(model, fl.models.flatten_params(model), torch.zeros(3, 4), torch.zeros(3, dtype=torch.long),
                            trigger)


# --- norm clipping -------------------------------------------------------------------------------------------
def test_norm_clipping_caps_each_update_then_averages():
    updates = torch.tensor([[0.3, 0.4], [0.0, 2.0], [6.0, 8.0]], dtype=torch.float64)   # norms 0.5, 2, 10
    rule = NormClipping(1.0)
    agg, state = rule.aggregate(rule.init_state(updates[0], 3), updates, None)
    clipped = torch.tensor([[0.3, 0.4], [0.0, 1.0], [0.6, 0.8]], dtype=torch.float64)
    torch.testing.assert_close(agg, clipped.mean(0), rtol=0, atol=1e-15)
    assert state["clipped"] == pytest.approx(2 / 3) and state["norm_median"] == pytest.approx(2.0)
    assert rule.metrics(state)["norm_max"] == pytest.approx(10.0)


def test_norm_clipping_with_infinite_bound_is_the_mean():
    updates = torch.randn(6, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    agg, _ = NormClipping(math.inf).aggregate({}, updates, None)
    assert torch.equal(agg, updates.mean(0))


def test_weak_dp_noise_is_keyed_by_seed_and_round():
    updates = torch.zeros(4, 1000, dtype=torch.float64)
    rule = NormClipping(1.0, noise=0.1)
    theta = torch.zeros(1000, dtype=torch.float64)
    a, _ = rule.aggregate({}, updates, None, info=_info(4, theta, round=3, seed=1))
    b, _ = rule.aggregate({}, updates, None, info=_info(4, theta, round=3, seed=1))
    c, _ = rule.aggregate({}, updates, None, info=_info(4, theta, round=4, seed=1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert float(a.std()) == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError, match="RoundInfo"):
        rule.aggregate({}, updates, None)


def test_norm_clipping_errors():
    with pytest.raises(ValueError, match="bound"):
        NormClipping(0.0)
    with pytest.raises(ValueError, match="noise"):
        NormClipping(1.0, noise=-0.1)


# --- the runner ------------------------------------------------------------------------------------------------
def test_attacker_sampler_single_shot():
    sampler = AttackerSampler((0,), (2,))
    g = np.random.default_rng(0)
    assert list(sampler(1, 5, g)) == [1, 2, 3, 4]
    assert list(sampler(2, 5, g)) == [0, 1, 2, 3, 4]
    assert list(AttackerSampler((3,))(0, 5, g)) == [0, 1, 2, 3, 4]


def test_longer_training_tiles_and_poisons_each_copy():
    trigger = PixelTrigger((0,), target=7, pattern=(0,), value=9.0, fraction=0.5)
    x, y = torch.zeros(10, 3), torch.arange(10) % 3
    xs, ys = LongerTraining(trigger, 3)(0, 0, x, y, np.random.default_rng(0))
    assert xs.shape == (30, 3) and ys.shape == (30,)
    stamped = xs[:, 0] == 9.0
    assert int(stamped.sum()) == 15 and bool((ys[stamped] == 7).all())
    assert torch.equal(ys[~stamped], torch.cat([y, y, y])[~stamped])
    with pytest.raises(ValueError, match="repeat"):
        LongerTraining(trigger, 0)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.9, seed=0)
    model = fl.models.make_model("mlp", fed.dataset.input_shape, fed.dataset.num_classes, hidden=(16,))
    trigger = PixelTrigger((0,), target=0, pattern=corner_pattern(fed.dataset.input_shape, 2), value=1.0)
    return fed, model, trigger


@pytest.mark.parametrize("attack", ["none", "replacement", "repeated"])
def test_backdoor_run_records_asr_every_round(tiny, attack):
    fed, model, trigger = tiny
    theta = fl.models.flatten_params(model)
    h = backdoor_run(robust_method("mean"), attack, fed, model, theta, trigger, rounds=3, attack_round=1,
                     local_epochs=1, batch_size=32, lr=0.1, seed=0)
    assert h["asr"].notna().all() and len(h) == 3
    expected = {"none": [4, 4, 4], "replacement": [3, 4, 3], "repeated": [4, 4, 4]}[attack]
    assert list(h["n_sampled"]) == expected


def test_backdoor_run_and_defence_errors(tiny):
    fed, model, trigger = tiny
    theta = fl.models.flatten_params(model)
    with pytest.raises(ValueError, match="attack must be one of"):
        backdoor_run(robust_method("mean"), "boost", fed, model, theta, trigger)
    with pytest.raises(ValueError, match="attack_round"):
        backdoor_run(robust_method("mean"), "replacement", fed, model, theta, trigger, rounds=3, attack_round=3)
    with pytest.raises(ValueError, match="unknown defence"):
        defence("bulyan", model=model, fed=fed, seed=0)
    assert norm_clipping_method(1.0).rule.bound == 1.0
