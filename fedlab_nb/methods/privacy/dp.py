"""User-level differential privacy for any federated method: clipping, Gaussian noise and a real accountant.

Central DP — McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models",
ICLR 2018 (arXiv:1710.06963, Algorithm 1, DP-FedAvg). Each round every user is sampled with probability q
(Poisson); a sampled user k clips its update to ‖Δ_k‖ ≤ S and has weight w_k = min(n_k/ŵ, 1) ≤ 1, with
W = Σ_k w_k over all K users. The server releases one of two estimators of the weighted mean, plus noise:

    f̃_f = Σ_{k∈C} w_k Δ_k / (qW)                          sensitivity S/(qW)        σ = z S/(qW)
    f̃_c = Σ_{k∈C} w_k Δ_k / max(qW_min, Σ_{k∈C} w_k)       sensitivity 2S/(qW_min)   σ = 2 z S/(qW_min)

    θ ← θ + f̃ + N(0, σ² I)          (f̃_f: the noise is N(0, (zS)² I) on the weighted sum, divided by qW)

and T rounds are T compositions of the q-subsampled Gaussian mechanism with noise multiplier z, accounted
by `fedlab_nb.methods.privacy.accounting` (Google's dp-accounting: RDP or PLD).

Adaptive clipping — Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive
Clipping", NeurIPS 2021 (arXiv:1905.03871). Each client also sends b_k = 1[‖Δ_k‖ ≤ C]; the server estimates
the unclipped fraction privately, b̄ = (Σ_k (b_k − ½) + N(0, σ_b²)) / (qK) + ½ (the ½ shift makes the count's
sensitivity ½), and moves the clip geometrically, C ← C · exp(−η_C (b̄ − γ)), towards the γ-quantile of the
update norms. The two queries are one Gaussian mechanism with z = (z_Δ⁻² + (2σ_b)⁻²)^(−½), so for a target
z the updates get z_Δ = (z⁻² − (2σ_b)⁻²)^(−½) (default σ_b = qK/20; as in TensorFlow Federated's
`DifferentiallyPrivateFactory.gaussian_adaptive` and TF Privacy's `QuantileEstimatorQuery`).

Local DP — every client clips and adds N(0, (zS)² I) itself (`LocalGaussianNoise`); any two inputs of a client
differ by at most 2S, so each participation is a Gaussian mechanism with noise multiplier z/2, and a client
that took part n times has spent ε(q = 1, z/2, n) — no amplification by sampling, since the client knows it
was sampled and the server sees who sent. `LocalDPAccounting` reports the worst client's ε.

Differences from the paper's Algorithm 1, on purpose: `ClipUpdates` clips the final update once (as
TensorFlow Federated's DP aggregators do) instead of projecting after every local step; both bound ‖Δ_k‖ ≤ S,
so the privacy analysis is the same. Flat (ℓ2 over all tensors) clipping only; per-layer clipping is not here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.stats import binom

from ...core.messages import Messages, Transform
from ...core.streams import register_stream
from ...core.method import weighted_mean
from . import accounting, sampling_tests
from ...engine.sampling import BernoulliSampler, UniformSampler, check_sampled
from ...utils import check_number

CENTRAL_NOISE = register_stream("dp_central_noise", 21)     # the server's Gaussian noise on the update
CLIP_BITS_NOISE = register_stream("dp_clip_bits_noise", 22)  # the noise on the adaptive clip's count

ESTIMATORS = ("fixed", "clipped")
BITS_KEY = "unclipped"   # message entry: b_k = 1[‖Δ_k‖ ≤ C] (adaptive clipping)


# --- clipping ------------------------------------------------------------------------------------------
def clip_rows(updates: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row scaled to ℓ2 norm ≤ clip_norm — π(Δ, S) = Δ · min(1, S/‖Δ‖) —, the rows' norms before)."""
    norms = updates.norm(dim=1)
    scale = torch.clamp(clip_norm / norms.clamp_min(1e-30), max=1.0)
    return updates * scale[:, None], norms


def check_positive(name: str, value, fix: str) -> float:
    return check_number(name, value, 0, fix=fix)


