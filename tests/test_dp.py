"""DP-FedAvg (McMahan et al., ICLR 2018) with adaptive clipping (Andrew et al., NeurIPS 2021) and local DP:
the accountant against a second library, the estimators and their noise, clipping, adaptive clipping,
exact resume and the errors for misuse."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.messages import Messages
from fedlab_nb.core.method import Method, RoundInfo, ServerSGD, UniformWeighting, weighted_mean
from fedlab_nb.core.streams import SAMPLE
from fedlab_nb.engine.sampling import UniformSampler
from fedlab_nb.core.method import LocalObjective
from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg, dp_fedavg_with_sampler, local_dp_fedavg
from fedlab_nb.methods.privacy import accounting
from fedlab_nb.methods.privacy.dp import (ClipUpdates, DPAggregate, LocalGaussianNoise, adaptive_noise_split, central_epsilon,
                                  clip_rows, dp_sampler, local_epsilon)
from fedlab_nb.utils import rng

KW = dict(model="logreg", local_epochs=1, batch_size=8, lr=0.1, progress=False)


@pytest.fixture(scope="module")
def fed40():
    return fl.federate("digits", "iid", n_clients=40, seed=0)


def info_for(m, round=0, seed=0, K=100, messages=None):
    return RoundInfo(round, np.arange(m), torch.ones(m), torch.ones(m), K, 0.1, None, messages, seed, np.arange(m))


# (1) the accountant against prv-accountant ----------------------------------------------------------------
@pytest.mark.parametrize("q,z,T,delta", [(0.1, 1.0, 50, 1e-5), (0.2, 0.8, 20, 1e-6), (0.02, 2.0, 300, 1e-5)])
def test_epsilon_pld_matches_prv_and_rdp_is_an_upper_bound(q, z, T, delta):
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism
    prv = PRVAccountant(prvs=PoissonSubsampledGaussianMechanism(noise_multiplier=z, sampling_probability=q),
                        max_self_compositions=T, eps_error=0.01, delta_error=delta / 100)
    low, est, up = prv.compute_epsilon(delta=delta, num_self_compositions=[T])
    pld = accounting.epsilon(q, z, T, delta, "pld")
    rdp = accounting.epsilon(q, z, T, delta, "rdp")
    assert low - 0.02 <= pld <= up + 0.02, (low, est, up, pld)  # PRV's bounds, plus PLD's discretisation
    assert abs(pld - est) <= 0.01 * est + 0.02
    assert rdp >= pld - 1e-9 and rdp >= low  # RDP → (ε, δ) is a valid but looser conversion


def test_fixed_size_sampling_is_accounted_with_replace_one_sensitivity():
    # a replaced user moves the clipped sum by up to 2S: the accountant gets z/2
    assert central_epsilon(0.1, 2.0, 20, 1e-5, sampling="fixed") == pytest.approx(
        accounting.epsilon(0.1, 1.0, 20, 1e-5, sampling="fixed"))
    assert local_epsilon(2.0, 5, 1e-5) == pytest.approx(accounting.epsilon(1.0, 1.0, 5, 1e-5))
    assert central_epsilon(0.1, 1.0, 0, 1e-5) == 0.0 and math.isinf(central_epsilon(0.1, 0.0, 3, 1e-5))


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_noise_for_epsilon_spends_exactly_the_target(acc):
    z = accounting.noise_for_epsilon(1.0, 0.2, 30, 1e-5, acc)
    assert accounting.epsilon(0.2, z, 30, 1e-5, acc) == pytest.approx(1.0, abs=1e-3)
    assert accounting.epsilon(0.2, 0.97 * z, 30, 1e-5, acc) > 1.0


# (2) z = 0 is FedAvg with clipping, exactly ----------------------------------------------------------------
def clipped_fedavg(S):
    return Method("clipped_fedavg", LocalObjective(), UniformWeighting(), weighted_mean, ServerSGD(),
                  uplink=(ClipUpdates(S),))


def test_z0_fixed_denominator_with_fixed_size_sampling_is_clipped_fedavg(fed40):
    method, sampler = dp_fedavg_with_sampler(fed40, noise_multiplier=0.0, clip_norm=0.05, sampling_rate=0.25,
                                             sampling="fixed")
    assert sampler == UniformSampler(10)
    dp = fl.simulate(method, fed40, rounds=3, clients_per_round=sampler, seed=0, **KW)
    ref = fl.simulate(clipped_fedavg(0.05), fed40, rounds=3, clients_per_round=UniformSampler(10), seed=0, **KW)
    assert torch.equal(dp.theta, ref.theta)
    assert dp["test_acc"].tolist() == ref["test_acc"].tolist()


def test_z0_clipped_estimator_with_poisson_sampling_is_clipped_fedavg(fed40):
    # f̃_c with qW_min = 1 divides by Σ_k w_k = the number of sampled clients whenever there is one
    method, sampler = dp_fedavg_with_sampler(fed40, noise_multiplier=0.0, clip_norm=0.05, sampling_rate=0.25,
                                             estimator="clipped", min_total_weight=4.0)
    dp = fl.simulate(method, fed40, rounds=3, clients_per_round=sampler, seed=0, **KW)
    ref = fl.simulate(clipped_fedavg(0.05), fed40, rounds=3, clients_per_round=sampler, seed=0, **KW)
    assert dp.meta["backend_used"] == "fused"  # "auto": the fused step where it applies
    assert torch.equal(dp.theta, ref.theta)


# (3) the noise has the paper's standard deviation ---------------------------------------------------------
@pytest.mark.parametrize("estimator,expected", [("fixed", lambda z, S, q, W, Wmin: z * S / (q * W)),
                                                ("clipped", lambda z, S, q, W, Wmin: 2 * z * S / (q * Wmin))])
def test_noise_std_is_z_times_sensitivity(estimator, expected):
    z, S, q, K = 1.5, 0.7, 0.1, 100
    rule = DPAggregate(z, S, q, estimator=estimator, min_total_weight=60.0)
    state = rule.init_state(torch.zeros(1), K)
    out, _ = rule.aggregate(state, torch.zeros(10, 40_000), torch.ones(10), info=info_for(10, K=K))
    want = expected(z, S, q, K, 60.0)
    assert float(out.std()) == pytest.approx(want, rel=0.03)  # sd of a 40k-sample sd ≈ 0.4 %; 2× wrong fails
    assert abs(float(out.mean())) < 4 * want / math.sqrt(40_000)


def test_adaptive_noise_split_spends_the_same_budget():
    z_delta, sigma_b = adaptive_noise_split(1.0, 100)
    assert sigma_b == 5.0 and z_delta > 1.0
    assert (z_delta ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(1.0)
    rule = DPAggregate(1.0, 0.5, 0.1, adaptive=True)
    state = rule.init_state(torch.zeros(1), 1000)
    assert rule.noise_std(state) == pytest.approx(z_delta * 0.5 / 100)


def test_local_noise_has_std_z_s_per_client():
    t = LocalGaussianNoise(clip_norm=0.5, noise_multiplier=2.0)
    msgs = Messages({"delta": torch.zeros(4, 30_000)}, np.arange(4))
    ctx = type("Ctx", (), {"generator": torch.Generator().manual_seed(0)})()
    out, _ = t(msgs, {}, ctx)
    assert out["delta"].std(dim=1).numpy() == pytest.approx(np.full(4, 1.0), rel=0.03)


# (4) the two estimators' denominators ---------------------------------------------------------------------
def test_estimator_denominators():
    g = torch.Generator().manual_seed(1)
    deltas, _ = clip_rows(torch.randn(6, 5, generator=g), 1.0)
    w = torch.tensor([1.0, 0.5, 0.25, 1.0, 0.75, 0.5])  # Σ = 4
    K, W = 50, 30.0
    fixed = DPAggregate(0.0, 1.0, 0.2, estimator="fixed", total_weight=W)
    out, _ = fixed.aggregate(fixed.init_state(torch.zeros(1), K), deltas, w, info=info_for(6, K=K))
    torch.testing.assert_close(out, (w @ deltas) / (0.2 * W))  # qW = 6
    for w_min, denom in [(10.0, 4.0), (25.0, 5.0)]:  # max(qW_min, Σw): Σw = 4 wins, then qW_min = 5
        clipped = DPAggregate(0.0, 1.0, 0.2, estimator="clipped", total_weight=W, min_total_weight=w_min)
        out, _ = clipped.aggregate(clipped.init_state(torch.zeros(1), K), deltas, w, info=info_for(6, K=K))
        torch.testing.assert_close(out, (w @ deltas) / denom)


def test_capped_weights_and_total_weight(fed40):
    method, _ = dp_fedavg_with_sampler(fed40, noise_multiplier=1.0, clip_norm=0.1, sampling_rate=0.25, example_cap=30)
    n = fed40.sizes.astype(float)
    assert method.rule.total_weight == pytest.approx(np.minimum(n / 30, 1).sum())
    h = fl.simulate(method, fed40, rounds=2, clients_per_round=dp_sampler(0.25, 40), seed=0, **KW)
    assert np.isfinite(h["test_acc"].iloc[-1])


# (5) adaptive clipping moves C to the γ-quantile ----------------------------------------------------------
@pytest.mark.parametrize("z,gamma,tol", [(0.0, 0.5, 0.05), (0.0, 0.8, 0.05), (1.0, 0.5, 0.2)])
def test_adaptive_clip_tracks_the_quantile(z, gamma, tol):
    norms = torch.linspace(0.5, 2.0, 200)  # the γ-quantile is 0.5 + 1.5 γ
    rule = DPAggregate(z, 0.05, 1.0, adaptive=True, target_quantile=gamma, clip_lr=0.2)
    state = rule.init_state(torch.zeros(1), 200)
    clip, transform = [], ClipUpdates(None)
    for r in range(150):
        down = rule.broadcast(state)
        msgs = Messages({"delta": norms[:, None] * torch.ones(200, 3) / math.sqrt(3)}, np.arange(200))
        ctx = type("Ctx", (), {"down": down})()
        msgs, _ = transform(msgs, {}, ctx)
        _, state = rule.aggregate(state, msgs["delta"], torch.ones(200), info=info_for(200, r, K=200, messages=msgs))
        clip.append(state["clip"])
    target = 0.5 + 1.5 * gamma
    assert abs(np.mean(clip[-20:]) / target - 1) < tol
    assert rule.metrics(state)["clip_norm"] == state["clip"]


def test_adaptive_run_reports_the_clip_norm(fed40):
    method, sampler = dp_fedavg_with_sampler(fed40, noise_multiplier=0.5, clip_norm=0.01, sampling_rate=0.5,
                                             adaptive=True, clip_count_stddev=1.0)
    h = fl.simulate(method, fed40, rounds=4, clients_per_round=sampler, seed=0, **KW)
    assert h["clip_norm"].is_monotonic_increasing and h["clip_norm"].iloc[-1] > 0.01  # every update was clipped


# (6) a resumed run repeats the noise ----------------------------------------------------------------------
@pytest.mark.parametrize("adaptive", [False, True])
def test_resume_repeats_the_noise(fed40, tmp_path, adaptive):
    kw = dict(noise_multiplier=1.0, clip_norm=0.05, sampling_rate=0.5, adaptive=adaptive, clip_count_stddev=1.0)

    def run(seed=3, **extra):  # a fresh method each time, as in a new process
        method, sampler = dp_fedavg_with_sampler(fed40, **kw)
        return fl.simulate(method, fed40, rounds=4, clients_per_round=sampler, seed=seed, **KW, **extra)

    def crash(r, theta, row):
        if r == 2:
            raise KeyboardInterrupt  # killed after round 2 was checkpointed

    full, ckpt = run(), tmp_path / "run.pt"
    with pytest.raises(KeyboardInterrupt):
        run(checkpoint=ckpt, callback=crash)
    resumed = run(checkpoint=ckpt, resume=True)
    pd.testing.assert_frame_equal(pd.DataFrame(full), pd.DataFrame(resumed))
    assert torch.equal(full.theta, resumed.theta)
    assert not torch.equal(full.theta, run(seed=4).theta)  # the noise is keyed by the seed


# (7) bad inputs give clear errors -------------------------------------------------------------------------
def test_bad_parameters():
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPAggregate(-1.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="sampling_rate"):
        DPAggregate(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="clip_norm"):
        DPAggregate(1.0, 0.0, 0.1)
    with pytest.raises(ValueError, match="estimator"):
        DPAggregate(1.0, 1.0, 0.1, estimator="unbiased")
    with pytest.raises(ValueError, match="accountant='rdp'"):
        DPAggregate(1.0, 1.0, 0.1, sampling="fixed", accountant="pld")
    with pytest.raises(ValueError, match="target_quantile"):
        DPAggregate(1.0, 1.0, 0.1, adaptive=True, target_quantile=1.5)
    with pytest.raises(ValueError, match="clip_count_stddev"):
        DPAggregate(1.0, 1.0, 0.1, adaptive=True, clip_count_stddev=0.2).init_state(torch.zeros(1), 100)
    with pytest.raises(ValueError, match="whole number"):
        DPAggregate(1.0, 1.0, 0.15, sampling="fixed").init_state(torch.zeros(1), 33)
    with pytest.raises(ValueError, match="total_weight"):
        dp_fedavg(example_cap=10)


def test_wrong_sampler_is_refused(fed40):
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.05, sampling_rate=0.1)  # expects ≈ 4 clients a round
    with pytest.raises(ValueError, match="Poisson sampling with q=0.1"):
        fl.simulate(method, fed40, rounds=6, clients_per_round=20, seed=0, **KW)
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.05, sampling_rate=0.25)  # a fixed 10 of 40 a round
    with pytest.raises(ValueError, match="fixed number"):
        fl.simulate(method, fed40, rounds=12, clients_per_round=10, seed=0, **KW)
    fixed = dp_fedavg(noise_multiplier=1.0, clip_norm=0.05, sampling_rate=0.25, sampling="fixed")
    with pytest.raises(ValueError, match="exactly 10 clients"):
        fl.simulate(fixed, fed40, rounds=2, clients_per_round=dp_sampler(0.25, 40), seed=0, **KW)


class _Declared:
    """A custom Poisson sampler that says how it samples (what DP needs of a sampler it cannot inspect)."""
    def __init__(self, q, sampling="poisson"):
        self.sampling, self.sampling_rate = sampling, q

    def __call__(self, r, K, g):
        return np.flatnonzero(g.random(K) < self.sampling_rate)


def test_a_custom_sampler_under_dp_must_declare_the_sampling_before_round_one(fed40):
    method, seen = dp_fedavg(noise_multiplier=1.0, clip_norm=0.05, sampling_rate=0.1), []
    with pytest.raises(ValueError, match="sampling='poisson' and sampling_rate=0.1"):  # says nothing
        fl.simulate(method, fed40, rounds=2, clients_per_round=lambda r, K, g: np.arange(4), seed=0,
                    callback=lambda *a: seen.append(1), **KW)
    with pytest.raises(ValueError, match="declaring \\('poisson', 0.5\\)"):  # says another rate
        fl.simulate(method, fed40, rounds=2, clients_per_round=_Declared(0.5), seed=0,
                    callback=lambda *a: seen.append(1), **KW)
    assert not seen
    h = fl.simulate(method, fed40, rounds=2, clients_per_round=_Declared(0.1), seed=0, **KW)  # says the rule's
    assert h["epsilon"].iloc[-1] == pytest.approx(accounting.epsilon(0.1, 1.0, 2, 1e-5))


def test_unclipped_or_size_weighted_updates_are_refused():
    rule = DPAggregate(1.0, 0.1, 0.1)
    state = rule.init_state(torch.zeros(1), 100)
    with pytest.raises(ValueError, match="ClipUpdates"):
        rule.aggregate(state, torch.ones(10, 4), torch.ones(10), info=info_for(10))
    with pytest.raises(ValueError, match="UniformWeighting or CappedWeighting"):
        rule.aggregate(state, torch.zeros(10, 4), torch.full((10,), 12.0), info=info_for(10))
    with pytest.raises(ValueError, match="info=RoundInfo"):
        rule.aggregate(state, torch.zeros(10, 4), torch.ones(10))
    ctx = type("Ctx", (), {"down": {}})()
    with pytest.raises(ValueError, match="adaptive=True"):
        ClipUpdates(None)(Messages({"delta": torch.ones(2, 3)}, np.arange(2)), {}, ctx)


# (8) History's epsilon column -----------------------------------------------------------------------------
def test_history_epsilon_grows_with_rounds(fed40):
    method, sampler = dp_fedavg_with_sampler(fed40, noise_multiplier=1.0, clip_norm=0.05, sampling_rate=0.25)
    h = fl.simulate(method, fed40, rounds=5, clients_per_round=sampler, seed=0, **KW)
    eps = h["epsilon"].to_numpy()
    assert np.all(np.diff(eps) > 0) and (h["dp_delta"] == 1e-5).all()
    assert eps[-1] == pytest.approx(accounting.epsilon(0.25, 1.0, 5, 1e-5))
    assert (h["clip_norm"] == 0.05).all()


def test_local_dp_reports_the_worst_clients_epsilon(fed40):
    sampler = dp_sampler(0.25, 40)
    h = fl.simulate(local_dp_fedavg(noise_multiplier=2.0, clip_norm=0.05), fed40, rounds=4, clients_per_round=sampler,
                    seed=0, **KW)
    counts = np.zeros(40, int)
    for r in range(4):
        counts[sampler(r, 40, rng(0, SAMPLE, r))] += 1
    assert h["epsilon"].iloc[-1] == pytest.approx(local_epsilon(2.0, int(counts.max()), 1e-5))
    assert h["epsilon"].iloc[-1] > central_epsilon(0.25, 2.0, 4, 1e-5)  # no amplification, sensitivity 2S


def test_a_round_without_the_whole_draw_is_refused_naming_roundinfo_sampled():
    # only the whole draw shows a sampler that rests clients; the aggregated ids alone look like a fair one after drops
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.5)
    info = RoundInfo(0, np.arange(3), torch.ones(3), torch.ones(3), 10, 0.1, None, None, 0)
    with pytest.raises(ValueError, match="RoundInfo.sampled"):
        rule.aggregate(rule.init_state(torch.zeros(4), 10), torch.zeros(3, 4), torch.ones(3), info=info)
