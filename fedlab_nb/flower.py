"""Run any fedlab_nb `Method` on Flower (flwr 1.42, Message API), unchanged.

    ServerApp ─ MethodStrategy ── broadcast (θ, SCAFFOLD's c ...) ──────────► sampled SuperNodes
        ▲   sample with rng(seed, SAMPLE, r)                                   │ ClientApp: the engine's
        │                                                                      │ client_round + uplink on
        └─ server_update → evaluate ◄──── message entries (Δ_k, Δc_k ...), n_k, τ_k ┘ its own store row

The strategy calls the same `server_update` as `fedlab_nb.simulate`, and each ClientApp runs the engine's
`client_round` (the method's client update, on the loop kernel) and uplink transforms for its one client,
with mini-batches from rng(seed, BATCHES, r, k). So one seed gives the same History in-process and on
Flower (for uplink transforms that draw random numbers, each client draws its own stream here).

Where state lives: the client store's row of client k (SCAFFOLD's c_k, kept-local tensors, worker
momentum ...) is held by its ClientApp in `context.state`; it never reaches the server. The server's state
(weighting, rule, server optimiser, the objective's shared tensors) stays in the strategy. Personal models
live on the clients, so the History here has the global-model metrics only.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no network calls from a classroom or CI machine
try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import Strategy
except ImportError:
    raise ImportError('fedlab_nb.flower needs Flower: pip install "fedlab_nb[flower]"') from None

from .core.messages import Messages, dense_bytes
from .core.registry import register
from .core.streams import SAMPLE
from .data.federated import FederatedDataset
from .engine.client import make_loss, train_clients_loop
from .engine.evaluate import Evaluator
from .engine.history import History
from .engine.sampling import check_sampled, make_sampler
from .engine.server import (NonFiniteUpdateError, RoundSetup, RunConfig, build_model, check_model_outputs, client_round, downlink, local_job,
                            nan_markers, quiet_round, round_jobs, server_update, uplink, warn_dropped_rounds)
from .engine.store import ClientStore
from .core.method import ChecksSampler, OwnTraining, declares
from .methods import Method, RoundInfo, get_method
from .models import flatten_params, param_spec
from .utils import rng

__all__ = ["to_flower", "run_on_flower", "MethodStrategy", "local_job", "server_update"]

STATE_KEY = "fedlab-client-state"   # the ClientApp's context.state record holding its per-client entries
log = logging.getLogger("flwr")


# --- tensors <-> Flower records ----------------------------------------------------------------------
def _to_array(t: torch.Tensor) -> Array:
    return Array(np.ascontiguousarray(t.detach().cpu().numpy()))


def _to_tensor(a: Array, device) -> torch.Tensor:
    return torch.from_numpy(a.numpy().copy()).to(device)


# --- what both apps are built from -------------------------------------------------------------------
@dataclass
class _Setup:
    method: Method
    fed: FederatedDataset
    model: torch.nn.Module
    cfg: RunConfig
    sampler: Callable
    theta0: torch.Tensor
    round: RoundSetup       # what the engine's client_round / server_update need

    @property
    def num_clients(self) -> int:
        return self.fed.num_clients


def _check_method(method) -> Method:
    if isinstance(method, str):
        return get_method(method)
    if not isinstance(method, Method):
        raise ValueError(f"method must be a fedlab_nb Method (or its name), got {type(method).__name__}: only "
                         "round-based methods run on Flower; closed-form one-shot methods (e.g. AFL) do not")
    if not method.flower_compatible:
        raise ValueError(f"method {method.name!r} is flagged flower_compatible=False: it is not a sequence of "
                         "client-update / server-aggregate rounds, so it cannot run as a Flower strategy")
    return method


def _setup(method, fed, model="mlp", *, rounds=20, clients_per_round=10, local_epochs=1, local_steps=None,
           batch_size=32, lr=0.05, seed=0, eval_every=1, model_kwargs=None, on_nonfinite="raise") -> _Setup:
    method = _check_method(method)
    if not isinstance(fed, FederatedDataset):
        raise TypeError(f"fed must be a FederatedDataset (fedlab_nb.federate(...)), got {type(fed).__name__}")
    cfg = RunConfig(rounds=rounds, clients_per_round=None if callable(clients_per_round) else clients_per_round,
                    local_epochs=local_epochs, local_steps=local_steps, batch_size=batch_size, lr=lr, seed=seed,
                    eval_every=eval_every, on_nonfinite=on_nonfinite)
    cfg.validate()
    model = build_model(model, fed, seed, model_kwargs)  # the same θ₀ as simulate(..., seed=seed)
    check_model_outputs(model, fed, None)  # as simulate: one dtype, runs on the data, one output per class
    theta0 = flatten_params(model).to(fed.device)
    groups = method.groups.resolve(param_spec(model))
    rs = RoundSetup(method, fed, cfg, make_loss(model), groups, train_clients_loop)
    sampler = make_sampler(clients_per_round, fed.num_clients)
    if declares(method.rule, ChecksSampler):  # DP: the sampling its accountant assumes, before round 1
        method.rule.check_sampler(sampler, fed.num_clients)
    return _Setup(method, fed, model, cfg, sampler, theta0, rs)


# --- server side -------------------------------------------------------------------------------------
_METRICS = ("client-id", "num-examples", "steps", "train-loss", "bytes-up")   # what every training reply carries
_MAX_COUNT = 2 ** 53   # counts (num-examples, steps, bytes-up): exact in float64, finite in float32, fit int64


def _client_text(text, limit: int = 300) -> str:
    """A remote client's text for the server's log: repr escapes control and format characters (terminal escape
    sequences, bidi overrides), so the client cannot write to the operator's terminal; long text is cut."""
    text = repr(str(text))
    return text if len(text) <= limit else text[:limit] + "…"


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _spec(entries: dict) -> tuple:
    return tuple(sorted((n, a.dtype.str, a.shape) for n, a in entries.items()))