def check_noise(value) -> float:
    """A noise multiplier z: a finite number >= 0 (0: no noise, no privacy)."""
    return check_number("noise_multiplier (z)", value, 0, closed_low=True, fix="0 means no noise and no privacy")


def check_noise_fits(std: float, dtype: torch.dtype, what: str) -> None:
    """Refuse a Gaussian noise std whose draws (up to ~10 σ) overflow `dtype`: the release would be inf, silently."""
    limit = torch.finfo(dtype).max / 10 if dtype.is_floating_point else math.inf
    if not std <= limit:
        raise ValueError(f"the noise std {what} = {std:.3g} overflows the model's {dtype} (at most {limit:.3g}); "
                         "lower noise_multiplier or clip_norm, or raise sampling_rate")


def _check_rate(name: str, value) -> float:
    """A sampling rate q: a finite number in (0, 1]."""
    q = check_number(name, value, 0, fix="a number in (0, 1], the probability a user takes part in a round")
    if q > 1:
        raise ValueError(f"{name} must be a number in (0, 1], the probability a user takes part in a round, "
                         f"got {type(value).__name__} {value!r}")
    return q


def _check_delta(value) -> float:
    return check_number("delta", value, 0, 1, "a number in (0, 1), well below 1/K for K users (e.g. 1e-5)")


@dataclass
class ClipUpdates(Transform):
    """Uplink transform: clip each client's `key` entry (its update Δ_k) to ℓ2 norm ≤ S (flat clipping).

    `clip_norm=None` reads the server's current norm from `ctx.down["clip_norm"]` (adaptive clipping, sent by
    `DPAggregate.broadcast`) and adds the entry "unclipped" = b_k = 1[‖Δ_k‖ ≤ C] to the message."""
    clip_norm: float | None = None
    key: str = "delta"

    def __post_init__(self):
        if self.clip_norm is not None:
            self.clip_norm = check_positive("clip_norm", self.clip_norm, "e.g. ClipUpdates(1.0); None = adaptive")

    def __call__(self, msgs, cstate, ctx):
        adaptive = self.clip_norm is None
        if adaptive and "clip_norm" not in ctx.down:
            raise ValueError("ClipUpdates(clip_norm=None) clips to the server's adaptive norm, but nothing broadcast "
                             "'clip_norm'; use DPAggregate(adaptive=True) as the rule, or give ClipUpdates a clip_norm")
        S = float(ctx.down["clip_norm"]) if adaptive else self.clip_norm
        clipped, norms = clip_rows(msgs[self.key], S)
        msgs.tensors[self.key] = clipped
        if adaptive:
            msgs.tensors[BITS_KEY] = (norms <= S).to(clipped.dtype)
        return msgs, cstate


# --- accounting helpers ----------------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def _epsilon(q: float, z: float, steps: int, delta: float, accountant: str, sampling: str) -> float:
    """`accounting.epsilon`, cached: History asks for it after every round of every run."""
    return accounting.epsilon(q, z, steps, delta, accountant, sampling)


def central_epsilon(q: float, noise_multiplier: float, rounds: int, delta: float, accountant: str = "rdp",
                    sampling: str = "poisson") -> float:
    """ε of DP-FedAvg after `rounds` (user-level). Poisson sampling: add/remove-one neighbours, the sum's
    sensitivity is S, noise multiplier z. Fixed-size sampling: replace-one neighbours (the number of users is
    public), a replaced user moves the sum by up to 2S, so the accountant gets z/2."""
    accounting._check(q, noise_multiplier, rounds, delta, accountant, sampling)  # no silent coercion
    z = noise_multiplier if sampling == "poisson" else noise_multiplier / 2
    return _epsilon(float(q), float(z), int(rounds), float(delta), accountant, sampling)


def local_epsilon(noise_multiplier: float, participations: int, delta: float, accountant: str = "rdp") -> float:
    """ε of one client under local DP after `participations` Gaussian releases of its clipped update with
    noise z·S: two inputs differ by ≤ 2S, so each release has noise multiplier z/2; no sampling amplification."""
    accounting._check(1.0, noise_multiplier, participations, delta, accountant, "poisson")  # no silent coercion
    return _epsilon(1.0, float(noise_multiplier) / 2, int(participations), float(delta), accountant, "poisson")


