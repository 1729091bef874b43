"""The round loop (`simulate`): sample → broadcast → client update → uplink transforms (attack) →
aggregate → server step → evaluate, with atomic per-round checkpoints and exact resume.

All randomness is keyed by (seed, stream, round, client) (`core.streams`), so a resumed run, or the same
run on the other backend, draws the same clients and the same mini-batches without saving generator state.
The engine imports the contract layer (`fedlab_nb.core`), data and models — never `fedlab_nb.methods`."""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..core.messages import Messages, TransformContext, dense_bytes
from ..core.method import ChecksSampler, ClientUpdate, LocalContext, Method, OwnTraining, RoundInfo, declares
from ..core.optim import client_lr
from ..core.round import DataPoison, ScoredPoison
from ..core.streams import ATTACK, BATCHES, DOWNLINK, POISON, SAMPLE, STRAGGLE, TRANSFORM
from ..data.federated import FederatedDataset
from ..models import flatten_buffers, flatten_params, load_buffers, make_model, param_spec
from ..utils import check_loss, check_positive_int, check_seed, rng
from . import batched
from .checkpoint import (CheckpointError, checkpoint_path, data_fingerprint, fingerprint, load_checkpoint,
                         save_checkpoint)
from .client import LocalJob, batch_schedule, make_loss, train_clients_loop
from .evaluate import Evaluator, evaluate  # noqa: F401  (evaluate: public name of the engine)
from .history import History
from .sampling import check_sampled, make_sampler
from .rows import RoundRows
from .store import ClientStore


class NonFiniteUpdateError(FloatingPointError, ValueError):
    """A client returned NaN/inf; the message names the client and round. Also a ValueError: a bad value a client
    sent, like the Flower adapter's other refusals of a reply."""


