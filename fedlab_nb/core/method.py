"""The parts a federated method is composed of, and the contract between a method and the engine.

    broadcast ─► client update (tracks of local training: init → steps → final) ─► message + client state
      ─► uplink transforms ─► server: weighting ─► (normalisation) ─► rule ─► server optimiser ─► θ

Each part is a small object with an optional `init_state` and pure tensor functions. Server state lives
in one dict the engine checkpoints; per-client state lives in the client store (`engine.store`), for
all K clients, and is handed to the parts as a batch `{name: [m, ...]}` of the round's clients. A method
is a `Method(...)` of parts, not a subclass tree. This module imports nothing from the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np
import torch

from ..utils import check_number, rng
from .groups import ParamGroups, ResolvedGroups
from .messages import Messages
from .optim import SGD, Adam, make_optimizer
from .round import LocalJob


@dataclass
class RoundInfo:
    """What the server knows about one round when it aggregates (the rules' round context)."""
    round: int
    client_ids: np.ndarray          # sampled clients that returned a message, [m]
    sizes: torch.Tensor             # their local data sizes n_k, [m] float
    steps: torch.Tensor             # local steps each took τ_k, [m] float
    num_clients: int                # K, all clients in the federation
    lr: float                       # client step size η
    theta: torch.Tensor | None = None     # the broadcast global parameters
    messages: Messages | None = None      # every entry the clients sent (rankings, variates, statistics ...)
    seed: int = 0                         # the run's seed: server-side draws use rng(seed, stream, round) (DP noise)
    sampled: np.ndarray | None = None     # every client the sampler drew, stragglers and dropped updates too

    def generator(self, stream: int) -> torch.Generator:
        """A torch generator keyed by (seed, stream, round): server randomness that a resumed run repeats."""
        return torch.Generator(device="cpu").manual_seed(int(rng(self.seed, stream, self.round).integers(2**62)))


# --- the hooks a part may define: declared here, found with isinstance (a part needs no base class) ------
@runtime_checkable
class StatefulRule(Protocol):
    """A rule object that keeps state across rounds (CenteredClipping, DP's accountant): the engine keeps its
    `init_state` in the server state (checkpointed) and calls `aggregate` instead of the rule itself."""

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        """The rule's server state before the first round."""

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None,
                  **context) -> tuple[torch.Tensor, dict]:
        """(aggregate [d], new state) of the round's [m, d] updates; `info=` too when it `UsesContext`."""


@runtime_checkable
class UsesContext(Protocol):
    """A rule with `uses_context = True` also gets the round's `RoundInfo` as `info=` (in `aggregate`, or when
    called as a function): the broadcast θ, every message entry, the round's keyed generator."""
    uses_context: bool


@runtime_checkable
class Broadcasts(Protocol):
    """A stateful rule that sends tensors to every sampled client with θ (an adaptive clip norm the uplink
    transforms read from `ctx.down`)."""

    def broadcast(self, state: dict) -> dict:
        """{name: tensor} from the rule's state, added to what the server broadcasts."""


@runtime_checkable
class Reports(Protocol):
    """A part (objective, weighting, rule, server optimiser) that adds columns to the round's History row."""

    def metrics(self, state: dict) -> dict:
        """{column: float} from the part's state after the round (an accountant's ε)."""


@runtime_checkable
class ActsInEmptyRounds(Protocol):
    """A rule that acts in a round without client updates: `empty_rounds = "noise"` releases its noised aggregate
    of Δ = 0 (DP), "metrics" reports its columns only (an accountant); None leaves θ and the row as they are."""
    empty_rounds: str | None


@runtime_checkable
class ChecksSampler(Protocol):
    """A rule whose guarantee holds only under one client sampling (DP's accountant): `simulate` and `to_flower`
    call `check_sampler` before round 1, and it raises if the run's sampler is not the one it assumes."""

    def check_sampler(self, sampler, num_clients: int) -> None:
        """Raise a ValueError naming clients_per_round when `sampler` is not the sampling the rule assumes."""


_DECLARED: dict = {}


def declares(part, hooks: type) -> bool:
    """isinstance(part, hooks) for one of the hook Protocols above, remembered per class: a part declares its hooks
    in its class body (a rule function is a plain rule), and a Protocol check costs ~25 µs, several per round."""
    key = (type(part), hooks)
    if key not in _DECLARED:
        _DECLARED[key] = isinstance(part, hooks)
    return _DECLARED[key]