def adaptive_noise_split(noise_multiplier: float, expected_clients: float,
                         clip_count_stddev: float | None = None) -> tuple[float, float]:
    """(z_Δ for the updates, σ_b for the clip count) so that together they spend a Gaussian mechanism with
    noise multiplier z: z⁻² = z_Δ⁻² + (2σ_b)⁻² (Andrew et al. 2021; σ_b = expected clients / 20 by default)."""
    if noise_multiplier == 0:
        return 0.0, 0.0 if clip_count_stddev is None else float(clip_count_stddev)
    sigma_b = expected_clients / 20 if clip_count_stddev is None else float(clip_count_stddev)
    if not noise_multiplier < 2 * sigma_b:
        raise ValueError(f"adaptive clipping with noise_multiplier={noise_multiplier} needs clip_count_stddev "
                         f"σ_b > z/2 = {noise_multiplier / 2:g}, got σ_b={sigma_b:g} (default: expected clients "
                         f"qK / 20); raise clip_count_stddev, sample more clients or lower noise_multiplier")
    return (noise_multiplier ** -2 - (2 * sigma_b) ** -2) ** -0.5, sigma_b


# --- central DP: the server rule ---------------------------------------------------------------------------
def _aggregated_ids(info, K: int, rows: int) -> np.ndarray:
    """RoundInfo.client_ids checked (a custom server loop builds it by hand): distinct ids in 0 … K-1, one per update
    row aggregated."""
    ids = check_sampled(np.asarray(info.client_ids), K, info.round)
    if len(ids) != rows:
        raise ValueError(f"round {info.round + 1}: {rows} update rows but RoundInfo.client_ids names {len(ids)} "
                         "clients; pass one id per update row")
    return ids


def _round_ids(info, K: int, rows: int) -> np.ndarray:
    """The ids the sampling tests see, checked (a custom server loop builds RoundInfo by hand): the sampler's whole
    draw `info.sampled`, distinct ids in 0 … K-1, with every aggregated client in it. Only a whole draw shows a
    sampler that rests clients or keeps them apart: with the aggregated clients alone it looks like a fair one after
    drops."""
    aggregated = _aggregated_ids(info, K, rows)
    if info.sampled is None:
        raise ValueError(f"round {info.round + 1}: DPAggregate needs the sampler's whole draw as RoundInfo.sampled "
                         "(stragglers and dropped updates included) to check that the sampling is the one its ε "
                         "assumes; pass sampled=<the draw> (simulate, simulate_seeds and Flower pass it)")
    drawn = check_sampled(np.asarray(info.sampled), K, info.round)
    strangers = sorted(set(np.asarray(aggregated).tolist()) - set(np.asarray(drawn).tolist()))
    if strangers:
        raise ValueError(f"round {info.round + 1}: clients {strangers[:5]} were aggregated but are not in the round's "
                         "draw (RoundInfo.sampled); pass the sampler's whole draw as sampled")
    return drawn


