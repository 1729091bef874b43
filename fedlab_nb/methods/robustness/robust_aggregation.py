"""Byzantine-robust federated methods: a robust rule in the `Method` slot, worker momentum, and attacks.

Chapter 2 of the course. A robust method is FedAvg with the weighted mean swapped for a robust rule
(`fedlab_nb.methods.robustness.rules`), uniform weights (a Byzantine client could lie about its n_k), and
optionally worker momentum (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
Optimization", ICML 2021):

    m_k ← β m_k + (1 − β) Δ_k          (kept per client, sent instead of Δ_k)
    v   ← CC(m_1 … m_n; centre v_prev)  (centered clipping around the previous aggregate)
    θ   ← θ + v

Attacks act on what clients *send*: worker momentum is an uplink transform and the engine applies
`simulate(attack=...)` after every uplink transform, so with momentum the omniscient attacks (ALIE, IPM)
read and replace the honest momenta m_k. Label flipping is data poisoning: `flip_client_labels`.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import torch

from ...data.federated import FederatedDataset
from .attacks import ATTACKS, flip_labels, get_attack
from .rules import RULES, centered_clip, gas, get_rule
from ...core.messages import Transform
from ...core.registry import register
from ...core.streams import GAS_SPLIT
from .poison import LabelFlip
from ...engine import simulate
from ...utils import rng
from ...core.method import LocalObjective, Method, ServerSGD, UniformWeighting


# --- stateful rules ----------------------------------------------------------------------------------
@register("centered_clipping", claims="centered_clipping", kind="module")
@dataclass
class CenteredClipping:
    """Centered clipping with the previous aggregate as the centre (the paper's v^{t−1}; v^0 = 0):
    L = `iters` times  v ← v + (1/n) Σ_i (m_i − v) · min(1, τ / ‖m_i − v‖)."""
    tau: float = 1.0
    iters: int = 3

    def __post_init__(self):
        if not self.tau > 0 or self.iters < 1:
            raise ValueError(f"CenteredClipping needs tau > 0 and iters >= 1, got tau={self.tau}, iters={self.iters}")

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"center": torch.zeros_like(theta)}

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None):
        v = centered_clip(updates, weights, center=state["center"], tau=self.tau, iters=self.iters)
        return v, {"center": v}


@register("gas", claims="gas", kind="module")
@dataclass
class GradientSplitting:
    """GAS(base rule) with a fresh random coordinate split each round, keyed by (seed, round) so a run
    is reproducible and resumable (the state is just the round counter)."""
    base_rule: str = "coordinate_median"
    p: int = 64
    f: int = 0
    seed: int = 0

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"round": 0}

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None):
        g = torch.Generator().manual_seed(int(rng(self.seed, GAS_SPLIT, state["round"]).integers(2**62)))
        agg = gas(updates, weights, base_rule=self.base_rule, p=self.p, f=self.f, generator=g)
        return agg, {"round": state["round"] + 1}


@register("flag_aggregator", claims="flag_aggregator", kind="module")
def robust_rule(name: str, f: int = 0, *, tau: float = 1.0, iters: int = 3, p: int = 64, seed: int = 0,
                **hyper):
    """A rule for the `Method.rule` slot from a name, with the Byzantine count f passed where a rule uses it.

    Names: every key of `fedlab_nb.methods.robustness.rules.RULES` (krum / multi_krum / bulyan get `f`; trimmed_mean
    gets beta = f/n unless given), plus "cc" → `CenteredClipping(tau, iters)` (stateful) and
    "gas_<base>" (e.g. "gas_krum", "gas_median") → `GradientSplitting(base, p, f, seed)`."""
    if name in ("cc", "centered_clip", "centered_clipping"):
        return CenteredClipping(tau, iters)
    if name.startswith("gas_"):
        base = name[4:]
        if base not in RULES:
            raise ValueError(f"rule {name!r}: unknown GAS base rule {base!r}; use gas_<name> with <name> in "
                             f"{sorted(RULES)}")
        return GradientSplitting(base, p, f, seed)
    if name in ("krum", "multi_krum", "bulyan", "gas"):
        hyper.setdefault("f", f)
    if name == "trimmed_mean" and "beta" not in hyper:
        return _TrimByCount(f)
    return get_rule(name, **hyper)


@dataclass
class _TrimByCount:
    """Trimmed mean that cuts f values from each side (β = f/n, the usual choice when f is known)."""
    f: int

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        n = updates.shape[0]
        return get_rule("trimmed_mean", beta=min(self.f / n + 1e-9, 0.49))(updates, weights)


# --- worker momentum -----------------------------------------------------------------------------------
@dataclass
class WorkerMomentum(Transform):
    """Uplink transform: each client sends its momentum m_k ← β m_k + (1 − β) Δ_k instead of Δ_k
    (Karimireddy et al. 2021, Alg. 2, with Δ_k in place of the stochastic gradient). m_k is the client's
    store entry, kept across rounds for every client. The engine's attack runs after every uplink
    transform, so omniscient attacks (ALIE, IPM) read the honest momenta."""
    beta: float = 0.9

    def __post_init__(self):
        if not 0 <= self.beta < 1:
            raise ValueError(f"worker momentum beta must be in [0, 1), got {self.beta}")

    def client_state(self, theta: torch.Tensor) -> dict:
        return {"m": torch.zeros_like(theta)}

    def __call__(self, msgs, cstate, ctx):
        m = self.beta * cstate["m"] + (1 - self.beta) * msgs["delta"]
        msgs.tensors["delta"] = m
        return msgs, {"m": m}


@register("robust", claims="robust_aggregation")
def robust_method(rule: str = "mean", f: int = 0, *, momentum: float = 0.0, seed: int = 0, server_lr: float = 1.0,
                  **rule_hyper) -> Method:
    """FedAvg with a robust rule, uniform weights and optional worker momentum (an uplink transform), e.g.
    `robust_method("cc", f=4, momentum=0.9, tau=0.5)`. Attacks are `simulate(attack=..., byzantine=...)`."""
    agg = robust_rule(rule, f, seed=seed, **rule_hyper)
    uplink = (WorkerMomentum(momentum),) if momentum else ()
    name = rule + (f"+wm{momentum:g}" if momentum else "")
    return Method(name, LocalObjective(), UniformWeighting(), agg, ServerSGD(lr=server_lr), uplink=uplink)


# --- attacks ---------------------------------------------------------------------------------------------
class LabelFlippedDataset(FederatedDataset):
    """A copy of a `FederatedDataset` whose Byzantine clients train on flipped labels y → C − 1 − y.

    Honest clients share the original tensors; test sets are untouched. The flip is re-applied when the
    copy is moved to another device (`to` re-materialises the client tensors)."""

    def __init__(self, fed: FederatedDataset, byzantine):
        self.__dict__.update(fed.__dict__)
        self.byzantine = tuple(sorted(int(b) for b in byzantine))
        bad = [b for b in self.byzantine if not 0 <= b < fed.num_clients]
        if bad:
            raise ValueError(f"byzantine ids {bad} are not clients of this federation (0 … {fed.num_clients - 1})")
        self.client_train = list(fed.client_train)
        self._flip()

    def _flip(self):
        for k in self.byzantine:
            x, y = self.client_train[k]
            self.client_train[k] = (x, flip_labels(y, self.num_classes))

    def _materialise(self):
        super()._materialise()
        self._flip()


def flip_client_labels(fed: FederatedDataset, byzantine) -> LabelFlippedDataset:
    """A copy of `fed` where clients `byzantine` flip labels, for code that reads the data directly;
    `simulate(..., poison=fedlab_nb.methods.robustness.poison.LabelFlip(byzantine, C))` does the same without a copy."""
    return LabelFlippedDataset(fed, byzantine)


def honest_sampler(byzantine, num_clients: int):
    """A sampler that takes every honest client each round (the "honest-only mean" reference run)."""
    honest = np.setdiff1d(np.arange(num_clients), np.asarray(list(byzantine), dtype=int))
    return lambda round, K, g: honest


ATTACK_NAMES = ("none", "label_flip", *[a for a in ATTACKS if a != "none"])
DEFAULT_ATTACK_HYPER = {"sign_flip": {"scale": 4.0}, "gaussian_noise": {"std": 1.0}, "ipm": {"epsilon": 0.1}}


def run_attack(rule: str, attack: str, fed: FederatedDataset, byzantine, *, f: int | None = None,
               momentum: float = 0.0, rule_hyper: dict | None = None, attack_hyper: dict | None = None,
               seed: int = 0, **simulate_kwargs):
    """One robustness run: `rule` aggregates all clients while `byzantine` ones mount `attack`.

    rule "honest_mean" is the reference: the plain mean over the honest clients only (the attack is
    ignored). attack: "none", "label_flip" or a name in `fedlab_nb.methods.robustness.attacks.ATTACKS` (hyper from
    `attack_hyper`, else `DEFAULT_ATTACK_HYPER`). Other keywords go to `simulate` (all clients take part
    every round unless `clients_per_round` is given). A run the attack blows up (NaN updates) is not an
    error here: `on_nonfinite="drop"` keeps the last finite model, whose accuracy records the collapse."""
    byzantine = tuple(int(b) for b in byzantine)
    f = len(byzantine) if f is None else f
    simulate_kwargs.setdefault("clients_per_round", None)
    simulate_kwargs.setdefault("progress", False)
    simulate_kwargs.setdefault("on_nonfinite", "drop")
    if attack not in ATTACK_NAMES:
        raise ValueError(f"attack must be one of {ATTACK_NAMES}, got {attack!r}")
    if rule == "honest_mean":
        method = robust_method("mean", momentum=momentum, seed=seed)
        simulate_kwargs["clients_per_round"] = honest_sampler(byzantine, fed.num_clients)
        return simulate(method, fed, seed=seed, **simulate_kwargs)
    model_attack, poison = None, None
    if attack == "label_flip":  # data poisoning through the engine's hook: no copy of the data set
        poison = LabelFlip(byzantine, fed.num_classes)
    elif attack != "none":
        hyper = attack_hyper if attack_hyper is not None else DEFAULT_ATTACK_HYPER.get(attack, {})
        model_attack = get_attack(attack, **hyper)
    method = robust_method(rule, f, momentum=momentum, seed=seed, **(rule_hyper or {}))
    return simulate(method, fed, seed=seed, attack=model_attack, byzantine=byzantine if model_attack else (),
                    poison=poison, **simulate_kwargs)
