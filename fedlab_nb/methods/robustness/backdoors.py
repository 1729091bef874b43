"""Backdoors in federated learning: a pixel-pattern trigger planted by data poisoning or by model replacement,
and the existing aggregation rules against them.

- The trigger: Gu, Dolan-Gavitt, Garg, "BadNets: Identifying Vulnerabilities in the Machine Learning Model Supply
  Chain", 2017 (arXiv:1708.06733) — a fixed pixel pattern stamped on training images relabelled as the target
  class (`poison.PixelTrigger`; its `asr` column is measured on the triggered global test images whose
  true class is not the target, at every evaluation).
- Model replacement: Bagdasaryan, Veit, Hua, Estrin, Shmatikov, "How To Backdoor Federated Learning", AISTATS 2020
  (arXiv:1807.00459; code github.com/ebagdasa/backdoor_federated_learning). With G ← G + (η/m) Σ_i (L_i − G) the
  attacker who trained a backdoored model X sends L̃ = G + γ (X − G), γ = m / η (split over a colluding
  attackers: γ = m / (η a), as the official code divides its scale by the number of adversaries), so that

      G' = X + (η/m) Σ_{benign i} (L_i − G)  ≈ X   once the benign updates are small (a converged model).

  Single-shot: the attacker takes part in one round; repeated: in every round. Here the boost is the message
  attack `robustness.attacks.scaled`, the backdoored training is the `PixelTrigger` poison.
- Norm clipping: Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor Federated Learning?", 2019
  (arXiv:1911.07963): the server clips every update to ‖Δ_k‖ ≤ M, Δ_k ← Δ_k / max(1, ‖Δ_k‖ / M), averages, and
  ("weak DP") may add N(0, σ² I) to the aggregate. `NormClipping` is that rule (per-update clipping, as the paper
  writes it; the TFF research code `aggregate_fn.build_aggregate_and_clip` clips the aggregate instead).

The other rules are the library's: FedAvg (the uniform mean, so that γ = m / η is exact), coordinate median,
Krum (`robust_aggregation.robust_method`) and FLTrust with a server root set (`fedcpa.fltrust_method`), both
in this chapter.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch

from ...core.registry import register
from ...core.streams import register_stream
from ...engine import simulate
from ...models import load_flat
from ...utils import check_number
from .poison import PixelTrigger, model_replacement_scale
from ..privacy.dp import clip_rows
from .attacks import get_attack
from ...core.method import LocalObjective, Method, ServerSGD, UniformWeighting, weighted_mean
from .fedcpa import fltrust_method
from .robust_aggregation import robust_method

WEAK_DP_NOISE = register_stream("backdoor_weak_dp", 74)   # the server's Gaussian noise of Sun et al.'s weak DP

RULE_NAMES = ("fedavg", "median", "krum", "fltrust", "norm_clip")
ATTACK_NAMES = ("none", "poison_once", "replacement", "repeated")


# --- norm clipping (Sun et al. 2019) ----------------------------------------------------------------------
@dataclass
class NormClipping:
    """Server rule: every update clipped to ‖Δ_k‖ ≤ `bound` (M), then the weighted mean, plus N(0, `noise`² I)
    when noise > 0 (weak DP; keyed by (seed, stream 74, round)). `bound=math.inf` is the plain mean. Logs the
    round's median update norm, its largest norm and the fraction of clipped updates."""
    bound: float
    noise: float = 0.0
    uses_context = True

    def __post_init__(self):
        if not self.bound > 0:
            raise ValueError(f"bound (the norm M each update is clipped to) must be > 0, got {self.bound}; "
                             "math.inf clips nothing")
        self.noise = check_number("noise (the weak-DP standard deviation σ)", self.noise, 0, closed_low=True,
                                  fix="0 for none")

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"norm_median": math.nan, "norm_max": math.nan, "clipped": math.nan}

    def aggregate(self, state: dict, updates: torch.Tensor, weights, info=None):
        clipped, norms = clip_rows(updates, self.bound)
        agg = weighted_mean(clipped, weights)
        if self.noise > 0:
            if info is None:
                raise ValueError("NormClipping with noise > 0 needs the round's RoundInfo (info=) for its keyed noise")
            agg = agg + self.noise * torch.randn(agg.shape, generator=info.generator(WEAK_DP_NOISE),
                                                 dtype=agg.dtype).to(agg.device)
        stats = {"norm_median": float(norms.median()), "norm_max": float(norms.max()),
                 "clipped": float((norms > self.bound).double().mean())}
        return agg, stats

    def metrics(self, state: dict) -> dict:
        return dict(state)


def norm_clipping_method(bound: float, noise: float = 0.0, server_lr: float = 1.0) -> Method:
    """FedAvg's local training, uniform weights, `NormClipping(bound, noise)` on the server."""
    name = "norm_clip" if noise == 0 else f"norm_clip+dp{noise:g}"
    return Method(name, LocalObjective(), UniformWeighting(), NormClipping(bound, noise), ServerSGD(lr=server_lr))


# --- who takes part, and the boost --------------------------------------------------------------------------
@dataclass(frozen=True)
class AttackerSampler:
    """Every benign client takes part in every round; the `attackers` join only in `attack_rounds` (0-based;
    None: every round). Single-shot replacement is `attack_rounds=(r,)`."""
    attackers: tuple
    attack_rounds: tuple | None = None

    def __call__(self, round: int, num_clients: int, g: np.random.Generator) -> np.ndarray:
        benign = np.setdiff1d(np.arange(num_clients), np.asarray(self.attackers, dtype=int))
        if self.attack_rounds is None or round in self.attack_rounds:
            return np.union1d(benign, np.asarray(self.attackers, dtype=int))
        return benign