@dataclass
class DPAggregate:
    """DP-FedAvg's server side as a stateful rule: the estimator f̃_f ("fixed") or f̃_c ("clipped") of the
    clipped, weighted updates plus Gaussian noise keyed by (seed, stream 21, round), the accountant's ε as
    History columns, and optionally Andrew et al.'s adaptive clip (broadcast as "clip_norm").

    The weights the Method's weighting gives must be w_k ≤ 1 (uniform = 1, or `CappedWeighting`); W is
    `total_weight` (Σ_k w_k over ALL users; None = K, i.e. w_k = 1). Updates must already be clipped to the
    current S (`ClipUpdates` in the uplink), which is checked. The run's sampler must draw each user with
    probability `sampling_rate` (Poisson, `BernoulliSampler(np.full(K, q))`) or exactly round(qK) users
    (`sampling="fixed"`, `UniformSampler`); a mismatch is detected from the round sizes and raises. RoundInfo must
    carry the sampler's whole draw (`sampled`), which the sampling tests read."""
    noise_multiplier: float
    clip_norm: float
    sampling_rate: float
    delta: float = 1e-5
    estimator: str = "fixed"
    total_weight: float | None = None
    min_total_weight: float | None = None
    sampling: str = "poisson"
    accountant: str = "rdp"
    adaptive: bool = False
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    clip_count_stddev: float | None = None
    uses_context = True
    empty_rounds = "noise"  # a round nobody is sampled in still releases θ + N(0, σ²) (engine.server.quiet_round)

    def __post_init__(self):
        self.noise_multiplier = check_noise(self.noise_multiplier)
        self.clip_norm = check_positive("clip_norm", self.clip_norm, "the ℓ2 bound S on each client's update")
        self.sampling_rate = _check_rate("sampling_rate (q)", self.sampling_rate)
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be 'fixed' (f̃_f, denominator qW) or 'clipped' (f̃_c, denominator "
                             f"max(qW_min, Σw_k)), got {self.estimator!r}")
        if self.sampling not in accounting.SAMPLINGS:
            raise ValueError(f"sampling must be one of {accounting.SAMPLINGS}, got {self.sampling!r}")
        if self.sampling == "fixed" and self.accountant != "rdp":
            raise ValueError("sampling='fixed' is accounted by the RDP accountant only; pass accountant='rdp'")
        if self.accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {accounting.ACCOUNTANTS}, got {self.accountant!r}")
        self.delta = _check_delta(self.delta)
        self.clip_lr = check_positive("clip_lr", self.clip_lr, "the adaptive clip's learning rate η_C, e.g. 0.2")
        if self.adaptive:
            check_number("target_quantile (γ)", self.target_quantile, 0, 1, "e.g. 0.5 for the median norm")
        if self.clip_count_stddev is not None:
            check_number("clip_count_stddev (σ_b)", self.clip_count_stddev, 0, closed_low=True,
                         fix="or None (default: expected clients / 20)")
        for name in ("total_weight", "min_total_weight"):
            value = getattr(self, name)
            if value is not None:
                check_positive(name, value, "a total of the users' weights w_k (each ≤ 1)")

    # -- state and what the server sends ------------------------------------------------------------------
    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        W = float(self.total_weight if self.total_weight is not None else num_clients)
        if self.total_weight is None and num_clients < 1:
            raise ValueError("DPAggregate needs at least one user")
        if self.total_weight is not None and self.total_weight > num_clients:
            raise ValueError(f"total_weight W = Σ_k w_k = {self.total_weight} cannot exceed the {num_clients} users "
                             "(each w_k ≤ 1)")
        if self.adaptive:  # fail now, not in round 1, when σ_b is too small for z
            adaptive_noise_split(self.noise_multiplier, self.sampling_rate * num_clients, self.clip_count_stddev)
        if self.sampling == "fixed":
            m = self.sampling_rate * num_clients
            if abs(m - round(m)) > 1e-6 or round(m) < 1:
                raise ValueError(f"sampling='fixed' needs q·K to be a whole number of clients, got q={self.sampling_rate}"
                                 f" and K={num_clients} (qK={m:g}); use q = m/K")
        state = {"clip": float(self.clip_norm), "rounds": 0, "K": int(num_clients), "W": W,
                 "seen_rounds": 0, "seen_clients": 0, "seen_min": 10**9, "seen_max": 0,
                 "seen_each": torch.zeros(int(num_clients), dtype=torch.int64),  # a tensor: checkpoints hold it
                 "seen_tests": sampling_tests.init_state(int(num_clients))}
        check_noise_fits(self.noise_std(state), theta.dtype, self._std_formula)  # fail before round 1, not inf θ
        return state

    @property
    def _std_formula(self) -> str:
        return ("noise_multiplier·clip_norm/(sampling_rate·W)" if self.estimator == "fixed"
                else "2·noise_multiplier·clip_norm/(sampling_rate·W_min)")

    def broadcast(self, state: dict) -> dict:
        return {"clip_norm": torch.tensor(float(state["clip"]))} if self.adaptive else {}

    # -- the noise ------------------------------------------------------------------------------------------
    def update_noise_multiplier(self, num_clients: int) -> float:
        """z for the update query: z itself, or z_Δ when the adaptive clip's count shares the budget."""
        if not self.adaptive:
            return float(self.noise_multiplier)
        return adaptive_noise_split(self.noise_multiplier, self.sampling_rate * num_clients, self.clip_count_stddev)[0]

    def denominator(self, state: dict, weights: torch.Tensor) -> float:
        """qW (f̃_f) or max(qW_min, Σ_{k∈C} w_k) (f̃_c)."""
        q, W = self.sampling_rate, state["W"]
        if self.estimator == "fixed":
            return q * W
        return max(q * self.w_min(state), float(weights.sum()))

    def w_min(self, state: dict) -> float:
        return float(self.min_total_weight if self.min_total_weight is not None else state["W"])

    def noise_std(self, state: dict) -> float:
        """σ of the noise on the released average: z S/(qW) (f̃_f) or 2 z S/(qW_min) (f̃_c) — z·sensitivity."""
        z, S, q = self.update_noise_multiplier(state["K"]), state["clip"], self.sampling_rate
        return z * S / (q * state["W"]) if self.estimator == "fixed" else 2 * z * S / (q * self.w_min(state))

    def aggregate(self, state: dict, deltas: torch.Tensor, weights: torch.Tensor | None, info=None):
        if info is None:
            raise ValueError("DPAggregate draws keyed noise and needs the round's info=RoundInfo (the engine passes "
                             "it because uses_context = True)")
        state = dict(state)
        ids = _round_ids(info, state["K"], len(deltas))  # the sampler's draw, stragglers and dropped updates included
        self._check_sampling(state, len(ids), ids, drawn=True)
        weights = torch.ones(len(deltas), dtype=deltas.dtype, device=deltas.device) if weights is None else weights
        self._check_inputs(state, deltas, weights)
        denom = self.denominator(state, weights)
        agg = (weights.to(deltas.dtype) / denom) @ deltas
        std = self.noise_std(state)
        check_noise_fits(std, agg.dtype, self._std_formula)  # the adaptive clip may have grown since init_state
        if std > 0:
            g = info.generator(CENTRAL_NOISE)
            agg = agg + std * torch.randn(agg.shape, generator=g, dtype=agg.dtype).to(agg.device)
        if self.adaptive:
            state["clip"] = self._next_clip(state, info)
        state["rounds"] = int(info.round) + 1   # rounds elapsed, empty ones included (conservative)
        return agg, state

    def _next_clip(self, state: dict, info) -> float:
        """C ← C · exp(−η_C (b̄ − γ)), b̄ the noised unclipped fraction (Andrew et al. 2021)."""
        msgs = info.messages
        if len(info.client_ids) == 0:  # nobody sampled (or every update dropped): the count is noise alone
            msgs = Messages({BITS_KEY: torch.zeros(0)}, info.client_ids)
        if msgs is None or BITS_KEY not in msgs:
            raise ValueError("adaptive clipping needs each client's clip bit: put ClipUpdates(clip_norm=None) in the "
                             "method's uplink (dp_fedavg(adaptive=True) does)")
        bits = msgs[BITS_KEY].double().cpu()
        expected = self.sampling_rate * state["K"]
        sigma_b = adaptive_noise_split(self.noise_multiplier, expected, self.clip_count_stddev)[1]
        count = float((bits - 0.5).sum())
        if sigma_b > 0:
            g = info.generator(CLIP_BITS_NOISE)
            count += sigma_b * float(torch.randn((), generator=g, dtype=torch.float64))
        unclipped = min(1.0, max(0.0, count / expected + 0.5))
        return float(state["clip"] * math.exp(-self.clip_lr * (unclipped - self.target_quantile)))

    def _check_inputs(self, state, deltas, weights):
        if (weights > 1 + 1e-6).any() or (weights < 0).any():
            raise ValueError(f"DP-FedAvg needs user weights 0 <= w_k <= 1 (got max {float(weights.max()):.4g}): use "
                             "UniformWeighting or CappedWeighting(cap) (w_k = min(n_k/cap, 1)), not data-size weights")
        if self.total_weight is None and not torch.all(weights == 1):
            raise ValueError("weights other than 1 need total_weight = Σ_k w_k over all users (W); pass it "
                             "(dp_fedavg_with_sampler computes it from the federation)")
        norms = deltas.norm(dim=1)
        if len(norms) and float(norms.max()) > state["clip"] * (1 + 1e-4):
            raise ValueError(f"an update has norm {float(norms.max()):.4g} > the clip norm {state['clip']:.4g}: DP needs "
                             "every update clipped first; put ClipUpdates in the method's uplink (dp_fedavg does)")

    def check_sampler(self, sampler, num_clients: int) -> None:
        """Before round 1: refuse a built-in sampler (an int, a fraction or None as clients_per_round, or a
        Bernoulli sampler of other probabilities) that is not the sampling the accountant assumes, since the ε it
        reports would not hold for the run; and a custom sampler that does not declare this sampling (its
        `sampling` and `sampling_rate` attributes). A declared one is also checked from its round sizes and how
        often each client takes part (`_check_sampling`), which needs a few rounds to tell."""
        K, q = int(num_clients), self.sampling_rate
        if isinstance(sampler, BernoulliSampler):
            p = np.asarray(sampler.probabilities, dtype=float)
            same = p.shape == (K,) and bool(np.all(p == q))
            ok, got = same and (self.sampling == "poisson" or q == 1), "Poisson sampling" + (
                f" with q={q}" if same else " with other probabilities")
        elif isinstance(sampler, UniformSampler):
            m = sampler.clients_per_round or K
            ok = (self.sampling == "fixed" and m == round(q * K)) or (q == 1 and m == K)
            got = f"a fixed {m} of the {K} clients every round"
        else:
            said = _declared(sampler)
            ok, got = said == (self.sampling, q), f"a custom sampler declaring {said}"
            if not ok and said == (None, None):
                raise ValueError("clients_per_round: a custom sampler under DP must say how it samples, since the ε "
                                 "the rule reports holds only for its sampling: give it the attributes sampling="
                                 f"{self.sampling!r} and sampling_rate={q} (each client taking part with probability q), "
                                 "or pass dp_sampler(q, K, sampling) as clients_per_round")
        if ok:
            return
        fix = ("build the sampler with dp_sampler(q, K, sampling) — or dp_fedavg_with_sampler(fed, ...) — and pass it "
               "as clients_per_round")
        if self.sampling == "fixed":
            raise ValueError(f"clients_per_round: sampling='fixed' with q={q} expects exactly {round(q * K)} clients a "
                             f"round, but the run uses {got}; the reported ε would not hold: {fix}")
        word = " (a fixed number: use sampling='fixed')" if got.startswith("a fixed") and m == round(q * K) else ""
        raise ValueError(f"clients_per_round: the rule was built for Poisson sampling with q={q} ({q * K:.1f} clients "
                         f"a round on average), but the run uses {got}{word}; the reported ε would not hold: {fix}")

    def _check_sampling(self, state: dict, m: int, ids=(), drawn: bool = False):
        """Raise when the round sizes, or how often one client takes part, cannot come from this rule's sampling
        (q, Poisson or fixed): under either, each client takes part in a round with probability q. `drawn`: the
        ids are the sampler's whole draw (not the clients aggregated after drops), so too few is evidence too."""
        K, q = state["K"], self.sampling_rate
        state["seen_rounds"] += 1
        state["seen_clients"] += m
        state["seen_min"], state["seen_max"] = min(state["seen_min"], m), max(state["seen_max"], m)
        fix = ("build the sampler with dp_sampler(q, K, sampling) — Poisson: BernoulliSampler(np.full(K, q)); "
               "fixed: UniformSampler(round(q*K)) — and pass it as clients_per_round")
        each = state.get("seen_each")
        if not isinstance(each, torch.Tensor) or each.shape != (K,) or each.dtype != torch.int64 \
                or bool((each < 0).any()):
            raise ValueError(f"the DP rule's per-client counts (seen_each) are not {K} counts: the checkpoint was "
                             "altered or written by another version; delete it or pass resume=False")
        each = each.clone()
        each[torch.as_tensor(np.asarray(ids, dtype=np.int64))] += 1  # ids are distinct (the engine checks)
        state["seen_each"], n = each, state["seen_rounds"]
        top = int(each.argmax())
        if q < 1 and int(each[top]) > n * q:  # P(one of K clients in ≥ c of n rounds) below 1e-9 per round
            if binom.sf(int(each[top]) - 1, n, q) * K * n < 1e-9:
                raise ValueError(f"client {top} took part in {int(each[top])} of {n} rounds, but the accountant assumes "
                                 f"each client takes part with probability q={q} (about {n * q:.1f} rounds): the "
                                 "sampler does not pick clients at random and the reported ε would not hold; " + fix)
        # fewer clients than sampled (drop_stragglers, updates dropped as non-finite) keep ε: a subset of a random
        # sample taken independently of the clients' data; only more participation than q breaks the accounting
        if self.sampling == "fixed" and m > round(q * K):
            raise ValueError(f"sampling='fixed' with q={q} expects at most {round(q * K)} clients a round, got {m}; "
                             + fix)
        if self.sampling == "poisson":
            self._check_poisson_sizes(state, m, fix)
        self._check_randomness(state, each, ids, drawn)  # after the rate checks, whose messages say more

    def _check_poisson_sizes(self, state: dict, m: int, fix: str) -> None:
        K, q = state["K"], self.sampling_rate
        n, total = state["seen_rounds"], state["seen_clients"]
        # Poisson: the n rounds' sizes add up to a Binomial(nK, q) count; its exact tail, below 1e-9 per round, so a
        # sampler that takes everyone is refused in round 1 (P = q^K), while a fair one is refused once in 10^9 rounds
        if q < 1 and total > n * K * q and binom.sf(total - 1, n * K, q) * n < 1e-9:
            raise ValueError(f"the rule was built for Poisson sampling with q={q} ({q * K:.1f} clients a round on "
                             f"average) but {n} rounds had {total / n:.1f} on average; " + fix)
        # a fixed-size sampler under Poisson accounting: the same count every round is improbable
        if n >= 10 and state["seen_min"] == state["seen_max"] and q < 1:
            if binom.pmf(m, K, q) ** (n - 1) < 1e-6:
                raise ValueError(f"the Poisson accountant (q={q}) sees exactly {m} clients in each of {n} rounds: the "
                                 f"sampler draws a fixed number; use sampling='fixed' or a Poisson sampler; " + fix)

    def _check_randomness(self, state: dict, each: torch.Tensor, ids, drawn: bool) -> None:
        """Refuse a schedule (a round-robin, a cycle) or clients drawn in groups (`sampling_tests`)."""
        K, q, n = state["K"], self.sampling_rate, state["seen_rounds"]
        tests = state.get("seen_tests")
        if isinstance(tests, dict):  # on the CPU, where a checkpoint loaded onto a GPU may not have left it
            tests = {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in tests.items()}
        sampling_tests.check_state(tests, K)
        each = each.cpu()
        sampling_tests.observe(tests, torch.as_tensor(np.asarray(ids, dtype=np.int64)), each, n, q)
        state["seen_tests"] = tests
        m = round(q * K)
        p2 = q * q if self.sampling == "poisson" else m * (m - 1) / (K * (K - 1)) if K > 1 else 0.0
        why = sampling_tests.refusal(tests, each, n, q, p2)
        if why is None and drawn:  # only a whole draw can be too small: a drop makes a fair one look so
            sizes = (state["seen_min"], state["seen_max"]) if self.sampling == "poisson" else None
            why = sampling_tests.refusal_of_draws(tests, n, K, q, p2, sizes)
        if why:
            raise ValueError(f"the sampler is not random: {why}; build the sampler with dp_sampler(q, K, sampling) "
                             "and pass it as clients_per_round")

    # -- History columns ------------------------------------------------------------------------------------
    def epsilon_after(self, rounds: int) -> float:
        return central_epsilon(self.sampling_rate, self.noise_multiplier, rounds, self.delta, self.accountant,
                               self.sampling)

    def metrics(self, state: dict) -> dict:
        return {"epsilon": self.epsilon_after(state["rounds"]), "dp_delta": float(self.delta),
                "clip_norm": float(state["clip"])}


