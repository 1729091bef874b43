"""The round loop (`simulate`): sample → broadcast → local training → (attack) → aggregate → server step
→ evaluate, with atomic per-round checkpoints and exact resume.

All randomness is keyed by (seed, purpose, round, client), so a resumed run, or the same run on the
other backend, draws the same clients and the same mini-batches without saving any generator state.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..data.federated import FederatedDataset
from ..methods import Method, RoundInfo, get_method
from torch.func import functional_call

from ..models import flatten_params, make_model, param_spec, unflatten
from ..utils import check_positive_int, rng
from .client import LocalJob, batch_schedule, make_loss, train_clients_loop
from .history import History
from .sampling import make_sampler

SAMPLE, BATCHES, STRAGGLE, ATTACK = 1, 2, 3, 4  # stream ids for `rng(seed, stream, round, ...)`


class NonFiniteUpdateError(FloatingPointError):
    """A client returned NaN/inf; the message names the client and round."""


@dataclass
class RunConfig:
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
    backend: str = "auto"               # "loop" | "vmap" | "auto" (vmap where the method allows it)
    on_nonfinite: str = "raise"         # "raise" | "drop"
    byzantine: tuple = ()               # ids of Byzantine clients (their updates go through `attack`)
    extra: dict = field(default_factory=dict)

    def validate(self):
        check_positive_int("rounds", self.rounds)
        check_positive_int("local_epochs", self.local_epochs)
        check_positive_int("batch_size", self.batch_size)
        check_positive_int("eval_every", self.eval_every)
        if self.local_steps is not None:
            check_positive_int("local_steps", self.local_steps)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.stragglers <= 1:
            raise ValueError(f"stragglers is a fraction in [0, 1], got {self.stragglers}")
        if self.backend not in ("loop", "vmap", "auto"):
            raise ValueError(f"backend must be 'loop', 'vmap' or 'auto', got {self.backend!r}")
        if self.on_nonfinite not in ("raise", "drop"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'drop', got {self.on_nonfinite!r}")


def _fingerprint(cfg: RunConfig, method: Method, fed: FederatedDataset, model: torch.nn.Module) -> str:
    text = repr((asdict(cfg), repr(method), fed.dataset.name, fed.partition.name, fed.sizes.tolist(), repr(model)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _save_atomic(obj, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a kill mid-write leaves the previous checkpoint intact


def local_job(fed: FederatedDataset, k: int, cfg: RunConfig, rnd: int, ctx: torch.Tensor | None) -> LocalJob:
    """Client k's work in round `rnd`: its data and its batch schedule keyed by (seed, BATCHES, rnd, k);
    a straggler (`cfg.stragglers`) does only a random prefix of it (systems heterogeneity)."""
    x, y = fed.client_train[k]
    g = rng(cfg.seed, BATCHES, rnd, k)
    batches = batch_schedule(len(y), cfg.batch_size, cfg.local_epochs, cfg.local_steps, g)
    if cfg.stragglers and k in _stragglers(fed.num_clients, cfg, rnd):
        batches = batches[: int(g.integers(1, len(batches) + 1))]
    return LocalJob(int(k), x, y, batches, ctx)


def _stragglers(num_clients: int, cfg: RunConfig, rnd: int) -> set:
    """The clients that straggle in round `rnd`: a fixed fraction of all clients, keyed by (seed, round)."""
    g = rng(cfg.seed, STRAGGLE, rnd)
    return set(g.choice(num_clients, int(round(cfg.stragglers * num_clients)), replace=False).tolist())


def _local_jobs(fed, client_ids, cfg: RunConfig, rnd: int, ctx) -> list[LocalJob]:
    return [local_job(fed, k, cfg, rnd, None if ctx is None else ctx[i]) for i, k in enumerate(client_ids)]


def _pick_backend(cfg: RunConfig, method: Method):
    if cfg.backend == "loop":
        return train_clients_loop
    try:
        from .batched import train_clients_vmap
    except ImportError:
        train_clients_vmap = None
    if train_clients_vmap is not None and method.objective.vmappable:
        return train_clients_vmap
    if cfg.backend == "vmap":
        print(f"note: {method.name} cannot run on the vmap backend; falling back to loop")
    return train_clients_loop


@torch.no_grad()
def evaluate(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int = 8192):
    """(mean cross-entropy, accuracy, per-row correctness) of the flat parameters θ on (x, y)."""
    params = unflatten(theta, param_spec(model))
    losses, correct = [], []
    for i in range(0, len(y), chunk):
        logits = functional_call(model, params, (x[i:i + chunk],))
        losses.append(torch.nn.functional.cross_entropy(logits, y[i:i + chunk], reduction="sum"))
        correct.append(logits.argmax(1) == y[i:i + chunk])
    correct = torch.cat(correct)
    return float(sum(losses) / len(y)), float(correct.float().mean()), correct


class Evaluator:
    """Global test metrics plus the distribution of per-client local-test accuracy, in one pass each."""

    def __init__(self, model, fed: FederatedDataset):
        self.model, self.fed = model, fed
        tests = [t for t in fed.client_test if len(t[1])]
        self.client_x = torch.cat([t[0] for t in tests]) if tests else None
        self.client_y = torch.cat([t[1] for t in tests]) if tests else None
        self.owner = torch.cat([torch.full((len(t[1]),), i, device=fed.device) for i, t in enumerate(tests)]) if tests else None

    def __call__(self, theta) -> dict:
        loss, acc, _ = evaluate(self.model, theta, self.fed.x_test, self.fed.y_test)
        out = {"test_loss": loss, "test_acc": acc}
        if self.client_x is not None:
            _, _, correct = evaluate(self.model, theta, self.client_x, self.client_y)
            n = torch.bincount(self.owner).float()
            per_client = (torch.bincount(self.owner, weights=correct.float()) / n).cpu().numpy()
            out.update(client_acc_mean=float(per_client.mean()), client_acc_std=float(per_client.std()),
                       client_acc_p10=float(np.quantile(per_client, 0.1)))
        return out


def simulate(method: Method | str, fed: FederatedDataset, model: str | torch.nn.Module = "mlp", *,
             rounds: int = 20, clients_per_round=None, local_epochs: int = 1, local_steps: int | None = None,
             batch_size: int = 32, lr: float = 0.05, seed: int = 0, eval_every: int = 1, stragglers: float = 0.0,
             drop_stragglers: bool = False, backend: str = "auto", device=None, checkpoint: str | Path | None = None, resume: bool = False,
             progress: bool = True, on_nonfinite: str = "raise", attack: Callable | None = None,
             byzantine=(), model_kwargs: dict | None = None, callback: Callable | None = None) -> History:
    """Run a federated method on a `FederatedDataset` and return its `History`.

    `model`: "logreg" | "mlp" | "cnn" or an nn.Module (its initial weights are θ₀). `clients_per_round`:
    an int, a fraction, None (all) or a sampler `(round, K, g) -> ids`. `stragglers`: the fraction of clients
    that each round finish only a random prefix of their local steps; `drop_stragglers=True` discards them.
    `attack(updates, byz_mask, generator=g)` rewrites the rows of the Byzantine clients (`byzantine`: their ids) before aggregation.
    `checkpoint`: a file written atomically after every round; `resume=True` continues from it and ends
    with the same History as an uninterrupted run. `callback(round, theta, row)` is called after each round.
    """
    method = get_method(method)
    cfg = RunConfig(rounds, clients_per_round if not callable(clients_per_round) else None, local_epochs,
                    local_steps, batch_size, lr, seed, eval_every, stragglers, drop_stragglers, backend, on_nonfinite,
                    tuple(int(b) for b in byzantine))
    cfg.validate()
    if device is not None:
        fed.to(device)
    dev = fed.device
    if isinstance(model, str):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = make_model(model, fed.input_shape, fed.num_classes, **(model_kwargs or {}))
    model = model.to(dev)
    K = fed.num_clients
    sampler = make_sampler(clients_per_round, K)
    train_clients = _pick_backend(cfg, method)
    loss_fn, evaluator = make_loss(model), Evaluator(model, fed)
    byz = torch.zeros(K, dtype=torch.bool, device=dev)
    byz[list(cfg.byzantine)] = True

    theta = flatten_params(model).to(dev)
    state, rows, start = method.init_state(theta, K), [], 0
    fingerprint = _fingerprint(cfg, method, fed, model)
    meta = {"method": method.name, "dataset": fed.dataset.name, "partition": fed.partition.name,
            "clients": K, **{k: v for k, v in asdict(cfg).items() if k != "extra"}, "device": str(dev),
            "fingerprint": fingerprint, "backend_used": "vmap" if "vmap" in train_clients.__name__ else "loop"}
    ckpt = Path(checkpoint) if checkpoint else None
    if resume and ckpt and ckpt.exists():
        saved = torch.load(ckpt, map_location=dev, weights_only=False)
        if saved["fingerprint"] != fingerprint:
            raise ValueError(f"checkpoint {ckpt} was written by a different run configuration; "
                             "delete it, point checkpoint= elsewhere, or pass resume=False to start over")
        theta, state, rows, start = saved["theta"], saved["state"], saved["rows"], saved["round"] + 1

    from tqdm.auto import tqdm
    bar = tqdm(range(start, rounds), desc=method.name, disable=not progress, leave=False)
    t0 = time.perf_counter()
    for r in bar:
        ids = sampler(r, K, rng(seed, SAMPLE, r))
        if cfg.drop_stragglers and cfg.stragglers:
            late = _stragglers(K, cfg, r)
            ids = np.array([k for k in ids if k not in late], dtype=np.int64)
        row = {"round": r + 1, "n_sampled": len(ids), "train_loss": float("nan")}
        if len(ids):
            theta, state, row["train_loss"] = _round(method, state, theta, fed, ids, cfg, r, loss_fn,
                                                     train_clients, attack, byz)
        if (r + 1) % eval_every == 0 or r + 1 == rounds:
            row.update(evaluator(theta))
        rows.append(row)
        if ckpt:
            _save_atomic({"round": r, "theta": theta, "state": state, "rows": rows, "fingerprint": fingerprint}, ckpt)
        if callback is not None:
            callback(r + 1, theta, row)
        if "test_acc" in row:
            bar.set_postfix(acc=f"{row['test_acc']:.3f}")
    meta["seconds"] = time.perf_counter() - t0
    hist = History.from_rows(rows, meta)
    hist.theta = theta  # final flat parameters, for notebooks that look inside the model
    hist.model = model
    return hist


def _round(method, state, theta, fed, ids, cfg: RunConfig, r: int, loss_fn, train_clients, attack, byz):
    """One round after sampling; returns (θ, state, size-weighted train loss)."""
    ctx = method.objective.client_context(state["objective"], ids, theta)
    jobs = _local_jobs(fed, ids, cfg, r, ctx)
    deltas, losses = train_clients(loss_fn, theta, jobs, cfg.lr, method.objective)
    ids_t = torch.as_tensor(ids, device=theta.device)
    if attack is not None and byz[ids_t].any():
        gen = torch.Generator(device="cpu").manual_seed(int(rng(cfg.seed, ATTACK, r).integers(2**62)))
        deltas = attack(deltas, byz[ids_t], generator=gen)
    sizes = torch.tensor([float(len(j.y)) for j in jobs], device=theta.device)
    steps = torch.tensor([float(len(j.batches)) for j in jobs], device=theta.device)
    info = RoundInfo(r, np.asarray(ids), sizes, steps, fed.num_clients, cfg.lr)
    return server_update(method, state, theta, info, deltas, losses, cfg.on_nonfinite)


def server_update(method: Method, state: dict, theta: torch.Tensor, info: RoundInfo, deltas: torch.Tensor,
                  losses: torch.Tensor, on_nonfinite: str = "raise"):
    """The server half of a round — non-finite check, objective bookkeeping, aggregation, server step;
    returns (θ, state, size-weighted train loss). Shared with the Flower strategy."""
    keep = torch.isfinite(deltas.sum(1))  # one pass, no [m, d] temporaries (1,000 clients × 200k params)
    if not keep.all():  # a row sum can overflow with finite entries: check those rows entry by entry
        rows = (~keep).nonzero().ravel()
        keep[rows] = torch.isfinite(deltas[rows]).all(1)
    if not keep.all():
        bad = [int(k) for k in info.client_ids[~keep.cpu().numpy()]]
        if on_nonfinite == "raise":
            raise NonFiniteUpdateError(f"round {info.round + 1}: client(s) {bad} returned a non-finite update (NaN/inf). "
                                       f"Lower lr (now {info.lr}), check the data, or pass on_nonfinite='drop' "
                                       "to drop such updates")
        if not keep.any():
            return theta, state, float("nan")
        k = keep.cpu().numpy()
        info = replace(info, client_ids=info.client_ids[k], sizes=info.sizes[keep], steps=info.steps[keep])
        deltas, losses = deltas[keep], losses[keep]
    deltas, state["objective"] = method.objective.after_local(state["objective"], deltas, info)
    agg, state = method.aggregate(state, deltas, info)
    theta, state = method.server_step(state, theta, agg)
    return theta, state, float((info.sizes @ losses) / info.sizes.sum())