@dataclass(kw_only=True)
class RunConfig:
    """A run's settings, keyword-only (RunConfig(rounds=30, lr=0.1)): a positional list of thirteen values
    silently shifts when a field is added."""
    rounds: int = 20
    clients_per_round: int | float | None = None
    local_epochs: int = 1
    local_steps: int | None = None      # fixed number of local steps instead of epochs
    batch_size: int = 32
    lr: float = 0.05
    seed: int = 0
    eval_every: int = 1
    stragglers: float = 0.0             # fraction of clients that, each round, do only a random part of their work
    drop_stragglers: bool = False       # drop stragglers' updates (the FedAvg baseline of FedProx's experiments)
    backend: str = "auto"               # "loop" | "vmap" | "fused" | "auto" (fused, else vmap, else loop; conv on CPU: loop)
    on_nonfinite: str = "raise"         # "raise" | "drop"
    byzantine: tuple = ()               # ids of Byzantine clients (their messages go through `attack`)

    def validate(self, num_clients: int | None = None):
        check_positive_int("rounds", self.rounds)
        check_positive_int("local_epochs", self.local_epochs)
        check_positive_int("batch_size", self.batch_size)
        check_positive_int("eval_every", self.eval_every)
        check_seed(self.seed)
        if self.local_steps is not None:
            check_positive_int("local_steps", self.local_steps)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float, np.floating)) or not self.lr > 0:
            raise ValueError(f"lr must be a number > 0 (e.g. lr=0.05), got {self.lr!r}")
        cpr = self.clients_per_round
        if isinstance(cpr, bool) or not (cpr is None or isinstance(cpr, (int, float, np.integer, np.floating))):
            raise ValueError(f"clients_per_round must be an int (clients), a fraction in (0, 1], None (all) or a "
                             f"sampler callable, got {cpr!r}")
        if not isinstance(self.stragglers, (int, float)) or not 0 <= self.stragglers <= 1:
            raise ValueError(f"stragglers is a fraction in [0, 1], got {self.stragglers!r}")
        if self.backend not in ("loop", "vmap", "fused", "auto"):
            raise ValueError(f"backend must be 'loop', 'vmap', 'fused' or 'auto', got {self.backend!r}")
        if self.on_nonfinite not in ("raise", "drop"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'drop', got {self.on_nonfinite!r}")
        if num_clients is not None:
            bad = [b for b in self.byzantine if not 0 <= b < num_clients]
            if bad:
                raise ValueError(f"byzantine ids {bad} are not clients of this federation; use ids in 0 … {num_clients - 1}")


def byzantine_ids(byzantine) -> tuple:
    """Byzantine client ids as a sorted tuple of ints; floats, bools or duplicates are refused by name."""
    ids = list(byzantine)
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise ValueError(f"byzantine must be client ids (ints), got {b!r} in {ids!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"byzantine lists a client twice: {ids!r}")
    return tuple(sorted(int(b) for b in ids))


# --- the work of one round ----------------------------------------------------------------------------
def local_job(fed: FederatedDataset, k: int, cfg: RunConfig, rnd: int, ctx: torch.Tensor | None,
              steps: int | None = None, track: int = 0, epochs: int | None = None,
              poison: DataPoison | None = None) -> LocalJob:
    """Client k's work in round `rnd`: its data (rewritten by the run's `poison` if k is one of its clients) and
    its batch schedule keyed by (seed, BATCHES, rnd, k); a straggler (`cfg.stragglers`) does only a random prefix
    of it (systems heterogeneity). A method's extra training track (`track` > 0, e.g. Ditto's personal steps)
    gets its own keyed schedule; `epochs` (a track's own passes, e.g. FedRep's head epochs) replaces the run's
    E and local_steps."""
    x, y = fed.client_train[k]
    if poison is not None and k in poison.clients:  # data poisoning: this round's rows of this client, keyed
        x, y = poison(k, rnd, x, y, rng(cfg.seed, POISON, rnd, k))
    g = rng(cfg.seed, BATCHES, rnd, k) if track == 0 else rng(cfg.seed, BATCHES, rnd, k, track)
    steps = steps or (None if epochs else cfg.local_steps)
    batches = batch_schedule(len(y), cfg.batch_size, epochs or cfg.local_epochs, steps, g)
    if cfg.stragglers and track == 0 and k in _stragglers(fed.num_clients, cfg, rnd):
        batches = batches[: int(g.integers(1, len(batches) + 1))]
    return LocalJob(int(k), x, y, batches, ctx)


def _stragglers(num_clients: int, cfg: RunConfig, rnd: int) -> set:
    """The clients that straggle in round `rnd`: a fixed fraction of all clients, keyed by (seed, round)."""
    g = rng(cfg.seed, STRAGGLE, rnd)
    return set(g.choice(num_clients, int(round(cfg.stragglers * num_clients)), replace=False).tolist())


def _local_jobs(fed, client_ids, cfg: RunConfig, rnd: int, ctx, steps=None, track: int = 0,
                epochs=None, poison: DataPoison | None = None) -> list[LocalJob]:
    return [local_job(fed, k, cfg, rnd, None if ctx is None else ctx[i], steps, track, epochs, poison)
            for i, k in enumerate(client_ids)]


def choose_backend(cfg: RunConfig, method: Method, model: torch.nn.Module | None = None,
                   device: str | torch.device = "cpu") -> str:
    """The backend a run uses, chosen here only: the fused step where it applies (backend='auto'/'fused': plain
    SGD of the library's MLP or logistic regression), else vmap where the method and the model allow it
    ('auto'/'vmap'), else the loop. 'auto' trains a conv net on a CPU on the loop (`auto_backend`). Models with
    buffers (BatchNorm running statistics, updated in place) train on the loop."""
    if cfg.backend == "loop":
        return "loop"
    buffers = model is not None and next(model.buffers(), None) is not None
    if method.vmappable and not buffers:
        return "vmap" if cfg.backend == "vmap" else auto_backend(model, device) if cfg.backend == "auto" else "fused"
    if cfg.backend in ("vmap", "fused"):
        why = "a model with buffers (BatchNorm)" if buffers else method.name
        print(f"note: {why} cannot run on the vmap backend; falling back to loop")
    return "loop"


def auto_backend(model: torch.nn.Module | None, device: str | torch.device = "cpu") -> str:
    """What backend='auto' picks for a method that vmaps: the loop for a conv net on a CPU (there the loop beat
    vmap 1.15-1.33x on every CNN workload of benchmarks/bench_pfl.py, 2026-12-07), else the fused step (which
    runs vmap where the fused step does not apply)."""
    convolutional = model is not None and any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
    return "loop" if convolutional and torch.device(device).type == "cpu" else "fused"


def kernel(backend: str):
    """The local-training kernel of a backend name."""
    return {"loop": train_clients_loop, "vmap": batched.train_clients_vmap, "fused": batched.train_clients_fused}[backend]


@dataclass
class RoundSetup:
    """What every round of a run shares (built once by `simulate`, or by the Flower apps)."""
    method: Method
    fed: FederatedDataset
    cfg: RunConfig
    loss_fn: Callable
    groups: object          # core.groups.ResolvedGroups
    train: Callable         # the kernel: train_clients_loop, train_clients_vmap or train_clients_fused
    rows: RoundRows = field(default_factory=RoundRows)  # each track's rows matrix, reused across rounds
    backend: str = "loop"   # the kernel's name (`choose_backend`), recorded in the History's meta
    poison: DataPoison | None = None   # the run's data poison (`simulate(poison=...)`)

    @property
    def lr(self) -> float:
        """The clients' step size (`core.optim.client_lr`): what `finish`, `RoundInfo` and `LocalContext` get."""
        return client_lr(self.method.optimizer, self.cfg.lr)


def local_context(s: RoundSetup, r: int) -> LocalContext:
    """What a method's own training sees of round r (`core.method.LocalContext`), instead of the setup."""
    return LocalContext(lr=s.lr, loss_fn=s.loss_fn, fed=s.fed, round=r, seed=s.cfg.seed, kernel=s.train,
                        backend=s.backend, optimizer=s.method.optimizer, groups=s.groups, batch_size=s.cfg.batch_size,
                        local_epochs=s.cfg.local_epochs, local_steps=s.cfg.local_steps,
                        poisoned=frozenset() if s.poison is None else frozenset(s.poison.clients))


def client_round(s: RoundSetup, r: int, ids, down: dict, cstate: dict):
    """The client side of round r for clients `ids` (the pure triple of `core.method.ClientUpdate`):
    start → local steps on each track → finish. Returns (message entries, new client state, losses, jobs)."""
    method, theta, m = s.method, down["theta"], len(ids)
    cu, done, losses, first = method.client, {}, None, None
    if isinstance(cu, OwnTraining):  # a method whose local training is its own (FRL's edge-popup on rankings)
        jobs = round_jobs(s, r, ids)
        entries, new, losses = cu.local_train(method, local_context(s, r), jobs, down, cstate)
        return entries, new, losses, jobs
    bufs = _round_buffers(s, cstate, m, theta)
    for t, track in enumerate(cu.tracks(method)):
        same = track.groups is None or track.groups == method.groups
        groups = s.groups if same else track.groups.resolve(s.groups.spec)
        obj_state = {k[len("objective."):]: v for k, v in cstate.items() if k.startswith("objective.")}
        ctx = track.objective.context(down, obj_state)
        jobs = round_jobs(s, r, ids, ctx, track.steps, t, track.epochs)
        W0 = cu.start(track, theta, down, cstate, done, groups, m)
        done[track.name], l = s.train(s.loss_fn, theta, jobs, s.cfg.lr, track.objective, start=W0,
                                      optimizer=track.optimizer, groups=groups, weights=True,
                                      out=s.rows.take(track.name, m, theta), **bufs)
        if first is None:
            losses, first = l, jobs
    if bufs and "buffers" not in cstate:  # global running statistics: the size-weighted mean of the clients'
        sizes = torch.tensor([float(len(j.y)) for j in first], device=theta.device, dtype=theta.dtype)
        rows = bufs["buffers"]
        mean = (sizes / sizes.sum()) @ rows
        same = (rows == rows[0]).all(0)  # buffers no client changed (frozen weights) stay bit-exact, no mean rounding
        mean[same] = rows[0, same]
        load_buffers(s.loss_fn.model, mean)
    entries, new = finish_clients(s, done, theta, down, cstate, first)
    return entries, new, losses, first


def round_jobs(s: RoundSetup, r: int, ids, ctx=None, steps=None, track: int = 0, epochs=None) -> list[LocalJob]:
    """The round's clients' work on one track (`local_job`), with the run's data poison."""
    return _local_jobs(s.fed, ids, s.cfg, r, ctx, steps, track, epochs, s.poison)


def finish_clients(s: RoundSetup, done: dict, theta: torch.Tensor, down: dict, cstate: dict, jobs) -> tuple[dict, dict]:
    """The client update's `finish` (final) on the trained rows `done`: (message entries, new client state)."""
    steps = torch.tensor([float(len(j.batches)) for j in jobs], device=theta.device)
    return s.method.client.finish(done, theta, down, cstate, steps, s.lr, s.method, s.groups)


def round_info(s: RoundSetup, r: int, ids, jobs, theta: torch.Tensor, msgs: Messages, sampled=None) -> RoundInfo:
    """What the server knows about round r when it aggregates (sizes and steps in θ's float dtype); `sampled`:
    every client the sampler drew, when stragglers were left out of `ids`."""
    fdt = theta.dtype if theta.is_floating_point() else None  # float64 runs weight in float64
    sizes = torch.tensor([float(len(j.y)) for j in jobs], device=theta.device, dtype=fdt)
    steps = torch.tensor([float(len(j.batches)) for j in jobs], device=theta.device, dtype=fdt)
    return RoundInfo(r, np.asarray(ids), sizes, steps, s.fed.num_clients, s.lr, theta, msgs, s.cfg.seed,
                     np.asarray(ids if sampled is None else sampled))


def _round_buffers(s: RoundSetup, cstate: dict, m: int, theta: torch.Tensor) -> dict:
    """{"buffers": [m, b]}: the flat model buffers (BatchNorm running statistics) the round's clients train
    with — their own (store entry "buffers", `ClientUpdate.local_buffers`) or copies of the global ones (the
    model's); {} for models without buffers."""
    if "buffers" in cstate:
        return {"buffers": cstate["buffers"]}
    model = getattr(s.loss_fn, "model", None)
    if model is None or next(model.buffers(), None) is None:
        return {}
    return {"buffers": flatten_buffers(model, theta.dtype).to(theta.device).repeat(m, 1)}


def personal_models(s: RoundSetup, r: int, theta: torch.Tensor, store: ClientStore, state: dict | None = None) -> tuple:
    """(personal models [K, d] or None, per-client buffers [K, b] or None) for evaluation after round r.
    A client update that `trains_at_evaluation` gets `personal_at_evaluation` with the round's `LocalContext`
    (FedAvg-FT trains every client) and what the server broadcasts (IFCA's k models)."""
    cu = s.method.client
    plain = type(cu).personal is ClientUpdate.personal and not s.groups.local  # the global model is everyone's
    if plain and "buffers" not in store.defaults and not cu.trains_at_evaluation:
        return None, None  # no copy of the whole store (SCAFFOLD's K × d variates) just to find nothing personal
    full = store.all(theta.device) if store else {}
    if cu.trains_at_evaluation:
        down = s.method.broadcast(state, theta)
        personal = cu.personal_at_evaluation(s.method, theta, full, local_context(s, r), down)
    else:
        personal = cu.personal(s.method, theta, full, s.groups) if store else None
    buffers = full.get("buffers")
    if buffers is not None and personal is None:
        personal = theta.repeat(s.fed.num_clients, 1)
    return personal, buffers


def uplink(s: RoundSetup, r: int, msgs: Messages, cstate: dict, byz: torch.Tensor, attack, theta, down=None) -> tuple:
    """The method's uplink transforms in order, then the attack on the Byzantine clients' messages (the one
    place attacks happen). Returns (messages, new client state)."""
    for i, transform in enumerate(s.method.uplink):
        prefix = f"uplink{i}."
        own = {k[len(prefix):]: v for k, v in cstate.items() if k.startswith(prefix)}
        g = torch.Generator(device="cpu").manual_seed(int(rng(s.cfg.seed, TRANSFORM, r, i).integers(2**62)))
        ctx = TransformContext(r, msgs.client_ids, byz, g, theta, down or {"theta": theta}, s.cfg.on_nonfinite)
        msgs, own = transform(msgs, own, ctx)
        cstate = {**cstate, **{prefix + k: v for k, v in own.items()}}
    if attack is not None and byz.any():
        gen = torch.Generator(device="cpu").manual_seed(int(rng(s.cfg.seed, ATTACK, r).integers(2**62)))
        key = s.method.aggregate_key
        msgs.tensors[key] = attack(msgs[key], byz, generator=gen)
    return msgs, cstate


def downlink(s: RoundSetup, r: int, state: dict, down: dict) -> tuple[dict, dict, int]:
    """The method's downlink steps on the broadcast θ (each keeps its server state in `state["downlink{i}"]`);
    returns (what the clients receive, state, measured bytes of θ's payload per client)."""
    theta_bytes = dense_bytes({"theta": down["theta"]})
    for i, step in enumerate(s.method.downlink):
        g = torch.Generator(device="cpu").manual_seed(int(rng(s.cfg.seed, DOWNLINK, r, i).integers(2**62)))
        received, state[f"downlink{i}"], theta_bytes = step(down["theta"], state[f"downlink{i}"], g)
        down = {**down, "theta": received}
    return down, state, int(theta_bytes)


def run_round(s: RoundSetup, state: dict, theta: torch.Tensor, store: ClientStore, ids, r: int, attack, byz_all,
              sampled=None):
    """One round after sampling (`sampled`: the draw, `ids` without its stragglers); returns (θ, state, row
    entries: train_loss, bytes_up, bytes_down)."""
    dev = theta.device
    down = s.method.broadcast(state, theta)
    down, state, theta_bytes = downlink(s, r, state, down)
    cstate = store.gather(ids, dev)
    entries, cstate, losses, jobs = client_round(s, r, ids, down, cstate)
    msgs = Messages(entries, np.asarray(ids))
    byz = byz_all[torch.as_tensor(np.asarray(ids), device=byz_all.device)].to(dev)
    msgs, cstate = uplink(s, r, msgs, cstate, byz, attack, theta, down)
    if cstate:
        store.scatter(ids, cstate)
    info = round_info(s, r, ids, jobs, theta, msgs, sampled)
    others = dense_bytes({k: v for k, v in down.items() if k != "theta"})
    wire = {"bytes_up": int(msgs.wire_bytes().sum()), "bytes_down": len(ids) * (theta_bytes + others)}
    theta, state, loss = server_update(s.method, state, theta, info, msgs, losses, s.cfg.on_nonfinite, s.groups)
    return theta, state, {"train_loss": loss, **wire, **s.method.round_metrics(state)}


def nan_markers(method: Method) -> frozenset:
    """The message entries whose rows may be all NaN by design, a "no value yet" mark the server replaces (the
    client update's `nan_marker_entries`, e.g. PGFed's first-round a rows); a partly NaN or an inf row is still
    refused."""
    return frozenset(method.client.nan_marker_entries)


def finite_rows(msgs: Messages, key: str, markers: frozenset = frozenset()) -> tuple[torch.Tensor, list]:
    """([m] bool: the clients whose every floating message entry is finite, the names of the entries with a
    non-finite row). The aggregated entry and every other one (SCAFFOLD's delta_c, ...): a NaN in a secondary
    entry would otherwise enter the server's state and blame innocent clients a round later. In an entry of
    `markers` a row that is NaN throughout is a mark, not a fault."""
    m = len(msgs.client_ids)
    keep = torch.ones(m, dtype=torch.bool, device=msgs[key].device if key in msgs else None)
    where = []
    for name in [key] + sorted(n for n in msgs.tensors if n != key):
        t = msgs.tensors.get(name)
        if m == 0 or not torch.is_tensor(t) or not t.is_floating_point() or t.dim() == 0 or len(t) != m:
            continue  # rankings, counts, masked integers: nothing can be NaN
        rows = t.reshape(m, -1)
        ok = torch.isfinite(rows.sum(1))  # one pass, no [m, d] temporaries (1,000 clients × 200k params)
        if not ok.all():  # a row sum can overflow with finite entries: check those rows entry by entry
            bad = (~ok).nonzero().ravel()
            ok[bad] = torch.isfinite(rows[bad]).all(1) | (name in markers and torch.isnan(rows[bad]).all(1))
        if not ok.all():
            where.append(name)
            keep &= ok.to(keep.device)
    return keep, where


def server_update(method: Method, state: dict, theta: torch.Tensor, info: RoundInfo, msgs, losses: torch.Tensor,
                  on_nonfinite: str = "raise", groups=None):
    """The server half of a round — non-finite check, the objective's bookkeeping, aggregation, server step;
    returns (θ, state, size-weighted train loss). Shared with the Flower strategy. `msgs`: `Messages`
    (or a bare [m, d] Δ matrix)."""
    key = method.aggregate_key
    if not isinstance(msgs, Messages):
        msgs = Messages({key: msgs}, np.asarray(info.client_ids))
    keep, where = finite_rows(msgs, key, nan_markers(method))
    if not keep.all():
        bad = [int(k) for k in info.client_ids[~keep.cpu().numpy()]]
        if on_nonfinite == "raise":
            what = "update" if where == [key] else "message (entr" + ("y " if len(where) == 1 else "ies ") + \
                ", ".join(repr(w) for w in where) + ")"
            raise NonFiniteUpdateError(f"round {info.round + 1}: client(s) {bad} returned a non-finite {what} (NaN/inf). "
                                       f"Lower lr (now {info.lr}), check the data, or pass on_nonfinite='drop' "
                                       "to drop such updates")
        if not keep.any():
            if method.empty_rounds == "noise":  # DP: a noised release even now
                theta, state, _ = quiet_round(method, state, theta, info, groups)
            return theta, state, float("nan")
        msgs = msgs.select(keep)
        info = replace(info, client_ids=info.client_ids[keep.cpu().numpy()], sizes=info.sizes[keep],
                       steps=info.steps[keep], messages=msgs)
        losses = losses[keep]
    state["objective"] = method.objective.server_update(state["objective"], msgs, info)
    agg, state = method.aggregate(state, msgs[key], info)
    if groups is not None and not groups.everything_sent:  # only the sent tensors move on the server
        agg = theta.new_zeros(theta.numel()).index_copy_(0, groups.index("sent", theta.device), agg)
    theta, state = checked_step(method, state, theta, agg, info, on_nonfinite)
    sizes = info.sizes
    if on_nonfinite == "drop":  # a client an uplink transform left out for a non-finite update (secure aggregation)
        left_out = torch.as_tensor(~np.isin(info.client_ids, msgs.client_ids), device=losses.device)
        gone = ~torch.isfinite(losses) & left_out
        sizes, losses = sizes[~gone], losses[~gone]
    return theta, state, float((sizes @ losses) / sizes.sum())


def checked_step(method: Method, state: dict, theta: torch.Tensor, agg: torch.Tensor, info: RoundInfo,
                 on_nonfinite: str = "raise"):
    """The server step; with on_nonfinite="raise" a θ it makes non-finite (a rule's 0/0, an exponent that
    overflows) is an error naming the method and the round, never released to the next round's clients (who
    would be blamed for it). With "drop" (an attack allowed to blow the model up) θ is released as before."""
    theta, state = method.server_step(state, theta, agg)
    if on_nonfinite == "raise" and not bool(torch.isfinite(theta).all()):
        raise NonFiniteUpdateError(f"round {info.round + 1}: the server step of {method.name!r} made θ non-finite "
                                   "(NaN/inf) from finite client updates; check the method's parameters (a step size "
                                   "or an exponent too large for the model's dtype)")
    return theta, state


def quiet_round(method: Method, state: dict, theta: torch.Tensor, info: RoundInfo, groups=None):
    """A round without client updates (nobody sampled, or every update dropped); returns (θ, state, History
    columns). A rule with `empty_rounds = "noise"` (DPAggregate) still releases its noised aggregate of Δ = 0,
    as McMahan et al. 2018 (Algorithm 1) do, so every round its accountant counts is a noised one; one with
    `empty_rounds = "metrics"` (an accountant) reports its columns; any other rule leaves θ and the row as they are."""
    mode = method.empty_rounds
    if mode is None:
        return theta, state, {}
    if mode == "noise":
        sent = groups is not None and not groups.everything_sent
        width = groups.index("sent", theta.device).numel() if sent else theta.numel()
        ids, none = np.empty(0, dtype=np.int64), theta.new_zeros(0)
        msgs = Messages({method.aggregate_key: theta.new_zeros(0, width)}, ids)
        info = replace(info, client_ids=ids, sizes=none, steps=none, theta=theta, messages=msgs)
        state["objective"] = method.objective.server_update(state["objective"], msgs, info)
        agg, state = method.aggregate(state, msgs[method.aggregate_key], info)
        if sent:
            agg = theta.new_zeros(theta.numel()).index_copy_(0, groups.index("sent", theta.device), agg)
        theta, state = checked_step(method, state, theta, agg, info)
    return theta, state, method.round_metrics(state)


def empty_info(s: RoundSetup, r: int, theta: torch.Tensor, sampled=None) -> RoundInfo:
    """The RoundInfo of round r when no client was sampled (or every one drawn, `sampled`, was a straggler)."""
    none, nobody = theta.new_zeros(0), np.empty(0, dtype=np.int64)
    return RoundInfo(r, nobody, none, none, s.fed.num_clients, s.lr, theta, None, s.cfg.seed,
                     nobody if sampled is None else np.asarray(sampled))


# --- the run ------------------------------------------------------------------------------------------
def build_model(model, fed: FederatedDataset, seed: int, model_kwargs=None) -> torch.nn.Module:
    """A model by name with θ₀ drawn from `seed` (the same θ₀ in-process and on Flower), or the given module;
    its output size must equal the data set's class count (regression: the target width)."""
    if model_kwargs is not None and not isinstance(model_kwargs, Mapping):
        raise TypeError(f"model_kwargs must be a mapping of the model's keyword arguments, e.g. {{'hidden': (64,)}}, "
                        f"got {type(model_kwargs).__name__}")
    if isinstance(model, str):
        if not fed.input_shape:
            raise ValueError(f"the data's rows are single numbers (x of shape [n]); the model {model!r} needs a "
                             "feature axis: build the data with x.reshape(-1, 1), or pass your own nn.Module")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = make_model(model, fed.input_shape, fed.num_classes, **(model_kwargs or {}))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be 'logreg', 'mlp', 'cnn' or a torch.nn.Module, got {type(model).__name__}")
    return model.to(fed.device)


def check_model_outputs(model, fed: FederatedDataset, criterion) -> None:
    """The model must be one flat vector of one float dtype and run on the data's inputs; a classifier must have
    exactly one output per class: fewer fails deep in torch, more is a silent bug."""
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if not dtypes:
        raise ValueError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train")
    if len(dtypes) > 1:
        raise ValueError(f"the model's parameters mix dtypes {', '.join(dtypes)}: simulate trains them as one flat "
                         "vector of one dtype; convert the model with model.float() (or model.double())")
    # a custom loss's reductions are compared on 64 rows spread over the test set and the first row of each class
    # in the test and the training data (an ignore_index class is among them wherever it sits); otherwise two rows
    # check the outputs
    x, y = _loss_check_batch(fed) if criterion is not None else (fed.x_test[:2], fed.y_test[:2])
    was = model.training
    try:
        out = model.eval()(x)  # eval mode: a BatchNorm's running statistics stay as they are
    except RuntimeError as e:
        if x.dtype == next(model.parameters()).dtype:
            raise
        raise ValueError(f"the model cannot run on the data: its inputs have dtype {x.dtype} and the model's "
                         f"parameters {dtypes[0]} ({str(e)[:80]}); convert the data (x.float()) or build the model "
                         "in the data's dtype (model.double())") from None
    finally:
        model.train(was)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the model's forward returns a {type(out).__name__}, not a tensor of outputs; return "
                         "the outputs (logits) tensor")
    if not out.dtype.is_floating_point:
        raise ValueError(f"the model's outputs have dtype {out.dtype}: they cannot be trained by gradient; return "
                         "float outputs (logits), not a cast, argmax or comparison of them")
    if not out.requires_grad and any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model's outputs do not depend on its parameters (detached, or computed under "
                         "torch.no_grad()): there is no gradient to train; return the forward's outputs as they are")
    out = out.detach()
    if criterion is not None:
        return _check_reductions(criterion, out, y)
    if fed.y_test.dtype.is_floating_point and fed.y_test.dim() == 1:
        raise ValueError(f"the data's y are float ({fed.y_test.dtype}, one number per row): regression targets, or "
                         "class ids stored as floats; pass loss= (e.g. torch.nn.functional.mse_loss) for a "
                         "regression, or give class ids as integers (y.astype(int) or y.long())")
    if out.dim() != 2 or out.shape[1] != fed.num_classes:
        raise ValueError(f"the model has {tuple(out.shape[1:])} outputs but the data set has {fed.num_classes} classes; "
                         f"build it with {fed.num_classes} outputs (e.g. make_model(name, fed.input_shape, "
                         f"fed.num_classes)), or pass loss= for a non-classification objective")