@dataclass
class CappedWeighting:
    """DP-FedAvg's user weights w_k = min(n_k / cap, 1) (the paper's per-user example cap ŵ): bounded by 1,
    so one user moves the weighted sum by at most S. `cap=None`: w_k = 1 for every user."""
    cap: float | None = None

    def __post_init__(self):
        if self.cap is not None:
            self.cap = check_positive("cap", self.cap, "the per-user example cap ŵ (e.g. the median n_k)")

    def init_state(self, theta, num_clients):
        return {}

    def __call__(self, state, info):
        if self.cap is None:
            return torch.ones_like(info.sizes), state
        return torch.clamp(info.sizes / self.cap, max=1.0), state

    def total(self, sizes) -> float:
        """W = Σ_k w_k over all users, from every user's n_k."""
        n = np.asarray(sizes, dtype=float)
        return float(len(n)) if self.cap is None else float(np.minimum(n / self.cap, 1.0).sum())


def _declared(sampler) -> tuple:
    """What a custom sampler says of its sampling: (sampling, sampling_rate), (None, None) when it says nothing;
    it is still checked against the clients it picks, round by round (`_check_sampling`)."""
    return getattr(sampler, "sampling", None), getattr(sampler, "sampling_rate", None)


def dp_sampler(q: float, num_clients: int, sampling: str = "poisson"):
    """The client sampler the accountant assumes: each user independently with probability q (Poisson), or
    exactly q·K users without replacement ("fixed")."""
    q = _check_rate("dp_sampler's q", q)
    if sampling == "poisson":
        return BernoulliSampler(np.full(int(num_clients), float(q)))
    if sampling == "fixed":
        m = q * num_clients
        if abs(m - round(m)) > 1e-6 or round(m) < 1:
            raise ValueError(f"sampling='fixed' needs q·K to be a whole number, got q={q}, K={num_clients}")
        return UniformSampler(int(round(m)))
    raise ValueError(f"sampling must be one of {accounting.SAMPLINGS}, got {sampling!r}")