def replacement_boost(clients_in_round: int, attackers: int = 1, server_lr: float = 1.0) -> float:
    """γ each of `attackers` colluding clients multiplies its update by: m / (η · a) (Bagdasaryan et al.)."""
    if attackers < 1:
        raise ValueError(f"attackers must be >= 1, got {attackers}")
    return model_replacement_scale(clients_in_round, server_lr) / attackers


# --- the defences of the notebook ---------------------------------------------------------------------------
def root_set(fed, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FLTrust's clean server data: `size` rows drawn (keyed by seed) from the clients' held-out local test splits,
    which no client trains on and which are disjoint from the global test set."""
    x = torch.cat([x for x, _ in fed.client_test])
    y = torch.cat([y for _, y in fed.client_test])
    if not 0 < size <= len(y):
        raise ValueError(f"size (FLTrust's root rows) must be in 1 … {len(y)} (the clients' held-out rows), got {size}")
    rows = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:size]
    return x[rows], y[rows]


def defence(name: str, *, model, fed, seed: int, f: int = 1, norm_bound: float = 1.0, noise: float = 0.0,
            root_size: int = 100, root_lr: float = 0.1, batch_size: int = 16) -> Method:
    """One of `RULE_NAMES` as a Method with uniform client weights (so the boost γ = m / η is exact for FedAvg)."""
    if name == "fedavg":
        return robust_method("mean")
    if name == "median":
        return robust_method("coordinate_median")
    if name == "krum":
        return robust_method("krum", f=f)
    if name == "fltrust":
        return fltrust_method(model, root_set(fed, root_size, seed), lr=root_lr, batch_size=batch_size)
    if name == "norm_clip":
        return norm_clipping_method(norm_bound, noise)
    raise ValueError(f"unknown defence {name!r}; valid: {', '.join(RULE_NAMES)}")


@dataclass(frozen=True)
class MeasureOnly:
    """A poison that changes nothing but still reports the trigger's `asr`: the "no attack" reference."""
    trigger: PixelTrigger

    @property
    def clients(self) -> tuple:
        return self.trigger.clients

    def __call__(self, k, rnd, x, y, generator):
        return x, y

    def evaluate(self, model, theta, fed) -> dict:
        return self.trigger.evaluate(model, theta, fed)


@dataclass(frozen=True)
class LongerTraining:
    """The attackers' local training made `repeat` times longer: their rows are tiled `repeat` times, each copy
    poisoned independently by `trigger`, so the run's E local epochs become E · repeat passes over their data
    (Bagdasaryan et al. train the attacker for E = 6 local epochs against E = 2 for the benign clients)."""
    trigger: PixelTrigger
    repeat: int = 3

    def __post_init__(self):
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or self.repeat < 1:
            raise ValueError(f"repeat (how many times longer the attackers train) must be an int >= 1, got {self.repeat!r}")

    @property
    def clients(self) -> tuple:
        return self.trigger.clients

    def __call__(self, k, rnd, x, y, generator):
        copies = [self.trigger(k, rnd, x, y, generator) for _ in range(self.repeat)]
        return torch.cat([c[0] for c in copies]), torch.cat([c[1] for c in copies])

    def evaluate(self, model, theta, fed) -> dict:
        return self.trigger.evaluate(model, theta, fed)


# --- one run ---------------------------------------------------------------------------------------------------
@register("backdoors", claims="backdoors", kind="module")
def backdoor_run(method: Method, attack: str, fed, model: torch.nn.Module, theta_start: torch.Tensor,
                 trigger: PixelTrigger, *, rounds: int = 10, attack_round: int = 1, attacker_repeat: int = 1,
                 **simulate_kwargs):
    """`rounds` rounds of `method` from the global model `theta_start` while `trigger.clients` mount `attack`:

    - "none": the attackers are honest (they train on clean data every round);
    - "poison_once": they train on triggered data in `attack_round` only and send that update as it is
      (plain data poisoning, the paper's baseline);
    - "replacement": the same single shot, boosted by γ = m / (η a) (model replacement);
    - "repeated": triggered data and the boost in every round.

    `attacker_repeat`: the attackers train that many times longer (`LongerTraining`). Every benign client
    takes part in every round (`AttackerSampler`). History has `test_acc` (clean accuracy)
    and `asr` at every round; `n_sampled` shows when the attackers took part."""
    if attack not in ATTACK_NAMES:
        raise ValueError(f"attack must be one of {ATTACK_NAMES}, got {attack!r}")
    if not 0 <= attack_round < rounds:
        raise ValueError(f"attack_round must be in 0 … rounds − 1 = {rounds - 1}, got {attack_round}")
    attackers = tuple(trigger.clients)
    once = attack in ("poison_once", "replacement")
    sampler = AttackerSampler(attackers, (attack_round,) if once else None)
    poison = MeasureOnly(trigger) if attack == "none" else LongerTraining(trigger, attacker_repeat)
    boost = None
    if attack in ("replacement", "repeated"):
        lr = method.server_opt.lr
        boost = get_attack("scaled", scale=replacement_boost(fed.num_clients, len(attackers), lr))
    start = load_flat(copy.deepcopy(model), theta_start)   # every run starts from the same global model
    simulate_kwargs.setdefault("progress", False)
    return simulate(method, fed, start, rounds=rounds, clients_per_round=sampler, poison=poison, attack=boost,
                    byzantine=attackers if boost is not None else (), **simulate_kwargs)