def _spread(n: int, k: int) -> torch.Tensor:
    """Up to k row indices spread evenly over 0..n-1."""
    return torch.linspace(0, n - 1, min(k, n)).round().long().unique()


def _loss_check_batch(fed: FederatedDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a custom loss's reductions are checked on: `_loss_check_rows` of the test set, and the first
    training row of each class (a class only the clients hold)."""
    test, train = _loss_check_rows(fed.y_test), _loss_check_rows(fed.dataset.y_train, spread=0)
    data = fed.dataset
    x = torch.cat([fed.x_test[test], data.x_train[train].to(fed.x_test.device, fed.x_test.dtype)])
    return x, torch.cat([fed.y_test[test], data.y_train[train].to(fed.y_test.device, fed.y_test.dtype)])


def _loss_check_rows(y: torch.Tensor, spread: int = 64, max_classes: int = 1024) -> torch.Tensor:
    """`spread` rows spread over the test set plus, for class ids, the first row of each class (up to
    `max_classes`): which classes the check sees does not depend on where their rows sit."""
    rows = _spread(len(y), spread)
    if y.dtype.is_floating_point or y.dim() != 1 or not len(y):
        return rows
    _, which = torch.unique(y.cpu(), return_inverse=True)
    first = torch.full((int(which.max()) + 1,), len(y)).scatter_reduce(0, which, torch.arange(len(y)), "amin")
    return torch.cat([rows, first[:max_classes]]).unique()


def _check_reductions(criterion, out: torch.Tensor, y: torch.Tensor) -> None:
    """A custom loss honours reduction= as torch.nn.functional losses do (per-row values, their sum, their mean):
    the engine evaluates with 'sum' and the vmap backend trains with 'none', so one that ignores it would be a
    silently wrong test loss or a deep error."""
    with torch.no_grad():
        values = [criterion(out, y, reduction=r) for r in ("none", "sum", "mean")]
    kinds = [type(v).__name__ for v in values if not isinstance(v, (torch.Tensor, int, float))]
    if kinds:
        raise ValueError(f"loss returns a {kinds[0]}, not a tensor; return one tensor: the per-row values for "
                         "reduction='none', their sum for 'sum', their mean for 'mean'")
    rows, total, mean = (torch.as_tensor(v) for v in values)
    close = lambda a, b: torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-6, equal_nan=True)
    shaped = rows.dim() >= 1 and rows.shape[0] == len(out) and total.numel() == 1 and mean.numel() == 1
    if shaped and close(total, rows.sum()) and not close(mean, rows.mean()):
        raise ValueError(f"loss's 'mean' ({mean.item():.4g}) is not the mean of its 'none' values "
                         f"({rows.double().mean().item():.4g}), as with cross_entropy(weight=w), whose 'mean' divides "
                         "by the weights' sum: the engine averages the per-row values itself (vmap trains on 'none'), "
                         "so training would not follow the weighting it states; give a loss whose 'mean' is the mean "
                         "of its rows (compute the 'none' values, return them, their .sum() or their .mean())")
    if not (shaped and close(total, rows.sum()) and close(mean, rows.mean())):
        raise ValueError(f"loss does not honour reduction=: on {len(out)} rows it gave shapes {tuple(rows.shape)} "
                         f"('none'), {tuple(total.shape)} ('sum'), {tuple(mean.shape)} ('mean'); return the per-row "
                         "values for 'none', their sum for 'sum' and their mean for 'mean', as torch.nn.functional "
                         "losses do")


def check_poison(poison, num_clients: int) -> None:
    """A poison must be a `core.round.DataPoison` (callable, with `clients`) naming clients of this federation."""
    if not isinstance(poison, DataPoison):
        raise TypeError("poison must be a callable with a `clients` attribute, e.g. "
                        "fedlab_nb.methods.robustness.poison.LabelFlip(...) or PixelTrigger(...); "
                        f"got {type(poison).__name__}")
    bad = [k for k in poison.clients if not 0 <= k < num_clients]
    if bad:
        raise ValueError(f"poison.clients {bad} are not clients of this federation (0 … {num_clients - 1})")


def simulate(method: Method, fed: FederatedDataset, model: str | torch.nn.Module = "mlp", *,
             rounds: int = 20, clients_per_round=None, local_epochs: int = 1, local_steps: int | None = None,
             batch_size: int = 32, lr: float = 0.05, seed: int = 0, eval_every: int = 1, stragglers: float = 0.0,
             drop_stragglers: bool = False, backend: str = "auto", device=None, checkpoint: str | Path | None = None,
             resume: bool = False, progress: bool = True, on_nonfinite: str = "raise", attack: Callable | None = None,
             byzantine=(), model_kwargs: dict | None = None, callback: Callable | None = None, loss=None,
             store_device="cpu", poison=None) -> History:
    """Run a federated `Method` on a `FederatedDataset` and return its `History` (`fedlab_nb.simulate`
    also accepts a method's name).

    `model`: "logreg" | "mlp" | "cnn" or an nn.Module (its initial weights are θ₀). `clients_per_round`:
    an int, a fraction, None (all) or a sampler `(round, K, g) -> ids`. `stragglers`: the fraction of clients
    that each round finish only a random prefix of their local steps; `drop_stragglers=True` discards them.
    `attack(updates, byz_mask, generator=g)` rewrites the messages of the Byzantine clients (`byzantine`:
    their ids) after the method's uplink transforms. `loss`: a torch.nn.functional loss `(outputs, y)` for a
    non-classification objective (default cross-entropy). `checkpoint`: a file written atomically after
    every round; `resume=True` continues from it (also in a new process) and ends with the same History as
    an uninterrupted run. `callback(round, theta, row)` is called after each round. `store_device`: where
    the per-client state of all K clients lives. `poison` (fedlab_nb.methods.robustness.poison: LabelFlip,
    PixelTrigger ...) transforms the training rows of `poison.clients` in every round; its `evaluate` adds History
    columns."""
    if not isinstance(method, Method):
        raise TypeError(f"method must be a fedlab_nb Method, got {type(method).__name__}; use fedlab_nb.simulate "
                        "(or fedlab_nb.get_method) to build one from a name")
    if not isinstance(fed, FederatedDataset):
        raise TypeError(f"fed must be a FederatedDataset (fedlab_nb.federate(...)), got {type(fed).__name__}")
    cfg = RunConfig(rounds=rounds, clients_per_round=None if callable(clients_per_round) else clients_per_round,
                    local_epochs=local_epochs, local_steps=local_steps, batch_size=batch_size, lr=lr, seed=seed,
                    eval_every=eval_every, stragglers=stragglers, drop_stragglers=drop_stragglers, backend=backend,
                    on_nonfinite=on_nonfinite, byzantine=byzantine_ids(byzantine))
    cfg.validate(fed.num_clients)
    try:
        torch.device(store_device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"store_device={store_device!r} is not a torch device; use 'cpu' (the default) or "
                         "e.g. 'cuda'") from None
    if poison is not None:
        check_poison(poison, fed.num_clients)
    if device is not None:
        fed.to(device)
    dev = fed.device
    model = build_model(model, fed, seed, model_kwargs)
    check_loss(loss)
    check_model_outputs(model, fed, loss)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be a function (round, theta, row) -> None, got {type(callback).__name__}")
    K = fed.num_clients
    sampler = make_sampler(clients_per_round, K)
    if declares(method.rule, ChecksSampler):  # DP: the sampling its accountant assumes, before round 1
        method.rule.check_sampler(sampler, K)
    groups = method.groups.resolve(param_spec(model))
    backend = choose_backend(cfg, method, model, dev)
    setup = RoundSetup(method, fed, cfg, make_loss(model, loss), groups, kernel(backend), backend=backend, poison=poison)
    evaluator = Evaluator(model, fed, loss)
    byz = torch.zeros(K, dtype=torch.bool)
    byz[list(cfg.byzantine)] = True

    theta = flatten_params(model).to(dev)
    state, rows, start = method.init_state(theta, K), [], 0
    store = ClientStore(_client_defaults(method, theta, groups, model), K, store_device)
    run_id = fingerprint(cfg, method, fed, model, sampler, attack, loss, poison)
    meta = {"method": method.name, "dataset": fed.dataset.name, "partition": fed.partition.name,
            "clients": K, **asdict(cfg), "device": str(dev),
            "fingerprint": run_id, "backend_used": backend}
    ckpt = checkpoint_path(checkpoint) if checkpoint else None
    data_id = data_fingerprint(fed) if ckpt else None
    if resume and ckpt and ckpt.exists():
        theta, state, rows, start = _resume(ckpt, run_id, dev, store, model, theta, rounds, data_id)

    from tqdm.auto import tqdm
    bar = tqdm(range(start, rounds), desc=method.name, disable=not progress, leave=False)
    t0 = time.perf_counter()
    for r in bar:
        ids = drawn = check_sampled(sampler(r, K, rng(seed, SAMPLE, r)), K, r)
        if cfg.drop_stragglers and cfg.stragglers:
            late = _stragglers(K, cfg, r)
            ids = np.array([k for k in ids if k not in late], dtype=np.int64)
        row = {"round": r + 1, "n_sampled": int(len(ids)), "train_loss": float("nan"), "bytes_up": 0, "bytes_down": 0}
        if len(ids):
            theta, state, out = run_round(setup, state, theta, store, ids, r, attack, byz, drawn)
        else:  # DP still releases a noised θ (and its accountant's ε) in a round nobody was sampled in
            theta, state, out = quiet_round(method, state, theta, empty_info(setup, r, theta, drawn), groups)
        row.update(out)
        if (r + 1) % eval_every == 0 or r + 1 == rounds:
            row.update(evaluator(theta, *personal_models(setup, r, theta, store, state)))
            if isinstance(poison, ScoredPoison):
                row.update(poison.evaluate(model, theta, fed))
        rows.append(row)
        if ckpt:
            save_checkpoint(ckpt, {"round": r, "theta": theta, "state": state, "rows": rows, "fingerprint": run_id,
                                   "data": data_id, "store": store.state_dict(), "buffers": flatten_buffers(model, theta.dtype)})
        if callback is not None:
            callback(r + 1, theta, row)
        if "test_acc" in row:
            bar.set_postfix(acc=f"{row['test_acc']:.3f}")
    meta["seconds"] = time.perf_counter() - t0
    warn_dropped_rounds(rows, cfg)
    hist = History.from_rows(rows, meta)
    hist.theta = theta  # final flat parameters, for notebooks that look inside the model
    hist.model = model
    hist.store = store  # every client's final state (personal models, variates ...)
    hist.state = state  # the method's final server state (weighting, rule, server optimiser)
    hist.client_acc = getattr(evaluator, "last", None)  # per-client local-test accuracy at the last evaluation
    return hist


def warn_dropped_rounds(rows: list[dict], cfg: RunConfig) -> None:
    """With on_nonfinite="drop", warn naming the rounds in which every sampled client's update was dropped
    (θ did not learn there and train_loss is NaN) instead of ending silently."""
    empty = [row["round"] for row in rows if cfg.on_nonfinite == "drop" and row["n_sampled"] > 0
             and isinstance(row.get("train_loss"), float) and math.isnan(row["train_loss"])]
    if empty:
        which = "every round" if len(empty) == len(rows) else f"{len(empty)} of {len(rows)} rounds"
        warnings.warn(f"on_nonfinite='drop' dropped every client's update (NaN/inf) in {which}: round(s) "
                      f"{empty[:20]}{' ...' if len(empty) > 20 else ''}; θ did not learn there and their train_loss "
                      f"is NaN. Lower lr (now {cfg.lr}), check the data and the attack, or use "
                      "on_nonfinite='raise' to stop at the first such update", UserWarning, stacklevel=3)


def _client_defaults(method: Method, theta: torch.Tensor, groups, model) -> dict:
    """The store's default rows; with `ClientUpdate.local_buffers` also "buffers" (the model's initial ones)."""
    defaults = method.client_state(theta, groups)
    if method.client.local_buffers:
        if next(model.buffers(), None) is None:
            raise ValueError(f"{method.name} keeps BatchNorm statistics per client but the model has no buffers; "
                             "use a model with BatchNorm, e.g. model='mlp_bn' or 'cnn_bn'")
        defaults["buffers"] = flatten_buffers(model, theta.dtype).to(theta.device)
    return defaults


def _resume(ckpt: Path, run_id: str, dev, store: ClientStore, model=None, theta0=None, rounds=None, data_id=None):
    saved = load_checkpoint(ckpt, dev)
    if saved.get("fingerprint") != run_id:
        raise ValueError(f"checkpoint {ckpt} was written by a different run configuration; "
                         "delete it, point checkpoint= elsewhere, or pass resume=False to start over")
    if data_id is not None and saved.get("data") is not None and saved["data"] != data_id:  # older ones: no "data"
        raise ValueError(f"checkpoint {ckpt} was written on other data (other rows of the same client sizes); "
                         "delete it, point checkpoint= elsewhere, or pass resume=False to start over")
    _check_saved(ckpt, saved, theta0, rounds)
    try:
        store.load_state_dict(saved["store"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: its client store cannot be loaded ({type(e).__name__}: "
                              f"{str(e)[:100]}); delete it or pass resume=False to start over") from None
    if model is not None and saved.get("buffers") is not None and saved["buffers"].numel():
        load_buffers(model, saved["buffers"])  # the global BatchNorm running statistics
    return saved["theta"], saved["state"], saved["rows"], saved["round"] + 1


def _check_saved(ckpt: Path, saved: dict, theta0, rounds) -> None:
    """A checkpoint with the run's fingerprint still holds what this run wrote: θ of θ₀'s length and dtype and
    finite, the last round done in [0, rounds), History rows and method state of the right kinds."""
    theta, r, why = saved["theta"], saved["round"], None
    if not isinstance(theta, torch.Tensor) or (theta0 is not None and (theta.shape != theta0.shape
                                                                       or theta.dtype != theta0.dtype)):
        why = "its θ is not a vector of this model's length and dtype"
    elif not torch.isfinite(theta).all():
        why = "its θ holds NaN or inf"
    elif isinstance(r, bool) or not isinstance(r, int) or r < 0 or (rounds is not None and r >= rounds):
        why = f"its last round {r!r} is not a round of this run (0 … {rounds - 1 if rounds else '?'})"
    elif not isinstance(saved["rows"], list) or not all(isinstance(row, dict) for row in saved["rows"]) \
            or len(saved["rows"]) > r + 1:
        why = "its History rows are not a list of at most one row per round"
    elif not isinstance(saved["state"], dict) or not isinstance(saved["store"], dict):
        why = "its method state or client store is not a mapping"
    if why:
        raise CheckpointError(f"checkpoint {ckpt} has this run's fingerprint but {why}: it was altered; delete it or "
                              "pass resume=False to start over")