def _describe(spec: tuple) -> str:
    """A spec as text: name dtype shape, e.g. 'delta' float32 (7850,)."""
    return "[" + ", ".join(f"{n!r} {_dtype_text(d)} {tuple(s)}" for n, d, s in spec) + "]"


def _dtype_text(d) -> str:
    """float32, or float32 (big-endian) where the byte order is not this machine's (else two specs read the same)."""
    d = np.dtype(d)
    return d.name if d.isnative or d.byteorder == "|" else f"{d.name} ({'big' if d.byteorder == '>' else 'little'}-endian)"


def _refuse(r: int, who: str, what: str, limit: int = 600) -> ValueError:
    """The error for a refused reply; `who` and `what` quote the client's values, so each is cut to `limit`."""
    who, what = (t if len(t) <= limit else t[:limit] + "…" for t in (who, what))
    return ValueError(f"round {r}: the reply from {who} {what}; its reply is refused (fix or stop that SuperNode: "
                      "every client runs the same fedlab_nb version and method)")


class MethodStrategy(Strategy):
    """A Flower `Strategy` whose sampling, weighting, rule, normalisation and server optimiser are those of
    a fedlab_nb `Method`; evaluation is the engine's, on the server; `history()` returns our `History`."""

    def __init__(self, setup: _Setup, connect_timeout: float = 120.0):
        self.s, self.connect_timeout = setup, connect_timeout
        self.theta = setup.theta0.clone()
        self.state = setup.method.init_state(self.theta, setup.num_clients)
        self.evaluator = Evaluator(setup.model, setup.fed)
        self.nodes: dict[int, int] = {}     # our client id k -> Flower node id
        self.reference: tuple | None = None  # the entries the method's client code sends (once per run)
        self.rows_held = setup.fed.sizes      # n_k: no client trains on more rows than its partition holds
        self.rows: list[dict] = []
        self.round_seconds: list[float] = []

    def summary(self) -> None:
        log.info("\t└──> fedlab_nb method %r on %d clients", self.s.method.name, self.s.num_clients)

    def _connect(self, grid: Grid) -> None:
        """Wait for all K SuperNodes, then ask each which client (partition-id) it holds."""
        K, deadline = self.s.num_clients, time.monotonic() + self.connect_timeout
        while len(node_ids := list(grid.get_node_ids())) < K:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(node_ids)} of {K} SuperNodes connected within {self.connect_timeout} s; "
                                   f"start one per client with --node-config 'partition-id=k num-partitions={K}'")
            time.sleep(0.1)
        ask = RecordDict({"config": ConfigRecord({})})
        replies = grid.send_and_receive([Message(ask, dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids],
                                        timeout=self.connect_timeout)
        for reply in replies:
            if reply.has_error():
                raise RuntimeError(f"node {reply.metadata.src_node_id} failed to report its client id: "
                                   f"{_client_text(reply.error.reason)}")
            node, k = reply.metadata.src_node_id, dict(reply.content.get("metrics", {})).get("client-id")
            if not _is_int(k) or not 0 <= k < K:
                raise ValueError(f"node {node} reports client id {_client_text(k)}; it must be an integer in 0..{K - 1}: start it "
                                 f"with --node-config 'partition-id=k num-partitions={K}'")
            k = int(k)
            if k in self.nodes:
                raise ValueError(f"two SuperNodes claim partition-id={k}; give each a distinct partition-id")
            self.nodes[k] = node
        if missing := sorted(set(range(K)) - set(self.nodes)):
            raise ValueError(f"no SuperNode holds client(s) {missing}: start K={K} SuperNodes with "
                             f"--node-config 'partition-id=k num-partitions={K}', k = 0..{K - 1}")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        if not self.nodes:
            self._connect(grid)
        self._t0, r = time.perf_counter(), server_round - 1
        self.sampled = check_sampled(self.s.sampler(r, self.s.num_clients, rng(self.s.cfg.seed, SAMPLE, r)),
                                     self.s.num_clients, r)
        self.down, self.state, self.theta_bytes = downlink(self.s.round, r, self.state,
                                                           self.s.method.broadcast(self.state, self.theta))
        content = RecordDict({"broadcast": ArrayRecord({n: _to_array(t) for n, t in self.down.items()}),
                              "config": ConfigRecord({"round": r})})
        return [Message(content, dst_node_id=self.nodes[int(k)], message_type=MessageType.TRAIN) for k in self.sampled]

    def aggregate_train(self, server_round: int, replies):
        replies = list(replies)
        for bad in (m for m in replies if m.has_error()):
            log.warning("node %s failed this round: %s", bad.metadata.src_node_id, _client_text(bad.error.reason))
        good = self._finite_losses(server_round, self._checked(server_round, [m for m in replies if not m.has_error()]))
        row = {"round": server_round, "n_sampled": len(self.sampled), "train_loss": float("nan")}
        if good:
            dev, metrics = self.theta.device, [m for _, m, _ in good]
            ids = np.array([k for k, _, _ in good])
            msgs = Messages({n: torch.stack([torch.from_numpy(e[n].copy()).to(dev) for _, _, e in good])
                             for n in good[0][2]}, ids, torch.tensor([int(m["bytes-up"]) for m in metrics]))
            info = RoundInfo(server_round - 1, ids, torch.tensor([float(m["num-examples"]) for m in metrics], device=dev),
                             torch.tensor([float(m["steps"]) for m in metrics], device=dev), self.s.num_clients,
                             self.s.cfg.lr, self.theta, msgs, self.s.cfg.seed, self.sampled)
            if not torch.isfinite(info.sizes.sum()):  # bounded counts keep this finite; a guard, not a silent inf
                raise _refuse(server_round, f"clients {ids.tolist()}", "report num-examples whose sum is not finite")
            losses = torch.tensor([float(m["train-loss"]) for m in metrics], device=dev)
            if not torch.isfinite(info.sizes @ losses):  # the round's size-weighted train loss would be inf
                raise _refuse(server_round, f"clients {ids.tolist()}", "report train-loss values whose size-weighted "
                              "sum overflows float32")
            row.update(bytes_up=int(msgs.bytes.sum()), bytes_down=len(self.sampled) * (self.theta_bytes + dense_bytes(
                {k: v for k, v in self.down.items() if k != "theta"})))
            self.theta, self.state, row["train_loss"] = server_update(self.s.method, self.state, self.theta, info, msgs,
                                                                      losses, self.s.cfg.on_nonfinite, self.s.round.groups)
            row.update(self.s.method.round_metrics(self.state))
        else:  # nobody sampled or every reply failed: DP still releases a noised θ (engine.server.quiet_round)
            info = RoundInfo(server_round - 1, np.empty(0, dtype=np.int64), self.theta.new_zeros(0),
                             self.theta.new_zeros(0), self.s.num_clients, self.s.cfg.lr, self.theta, None, self.s.cfg.seed,
                             self.sampled)
            self.theta, self.state, out = quiet_round(self.s.method, self.state, self.theta, info, self.s.round.groups)
            row.update(out)
        self.rows.append(row)
        return ArrayRecord({"theta": _to_array(self.theta)}), MetricRecord({"train_loss": row["train_loss"]})

    def _checked(self, server_round: int, replies: list) -> list[tuple[int, dict, dict]]:
        """(client id, metrics, message entries as arrays) of each reply, sorted by id: each id is the one its
        node holds and was sampled this round, once; metrics are numbers; entries have one spec (names, dtypes,
        shapes: those the method's client code produces) with θ's float dtype. Anything else raises naming the client."""
        out = sorted((self._reply(server_round, m) for m in replies), key=lambda t: t[0])
        if len({k for k, _, _ in out}) != len(out):
            raise _refuse(server_round, "several nodes", f"claims client ids {[k for k, _, _ in out]} (a repeat)")
        if not out:
            return out
        if sum(m["num-examples"] for _, m, _ in out) == 0:  # nobody trained on anything: no weight to aggregate by
            raise _refuse(server_round, ", ".join(f"client {k}" for k, _, _ in out), "reports num-examples = 0 (the "
                          "round's total): at least one reply must have trained on examples")
        if self.reference is None:  # every reply is checked against the method's own entries, not only the others'
            self.reference = self._expected_spec(server_round - 1, out[0][0])
        ref = self.reference
        for k, _, e in out:
            if _spec(e) != ref:
                got, want = {n for n, _, _ in _spec(e)}, {n for n, _, _ in ref}
                diff = "; ".join(f"{what} {sorted(names)}" for what, names in (("extra", got - want), ("missing", want - got))
                                 if names)
                raise _refuse(server_round, f"client {k}", f"has entries {_describe(_spec(e))}"
                              f"{f' ({diff})' if diff else ''}, not the method's {_describe(ref)}")
        want, key = str(self.theta.dtype).removeprefix("torch."), self.s.method.aggregate_key
        bad = [n for n, a in out[0][2].items() if a.dtype.kind not in "fiub"
               or (a.dtype.kind == "f" and a.dtype != np.dtype(want))]
        if bad or key not in out[0][2]:
            raise _refuse(server_round, f"client {out[0][0]}", f"has entries {ref}: it must carry {key!r} and float "
                          f"entries of θ's dtype {want} (integer entries for counts; nothing complex)")
        if key == "delta":  # an update Δ lives where θ does: one float row of the sent coordinates
            groups = self.s.round.groups
            width = self.theta.numel() if groups is None or groups.everything_sent else \
                groups.index("sent", self.theta.device).numel()
            a = out[0][2][key]
            if a.dtype != np.dtype(want) or a.shape != (width,):
                raise _refuse(server_round, f"client {out[0][0]}", f"has {key!r} of dtype {a.dtype} and shape "
                              f"{a.shape}, not θ's {want} ({width},)")
        if self.s.cfg.on_nonfinite == "raise":  # 'drop': server_update drops such replies, every entry checked
            marks = nan_markers(self.s.method)  # entries a NaN row marks as "no value yet" (PGFed's a)
            for k, _, e in out:
                bad = [n for n, a in sorted(e.items()) if a.dtype.kind == "f" and not np.isfinite(a).all()
                       and not (n in marks and np.isnan(a).all())]
                if bad:
                    raise NonFiniteUpdateError(
                        f"round {server_round}: the reply from client {k} has a non-finite (NaN/inf) "
                        f"{', '.join(repr(n) for n in bad)}; lower lr, check that client's data, or pass "
                        "on_nonfinite='drop' to drop such replies")
        return out

    def _expected_spec(self, r: int, k: int) -> tuple:
        """The entries a reply of this method must carry (names, dtypes, shapes), from the method itself: the
        client code path (`client_round` + `uplink`, as the ClientApp runs it) for client k with fresh state.
        Computed once per run (the first round with replies) and every reply is compared with it, so an entry that
        all replies agree on but the method never sends is refused too."""
        dev, method = self.s.fed.device, self.s.method
        cstate = ClientStore(method.client_state(self.s.theta0, self.s.round.groups), 1, dev).gather([0], dev)
        entries, cstate, _, _ = client_round(self.s.round, r, np.array([k]), self.down, cstate)
        msgs, _ = uplink(self.s.round, r, Messages(entries, np.array([k])), cstate, torch.zeros(1, dtype=torch.bool),
                         None, self.down["theta"], self.down)
        return _spec({n: np.asarray(_to_array(t[0]).numpy()) for n, t in msgs.tensors.items()})

    def _finite_losses(self, r: int, good: list) -> list:
        """Replies whose train-loss is finite in float32 (where the round's loss is kept); a NaN, inf or 1e308
        raises naming the client and the field, or with on_nonfinite='drop' drops that reply, as for updates."""
        limit = float(torch.finfo(torch.float32).max)
        bad = [(k, m["train-loss"]) for k, m, _ in good if not abs(float(m["train-loss"])) <= limit]  # NaN fails
        if bad and self.s.cfg.on_nonfinite == "raise":
            raise _refuse(r, ", ".join(f"client {k}" for k, _ in bad), f"has train-loss {bad[0][1]!r}, not a finite "
                          "float32; pass on_nonfinite='drop' to drop such replies")
        if bad:
            log.warning("round %d: dropped the replies of clients %s: train-loss not a finite float32", r,
                        [k for k, _ in bad])
        return [g for g in good if g[0] not in {k for k, _ in bad}]

    def _reply(self, r: int, m) -> tuple[int, dict, dict]:
        node, owner = m.metadata.src_node_id, {n: k for k, n in self.nodes.items()}
        who = f"node {node} (client {owner.get(node)})"
        if not all(part in m.content for part in ("metrics", "message")):
            raise _refuse(r, who, "lacks its 'metrics' or 'message' record")
        metrics = dict(m.content["metrics"])
        k = metrics.get("client-id")
        if not _is_int(k) or k != owner.get(node):
            raise _refuse(r, who, f"claims client id {k!r}, not the partition-id its node holds")
        if int(k) not in set(self.sampled.tolist()):
            raise _refuse(r, who, f"comes from a client not sampled this round (sampled: {sorted(self.sampled.tolist())})")
        bad = [n for n in _METRICS if isinstance(metrics.get(n), bool) or not isinstance(metrics.get(n), (int, float))]
        bad += [n for n in ("num-examples", "steps", "bytes-up") if n not in bad  # whole, and int64 / float32 hold it
                and not (math.isfinite(metrics[n]) and 0 <= metrics[n] <= _MAX_COUNT and float(metrics[n]).is_integer())]
        if bad or set(metrics) - set(_METRICS):
            raise _refuse(r, f"client {k}", f"has metrics {sorted(metrics)} ({', '.join(f'{n}={metrics.get(n)!r}' for n in bad)}):"
                          f" it must carry numbers {list(_METRICS)}, the counts whole numbers >= 0 and <= 2^53")
        if metrics["num-examples"] > self.rows_held[int(k)]:  # its weight in the mean: an inflated count takes it over
            raise _refuse(r, f"client {k}", f"reports num-examples = {int(metrics['num-examples'])}, more than the "
                          f"{int(self.rows_held[int(k)])} training rows its partition holds")
        if metrics["steps"] != (runs := self._steps_run(r - 1, int(k))):  # FedNova divides by it, scales by Σ p_k τ_k
            raise _refuse(r, f"client {k}", f"reports steps = {int(metrics['steps'])}, but its batch schedule for "
                          f"this round (keyed by seed, round and client) has {runs} local steps")
        entries = {n: np.asarray(a.numpy()) for n, a in m.content["message"].items()}
        return int(k), metrics, entries

    def _steps_run(self, r: int, k: int) -> int:
        """The local steps client k runs in round r (its keyed batch schedule on the method's first track,
        straggling included): what an honest reply reports."""
        s, cu = self.s.round, self.s.method.client
        if isinstance(cu, OwnTraining):
            return len(round_jobs(s, r, [k])[0].batches)
        track = cu.tracks(self.s.method)[0]
        return len(round_jobs(s, r, [k], None, track.steps, 0, track.epochs)[0].batches)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return []  # evaluation runs on the server, as in the in-process engine

    def aggregate_evaluate(self, server_round: int, replies):
        return None

    def evaluate_global(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Flower's `evaluate_fn`: the engine's evaluator on the eval rounds (θ₀ is not evaluated)."""
        if server_round == 0:
            return None
        out = None
        if server_round % self.s.cfg.eval_every == 0 or server_round == self.s.cfg.rounds:
            out = self.evaluator(self.theta)
            self.rows[-1].update(out)
        self.round_seconds.append(time.perf_counter() - self._t0)
        return None if out is None else MetricRecord(out)

    def history(self, runtime: str) -> History:
        cfg = self.s.cfg
        meta = {"method": self.s.method.name, "dataset": self.s.fed.dataset.name, "partition": self.s.fed.partition.name,
                "clients": self.s.num_clients, **asdict(cfg),
                "device": str(self.theta.device), "runtime": runtime, "seconds": float(sum(self.round_seconds))}
        warn_dropped_rounds(self.rows, cfg)
        hist = History.from_rows(self.rows, meta)
        hist.theta, hist.model = self.theta, self.s.model
        return hist


def _num_rounds(value) -> int:
    """`--run-config num-server-rounds=N`: a whole number >= 1 (1.9 is not 1, 0 is not a run)."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdecimal():
        value = int(value)
    if not _is_int(value) or value < 1:
        raise ValueError(f"num-server-rounds={value!r} in the run config; it must be a whole number of rounds >= 1: "
                         "flwr run --run-config 'num-server-rounds=N'")
    return int(value)


def _server_app(setup: _Setup, sink: Callable[[History], None], timeout: float) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        # `flwr run --run-config num-server-rounds=N` may shorten or lengthen the run
        rounds = _num_rounds(context.run_config.get("num-server-rounds", setup.cfg.rounds))
        run = replace(setup, cfg=replace(setup.cfg, rounds=rounds))
        strategy = MethodStrategy(run)
        strategy.start(grid, ArrayRecord({"theta": _to_array(run.theta0)}), num_rounds=run.cfg.rounds,
                       timeout=timeout, evaluate_fn=strategy.evaluate_global)
        hist = strategy.history("flower")
        sink(hist)
        if out := context.run_config.get("history-out"):
            hist.save(str(out))
            log.info("fedlab_nb History saved to %s", out)
    return app


# --- client side -------------------------------------------------------------------------------------
def _client_id(context: Context, num_clients: int) -> int:
    k = context.node_config.get("partition-id")
    if isinstance(k, str) and k.strip().isascii() and k.strip().isdecimal():  # not '³' or '①' (isdigit, no int)
        k = int(k)
    if not _is_int(k) or not 0 <= k < num_clients:
        raise ValueError(f"this SuperNode's node config partition-id={k!r}; it must be an integer client id in "
                         f"0..{num_clients - 1}: --node-config 'partition-id=k num-partitions={num_clients}'")
    return int(k)


def _client_app(setup: _Setup) -> ClientApp:
    app, method = ClientApp(), setup.method
    defaults = method.client_state(setup.theta0, setup.round.groups)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        k = _client_id(context, setup.num_clients)
        return Message(RecordDict({"metrics": MetricRecord({"client-id": k})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        k, dev = _client_id(context, setup.num_clients), setup.fed.device
        r = int(msg.content["config"]["round"])
        down = {n: _to_tensor(a, dev) for n, a in msg.content["broadcast"].items()}
        held = context.state[STATE_KEY] if STATE_KEY in context.state else ArrayRecord()
        store = ClientStore(defaults, 1, dev)  # this client's own row, from context.state (defaults at first)
        if len(held):
            store.scatter([0], {n: _to_tensor(a, dev)[None] for n, a in held.items()})
        cstate = store.gather([0], dev)
        entries, cstate, losses, jobs = client_round(setup.round, r, np.array([k]), down, cstate)
        msgs, cstate = uplink(setup.round, r, Messages(entries, np.array([k])), cstate,
                              torch.zeros(1, dtype=torch.bool), None, down["theta"], down)
        if cstate:
            context.state[STATE_KEY] = ArrayRecord({n: _to_array(t[0]) for n, t in cstate.items()})
        return Message(RecordDict({
            "message": ArrayRecord({n: _to_array(t[0]) for n, t in msgs.tensors.items()}),
            "metrics": MetricRecord({"client-id": k, "num-examples": len(jobs[0].y), "steps": len(jobs[0].batches),
                                     "train-loss": float(losses[0]), "bytes-up": int(msgs.wire_bytes()[0])})}),
            reply_to=msg)
    return app


class _DropDeprecation(logging.Filter):
    """`run_simulation` is the documented in-Python entry point, but 1.42 logs it as deprecated for `flwr run`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "run_simulation" not in record.getMessage()


# --- public API --------------------------------------------------------------------------------------
def _build(method, fed, model, timeout, **run):
    setup, box = _setup(method, fed, model, **run), {}
    return _server_app(setup, lambda h: box.__setitem__("history", h), timeout), _client_app(setup), box


@register("flower", claims="flower", kind="module")
def to_flower(method: Method | str, fed: FederatedDataset, model: str | torch.nn.Module = "mlp", *, rounds: int = 20,
              clients_per_round=10, local_epochs: int = 1, local_steps: int | None = None, batch_size: int = 32,
              lr: float = 0.05, seed: int = 0, eval_every: int = 1, model_kwargs: dict | None = None,
              timeout: float = 3600.0, on_nonfinite: str = "raise") -> tuple[ServerApp, ClientApp]:
    """(ServerApp, ClientApp) that run `method` on `fed` as `fedlab_nb.simulate` would with the same
    arguments. Client k is the SuperNode whose node config has partition-id=k (the simulation sets it).
    The ServerApp honours the run config keys `num-server-rounds` and `history-out` (a CSV path).
    `on_nonfinite`: "raise" (a NaN/inf reply stops the run) or "drop" (that round aggregates the others)."""
    server, client, _ = _build(method, fed, model, timeout, rounds=rounds, clients_per_round=clients_per_round,
                               local_epochs=local_epochs, local_steps=local_steps, batch_size=batch_size, lr=lr,
                               seed=seed, eval_every=eval_every, model_kwargs=model_kwargs, on_nonfinite=on_nonfinite)
    return server, client


def run_on_flower(method: Method | str, fed: FederatedDataset, model: str | torch.nn.Module = "mlp", *,
                  rounds: int = 20, clients_per_round=10, local_epochs: int = 1, local_steps: int | None = None,
                  batch_size: int = 32, lr: float = 0.05, seed: int = 0, eval_every: int = 1,
                  model_kwargs: dict | None = None, backend_config: dict | None = None,
                  verbose: bool = False, on_nonfinite: str = "raise") -> History:
    """Run `method` in Flower's simulation runtime (Ray backend, one virtual SuperNode per client) and return
    our `History`. `meta["seconds"]` times the rounds; `meta["wall_seconds"]` adds Flower/Ray start-up."""
    from flwr.simulation import run_simulation
    server, client, box = _build(method, fed, model, 3600.0, rounds=rounds, clients_per_round=clients_per_round,
                                 local_epochs=local_epochs, local_steps=local_steps, batch_size=batch_size, lr=lr,
                                 seed=seed, eval_every=eval_every, model_kwargs=model_kwargs,
                                 on_nonfinite=on_nonfinite)
    config = {"client_resources": {"num_cpus": 1}} if backend_config is None else dict(backend_config)
    if not verbose:
        config["init_args"] = {"logging_level": "ERROR", "log_to_driver": False, **config.get("init_args", {})}
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a Ray FutureWarning on CPU
    quiet, level, t0 = _DropDeprecation(), log.level, time.perf_counter()
    log.setLevel(logging.INFO if verbose else logging.WARNING)
    log.addFilter(quiet)
    try:
        run_simulation(server, client, num_supernodes=fed.num_clients, backend_config=config, verbose_logging=verbose)
    finally:
        log.setLevel(level)
        log.removeFilter(quiet)
    if "history" not in box:
        raise RuntimeError("the Flower simulation ended without a History; rerun with verbose=True to see its log")
    hist = box["history"]
    hist.meta.update(runtime="flower-simulation", wall_seconds=time.perf_counter() - t0)
    return hist