# --- local objectives ------------------------------------------------------------------------------
@dataclass
class LocalObjective:
    """Plain local ERM (FedAvg): the client step direction is ∇f_k(w; batch).

    Subclasses add a gradient term through `correction(w, anchor, ctx)` — a pure function of the local
    weights w, the broadcast weights (anchor) and a per-client context row, so the same code runs per
    client (`loop`) or vmapped over clients (`vmap`). Per-client state: `client_state` (defaults of the
    store entries), `context` (the ctx rows from broadcast + state), `finish` (what the client adds to its
    message and its new state after training), `server_update` (the server's bookkeeping).

    `extra_loss`: None, or a method `extra_loss(model, params, x, y, anchor, ctx) -> [B]` of per-row loss
    terms added (as their batch mean) to the client's loss before differentiation, for terms that are not
    a gradient correction of w (MOON's contrastive loss on representations). `params`: name → tensor (the
    local weights), `anchor`/`ctx`: as in `correction`. Written with torch.func it runs in both kernels."""
    vmappable = True   # False: the correction or extra loss cannot run under torch.func.vmap (loop backend)
    extra_loss = None  # None, or the method `extra_loss(model, params, x, y, anchor, ctx) -> [B]` above

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        """The objective's server state (SCAFFOLD's c)."""
        return {}

    def client_state(self, theta: torch.Tensor) -> dict:
        """Defaults of the objective's per-client store entries (SCAFFOLD's c_k)."""
        return {}

    def broadcast(self, state: dict) -> dict:
        """Extra server tensors sent to every sampled client (SCAFFOLD's c)."""
        return {}

    def context(self, down: dict, cstate: dict) -> torch.Tensor | None:
        """Per-client tensor [m, d] fed to `correction` (None: no correction)."""
        return None

    def correction(self, w: torch.Tensor, anchor: torch.Tensor, ctx: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient term added to ∇f_k(w) at every local step (None: none)."""
        return None

    def finish(self, deltas: torch.Tensor, down: dict, cstate: dict, steps: torch.Tensor, lr: float) -> tuple[dict, dict]:
        """(extra message entries {name: [m, ...]}, new client state) once local training is done; `lr` is the
        clients' step size (`client_lr`)."""
        return {}, cstate

    def server_update(self, state: dict, msgs: Messages, info: RoundInfo) -> dict:
        """The objective's server bookkeeping after the round's messages arrive (SCAFFOLD's c)."""
        return state


# --- weighting -------------------------------------------------------------------------------------
@dataclass
class DataSizeWeighting:
    """p_k ∝ n_k over the clients of the round (FedAvg)."""

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {}

    def __call__(self, state: dict, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        return info.sizes, state


@dataclass
class UniformWeighting(DataSizeWeighting):
    """p_k = 1/m: every participating client counts the same."""

    def __call__(self, state: dict, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        return torch.ones_like(info.sizes), state


# --- rules -----------------------------------------------------------------------------------------
def weighted_mean(updates: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w_k Δ_k / Σ_k w_k over the rows of the [m, d] update matrix."""
    if weights is None:
        return updates.mean(0)
    if (weights < 0).any() or weights.sum() <= 0:
        raise ValueError("aggregation weights must be non-negative with a positive sum")
    return (weights / weights.sum()) @ updates


# --- server optimisers -----------------------------------------------------------------------------
@dataclass
class ServerSGD:
    """θ ← θ + η_g v with v ← βv + Δ̄ (β = 0: FedAvg; β > 0: FedAvgM, Hsu et al. 2019)."""
    lr: float = 1.0
    momentum: float = 0.0

    def __post_init__(self):
        check_number("the server's lr (server_lr / ServerSGD(lr=...))", self.lr, 0, fix="e.g. server_lr=1.0")
        check_number("the server's momentum (ServerSGD(momentum=...))", self.momentum, 0, fix="e.g. momentum=0.9",
                     closed_low=True)

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"v": torch.zeros_like(theta)} if self.momentum else {}

    def step(self, theta: torch.Tensor, update: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        if self.momentum:
            state = {"v": self.momentum * state["v"] + update}
            update = state["v"]
        return theta + self.lr * update, state


@dataclass
class ServerAssign:
    """θ ← the rule's output itself (for rules that return the new model, e.g. FRL's voted scores, rather
    than an update to add): exact, no θ + (θ' − θ) rounding."""

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {}

    def step(self, theta: torch.Tensor, update: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        return update.to(theta.dtype), state


@dataclass
class ServerKeep:
    """θ stays where it is (methods that share no weights: Local-only, FedProto)."""

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {}

    def step(self, theta: torch.Tensor, update: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        return theta, state


# --- the client update -----------------------------------------------------------------------------
@dataclass
class Track:
    """One stretch of local training inside a client update: which objective, which optimiser, which
    tensors move, and how many steps (`None`: the run's schedule, E epochs or `local_steps`; an int: that
    many mini-batch steps, e.g. Ditto's personal steps; `epochs`: that many passes instead, e.g. FedRep's
    head epochs then body epochs)."""
    name: str = "w"
    objective: LocalObjective = field(default_factory=LocalObjective)
    optimizer: SGD | Adam = field(default_factory=SGD)
    groups: ParamGroups | None = None   # None: the method's groups
    steps: int | None = None
    epochs: int | None = None           # passes over the local data (overrides the run's E / local_steps)


@dataclass(frozen=True, kw_only=True)
class LocalContext:
    """What a client update's own training sees of the run (`OwnTraining.local_train`, and
    `ClientUpdate.personal_at_evaluation`): the loss, the kernel, the step size, the seed, the parameter groups
    and the federation's data — never the engine's round setup, so an engine change does not reach the methods."""
    lr: float                          # the clients' step size, `client_lr(method.optimizer, run lr)`: the one route
    loss_fn: Callable                  # loss(w_flat, x, y) of the run's model and criterion; `.model`: the module
    fed: object                        # the federation (fedlab_nb.data): classes, clients, every client's rows
    round: int = 0
    seed: int = 0
    kernel: Callable | None = None     # the run's local-training kernel (loop / vmap / fused), called by `train`
    backend: str = "loop"              # its name: "loop" | "vmap" | "fused"
    optimizer: SGD | Adam = field(default_factory=SGD)   # the method's client optimiser
    groups: ResolvedGroups | None = None                 # the method's parameter groups, resolved on the model
    batch_size: int = 32               # the run's schedule, for a method that draws its own batches
    local_epochs: int = 1
    local_steps: int | None = None
    poisoned: frozenset = frozenset()  # clients whose training rows a data poison rewrites

    @property
    def model(self) -> torch.nn.Module:
        return self.loss_fn.model

    def train(self, theta: torch.Tensor, jobs: list[LocalJob], objective: LocalObjective, *,
              start: torch.Tensor | None = None, groups: ResolvedGroups | None = None, loss_fn: Callable | None = None):
        """(W [m, d], mean losses [m]): the run's kernel trains `jobs` from `start` (θ for every client when None),
        anchored at θ, with the client optimiser at `lr`; `groups` and `loss_fn` default to the run's."""
        return self.kernel(loss_fn or self.loss_fn, theta, jobs, self.lr, objective, start=start,
                           optimizer=self.optimizer, groups=self.groups if groups is None else groups, weights=True)


class ClientUpdate:
    """The client side of a round as a pure triple, FedJAX-style, over the batch of the round's clients:

        start(track, θ, down, cstate, done) → W₀ [m, d]           (init: from the broadcast and own state)
        the engine's local steps on each track (loop or vmap, the same result)
        finish(done, θ, down, cstate, steps, lr) → (message entries, new cstate)   (final)

    A method whose local training is not a sequence of optimiser steps on the flat parameters subclasses
    `OwnTraining` and writes `local_train(method, ctx, jobs, down, cstate)` instead.

    This default is one track "w" from θ: the FedAvg family (objective, client optimiser and parameter
    groups taken from the `Method`). Kept-local tensors start from the client's stored copy and are
    stored back; the message is Δ = w − θ on the sent tensors plus the objective's extra entries."""
    trains_at_evaluation = False  # True: the engine calls `personal_at_evaluation` at every evaluation, also
    #                               without client state (FedAvg-FT fine-tunes every client with the run's kernel)
    local_buffers = False         # True: the model's buffers (BatchNorm statistics) are kept per client in the
    #                               store entry "buffers" (FedBN) instead of the global ones
    nan_marker_entries: tuple = ()  # message entries whose rows may be all NaN by design ("no value yet", PGFed's
    #                               first-round a rows): the round's finiteness check accepts an all-NaN row there

    def tracks(self, method: "Method") -> list[Track]:
        """The stretches of local training the engine runs, in order (Ditto: "w", then the personal "v")."""
        return [Track("w", method.objective, method.optimizer, method.groups)]

    def client_state(self, method: "Method", theta: torch.Tensor, groups) -> dict:
        """Defaults of the client update's per-client store entries, for all K clients."""
        state = {f"objective.{k}": v for k, v in method.objective.client_state(theta).items()}
        if groups.local:
            state["local"] = theta[groups.index("local", theta.device)].clone()
        return state

    def start(self, track: Track, theta: torch.Tensor, down: dict, cstate: dict, done: dict, groups,
              m: int) -> torch.Tensor | None:
        """The rows local training starts from; None means θ for every client (the kernel repeats it)."""
        if "local" not in cstate:
            return None
        W = theta.repeat(m, 1)
        W[:, groups.index("local", theta.device)] = cstate["local"]
        return W

    def finish(self, done: dict, theta: torch.Tensor, down: dict, cstate: dict, steps: torch.Tensor, lr: float,
               method: "Method", groups) -> tuple[dict, dict]:
        """(message entries {name: [m, ...]}, new client state) from each track's trained rows `done`."""
        W = done["w"]
        new = dict(cstate)
        if groups.local:
            new["local"] = W[:, groups.index("local", W.device)].clone()
        deltas = W.sub_(theta)  # in place: one [m, d] buffer, as large rounds need
        obj_state = {k[len("objective."):]: v for k, v in cstate.items() if k.startswith("objective.")}
        extra, obj_state = method.objective.finish(deltas, down, obj_state, steps, lr)
        new.update({f"objective.{k}": v for k, v in obj_state.items()})
        if not groups.everything_sent:
            deltas = deltas[:, groups.index("sent", deltas.device)]
        return {"delta": deltas, **extra}, new

    def personal(self, method: "Method", theta: torch.Tensor, cstate: dict, groups) -> torch.Tensor | None:
        """Each client's own model [K, d] from the full store batch, or None (the global model is everyone's)."""
        if not groups.local:
            return None
        W = theta.repeat(len(cstate["local"]), 1)
        W[:, groups.index("local", theta.device)] = cstate["local"].to(theta.device)
        return W

    def personal_at_evaluation(self, method: "Method", theta: torch.Tensor, cstate: dict, ctx: LocalContext,
                               down: dict) -> torch.Tensor | None:
        """Each client's own model [K, d] at an evaluation when `trains_at_evaluation`: it may train every client
        with `ctx` (FedAvg-FT) or read what the server broadcasts, `down` (IFCA's k models)."""
        return self.personal(method, theta, cstate, ctx.groups)


class OwnTraining(ClientUpdate):
    """A client update whose local training is its own, not optimiser steps on the tracks (FRL's edge-popup on
    rankings, pFedMe's inner problem ...). It still gets the engine's batch schedules, store, transforms, rule
    and evaluation, and trains through `ctx.train` (the run's kernel) or by hand."""

    def local_train(self, method: "Method", ctx: LocalContext, jobs: list[LocalJob], down: dict,
                    cstate: dict) -> tuple[dict, dict, torch.Tensor]:
        """(message entries {name: [m, ...]}, new client state, mean local losses [m]) of the round's clients:
        `jobs` are their data and batch schedules, `down` the broadcast, `cstate` their store rows."""
        raise NotImplementedError(f"{type(self).__name__} subclasses OwnTraining: write its local_train")


# --- the composition -------------------------------------------------------------------------------
@dataclass
class Method:
    """A federated method = client update (local objective, client optimiser, parameter groups) + uplink
    transforms + weighting + (normalisation) + rule + server optimiser.

    `normalisation(updates, weights, steps) -> (updates, scale)` rescales updates before the rule and the
    aggregate after it (FedNova). `rule(updates, weights)` is any function on the [m, d] matrix, e.g. the
    robust rules in `fedlab_nb.methods.robustness.rules`, or an object with the declared hooks above: state
    (`StatefulRule`), the round's `RoundInfo` (`UsesContext`), a broadcast (`Broadcasts`), a noised empty round
    (`ActsInEmptyRounds`). Any part's `metrics` (`Reports`) adds columns to the round's History row."""
    name: str = "fedavg"
    objective: LocalObjective = field(default_factory=LocalObjective)
    weighting: DataSizeWeighting = field(default_factory=DataSizeWeighting)
    rule: Callable = weighted_mean
    server_opt: ServerSGD = field(default_factory=ServerSGD)
    normalisation: Callable | None = None
    optimizer: SGD | Adam | str | None = None        # client optimiser (None: plain SGD at the run's lr)
    groups: ParamGroups = field(default_factory=ParamGroups)
    uplink: tuple = ()                                # Transforms applied to messages, in order
    downlink: tuple = ()                              # server → client steps on the broadcast θ (compression)
    client: ClientUpdate = field(default_factory=ClientUpdate)
    aggregate_key: str = "delta"                      # the message entry weighting/rule/server step act on
    flower_compatible = True   # False: not a sequence of Flower rounds (fedlab_nb.flower refuses it); not a field

    def __post_init__(self):
        self.optimizer = make_optimizer(self.optimizer)
        self.uplink = tuple(self.uplink)
        self.downlink = tuple(self.downlink)

    @property
    def empty_rounds(self) -> str | None:
        """What a round without updates does (`ActsInEmptyRounds`; None for any other rule)."""
        return self.rule.empty_rounds if declares(self.rule, ActsInEmptyRounds) else None

    @property
    def vmappable(self) -> bool:
        return all(t.objective.vmappable for t in self.client.tracks(self))

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        parts = {"objective": self.objective, "weighting": self.weighting, "server_opt": self.server_opt}
        if declares(self.rule, StatefulRule):
            parts["rule"] = self.rule
        parts.update({f"downlink{i}": t for i, t in enumerate(self.downlink)})
        return {k: p.init_state(theta, num_clients) for k, p in parts.items()}

    def broadcast(self, state: dict, theta: torch.Tensor) -> dict:
        """What the server sends each sampled client: θ, the objective's and a stateful rule's shared tensors."""
        down = {"theta": theta, **self.objective.broadcast(state["objective"])}
        if declares(self.rule, Broadcasts) and "rule" in state:
            down.update(self.rule.broadcast(state["rule"]))
        return down

    def round_metrics(self, state: dict) -> dict:
        """Extra History columns after a round: every part's `metrics(its state)` (e.g. DP's epsilon)."""
        parts = {"objective": self.objective, "weighting": self.weighting, "rule": self.rule, "server_opt": self.server_opt}
        out = {}
        for name, part in parts.items():
            if declares(part, Reports) and name in state:
                out.update(part.metrics(state[name]))
        return out

    def client_state(self, theta: torch.Tensor, groups) -> dict:
        """Defaults of every per-client store entry (client update's, then each uplink transform's)."""
        state = self.client.client_state(self, theta, groups)
        for i, t in enumerate(self.uplink):
            state.update({f"uplink{i}.{k}": v for k, v in t.client_state(theta).items()})
        return state

    def aggregate(self, state: dict, deltas, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        """The server side of a round after local training: Δ's (a tensor or `Messages`) in, the aggregate out."""
        if isinstance(deltas, Messages):
            deltas = deltas[self.aggregate_key]
        weights, state["weighting"] = self.weighting(state["weighting"], info)
        scale = 1.0
        if self.normalisation is not None:
            deltas, scale = self.normalisation(deltas, weights, info.steps)
        context = {"info": info} if declares(self.rule, UsesContext) and self.rule.uses_context else {}
        if declares(self.rule, StatefulRule):
            agg, state["rule"] = self.rule.aggregate(state["rule"], deltas, weights, **context)
        else:
            agg = self.rule(deltas, weights, **context)
        return scale * agg, state

    def server_step(self, state: dict, theta: torch.Tensor, agg: torch.Tensor) -> tuple[torch.Tensor, dict]:
        theta, state["server_opt"] = self.server_opt.step(theta, agg, state["server_opt"])
        return theta, state