# --- local DP ----------------------------------------------------------------------------------------------
@dataclass
class LocalGaussianNoise(Transform):
    """Uplink transform (local DP): each client clips its `key` entry to ℓ2 norm ≤ S and adds N(0, (zS)² I)
    itself, drawn from the transform's keyed generator (`ctx.generator`), before anything leaves the device."""
    clip_norm: float
    noise_multiplier: float
    key: str = "delta"

    def __post_init__(self):
        self.clip_norm = check_positive("clip_norm", self.clip_norm, "the ℓ2 bound S on each client's update")
        self.noise_multiplier = check_noise(self.noise_multiplier)

    def __call__(self, msgs, cstate, ctx):
        clipped, _ = clip_rows(msgs[self.key], self.clip_norm)
        if self.noise_multiplier > 0:
            check_noise_fits(self.noise_multiplier * self.clip_norm, clipped.dtype, "noise_multiplier·clip_norm")
            noise = torch.randn(clipped.shape, generator=ctx.generator, dtype=clipped.dtype).to(clipped.device)
            clipped = clipped + self.noise_multiplier * self.clip_norm * noise
        msgs.tensors[self.key] = clipped
        return msgs, cstate


@dataclass
class LocalDPAccounting:
    """The server side of local DP: the plain weighted mean of the (already noised) updates — post-processing —
    and each client's participation count, so History reports the worst client's ε (`local_epsilon`)."""
    noise_multiplier: float
    delta: float = 1e-5
    accountant: str = "rdp"

    def __post_init__(self):
        self.noise_multiplier = check_noise(self.noise_multiplier)
        self.delta = _check_delta(self.delta)
        if self.accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {accounting.ACCOUNTANTS}, got {self.accountant!r}")

    def init_state(self, theta, num_clients):
        return {"participations": torch.zeros(num_clients, dtype=torch.int64)}

    def aggregate(self, state, deltas, weights, info=None):
        if info is None:
            raise ValueError("LocalDPAccounting counts each client's releases from the round's info=RoundInfo (the "
                             "engine passes it because uses_context = True); pass it from a custom server loop")
        counts = state["participations"].clone()
        ids = _aggregated_ids(info, len(counts), len(deltas))
        counts[torch.as_tensor(ids, dtype=torch.long)] += 1
        return weighted_mean(deltas, weights), {"participations": counts}

    uses_context = True
    empty_rounds = "metrics"  # a round nobody is sampled in spends nothing but still reports ε

    def metrics(self, state):
        n = int(state["participations"].max()) if len(state["participations"]) else 0
        return {"epsilon": local_epsilon(self.noise_multiplier, n, self.delta, self.accountant),
                "dp_delta": float(self.delta)}
