"""Seeds as a batch dimension: S independent runs of one method, stepped in lockstep, whose local training
is one vectorised computation of S × m clients per round.

A multi-seed claim needs S runs that differ only in their seed (θ₀, client sampling, mini-batches and,
when `fed` is a function of the seed, the partition). Each round, every run samples its clients and builds
its jobs exactly as `simulate` would; the S·m jobs then train in one call of the kernel, each job starting
from its own run's θ (the kernel's `start` rows); the server half (weighting, rule, server optimiser) and
the evaluation stay per run. So `simulate_seeds(method, fed, seeds=range(5))[i]` equals
`simulate(method, fed, seed=i)` up to floating-point summation order (tests/test_seeds.py), in fewer,
larger vectorised steps.

It applies to methods whose client side is the plain one (`ClientUpdate`, one track, no client state and no
uplink/downlink transforms: FedAvg, FedAvgM, FedOpt, and any weighting, robust rule or server optimiser
on top); `seed_batchable(method)` says whether a method qualifies, and the error names the reason.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.method import ChecksSampler, ClientUpdate, Method, declares
from ..core.messages import Messages
from ..core.streams import SAMPLE
from ..data.federated import FederatedDataset
from ..models import flatten_params, param_spec
from ..utils import check_seeds, rng
from .client import make_loss
from .evaluate import Evaluator
from .history import History
from .rows import RoundRows
from .sampling import check_sampled, make_sampler
from .server import (RoundSetup, RunConfig, build_model, check_model_outputs, choose_backend, empty_info, finish_clients,
                     kernel, quiet_round, round_info, round_jobs, server_update)


def seed_batchable(method: Method) -> str | None:
    """None if `simulate_seeds` can run this method, else why not."""
    if type(method.client) is not ClientUpdate:
        return f"{method.name} has its own client update ({type(method.client).__name__})"
    if method.uplink or method.downlink:
        return f"{method.name} transforms its messages (uplink/downlink)"
    if method.groups.local:  # kept-local tensors live in each client's state, one store per run
        return f"{method.name} keeps parameters local to each client ({', '.join(method.groups.local)})"
    probe = torch.zeros(2)
    if method.objective.client_state(probe):
        return f"{method.name} keeps per-client state"
    if method.objective.correction(probe, probe, None) is not None or method.objective.extra_loss is not None:
        return f"{method.name}'s local objective is anchored at the global model (one anchor per run)"
    return None


def simulate_seeds(method: Method, fed: FederatedDataset | Callable[[int], FederatedDataset], model="mlp", *,
                   seeds: Sequence[int] = range(5), rounds: int = 20, clients_per_round=None, local_epochs: int = 1,
                   local_steps: int | None = None, batch_size: int = 32, lr: float = 0.05, eval_every: int = 1,
                   backend: str = "auto", model_kwargs: dict | None = None) -> list[History]:
    """One `History` per seed, as `simulate(method, fed, model, seed=s, ...)` would return, computed with the
    S runs' clients trained together. `fed`: one federated data set for every seed, or `fed(seed)`."""
    if not isinstance(method, Method):
        raise TypeError(f"method must be a fedlab_nb Method, got {type(method).__name__}; build one with "
                        "fedlab_nb.get_method(name)")
    why = seed_batchable(method)
    if why is not None:
        raise ValueError(f"simulate_seeds cannot batch this method: {why}; run simulate once per seed instead")
    seeds = check_seeds(seeds)  # '12' is not seeds 1 and 2, 1.9 not seed 1
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct non-negative integers, got {seeds}")
    feds = [fed(s) if callable(fed) else fed for s in seeds]
    cfgs = [RunConfig(rounds=rounds, clients_per_round=None if callable(clients_per_round) else clients_per_round,
                      local_epochs=local_epochs, local_steps=local_steps, batch_size=batch_size, lr=lr, seed=s,
                      eval_every=eval_every, backend=backend) for s in seeds]
    for c, f in zip(cfgs, feds):
        c.validate(f.num_clients)
    if isinstance(model, torch.nn.Module):
        raise ValueError("simulate_seeds draws each seed's θ₀ itself: pass the model by name ('mlp', 'cnn' ...)")
    models = [build_model(model, f, s, model_kwargs) for f, s in zip(feds, seeds)]
    for m, f in zip(models, feds):
        check_model_outputs(m, f, None)  # as simulate: the inputs' dtype, one output per class
    groups = method.groups.resolve(param_spec(models[0]))
    loss_fn = make_loss(models[0])
    backend = choose_backend(cfgs[0], method, models[0], feds[0].device)
    train = kernel(backend)
    setups = [RoundSetup(method, f, c, loss_fn, groups, train, backend=backend) for f, c in zip(feds, cfgs)]
    thetas = [flatten_params(m).to(f.device) for m, f in zip(models, feds)]
    states = [method.init_state(t, f.num_clients) for t, f in zip(thetas, feds)]
    samplers = [make_sampler(clients_per_round, f.num_clients) for f in feds]
    if declares(method.rule, ChecksSampler):  # DP: the sampling its accountant assumes, before round 1 (as simulate)
        for smp, f in zip(samplers, feds):
            method.rule.check_sampler(smp, f.num_clients)
    evaluators = [Evaluator(m, f, None) for m, f in zip(models, feds)]
    rows, reused = [[] for _ in seeds], RoundRows()
    t0 = time.perf_counter()
    for r in range(rounds):
        ids = [check_sampled(smp(r, f.num_clients, rng(s, SAMPLE, r)), f.num_clients, r)
               for smp, f, s in zip(samplers, feds, seeds)]
        jobs = [round_jobs(s, r, i) if len(i) else [] for s, i in zip(setups, ids)]
        W = _train_together(train, loss_fn, method, thetas, jobs, lr, groups, reused)
        for i in range(len(seeds)):
            row = {"round": r + 1, "n_sampled": int(len(ids[i])), "train_loss": float("nan"), "bytes_up": 0,
                   "bytes_down": 0}
            if len(ids[i]):
                thetas[i], states[i], out = _server_half(setups[i], states[i], thetas[i], W[i], r, ids[i], jobs[i])
            else:  # as simulate: DP still releases a noised θ (and its accountant's ε) in a round nobody was sampled in
                thetas[i], states[i], out = quiet_round(method, states[i], thetas[i],
                                                        empty_info(setups[i], r, thetas[i], ids[i]), groups)
            row.update(out)
            if (r + 1) % eval_every == 0 or r + 1 == rounds:
                row.update(evaluators[i](thetas[i]))
            rows[i].append(row)
    seconds = time.perf_counter() - t0
    return [_history(method, f, c, rows_i, theta, m, seconds) for f, c, rows_i, theta, m
            in zip(feds, cfgs, rows, thetas, models)]


def _train_together(train, loss_fn, method, thetas, jobs, lr, groups, reused: RoundRows):
    """Every run's jobs in one kernel call, each from its own θ, into `reused`'s rows matrix; returns the trained
    rows per run."""
    flat = [j for js in jobs for j in js]
    if not flat:
        return [None] * len(jobs)
    start = torch.cat([t.repeat(len(js), 1) for t, js in zip(thetas, jobs)])
    W, losses = train(loss_fn, thetas[0], flat, lr, method.objective, start=start, optimizer=method.optimizer,
                      groups=groups, weights=True, out=reused.take("w", len(flat), thetas[0]))
    out, i = [], 0
    for js in jobs:
        out.append((W[i:i + len(js)], losses[i:i + len(js)]))
        i += len(js)
    return out


def _server_half(s: RoundSetup, state, theta, trained, r, ids, jobs):
    """One run's client finish and server update, with the one round's pieces (`engine.server`)."""
    W, losses = trained
    entries, _ = finish_clients(s, {"w": W.clone()}, theta, {"theta": theta}, {}, jobs)
    msgs = Messages(entries, np.asarray(ids))
    theta, state, loss = server_update(s.method, state, theta, round_info(s, r, ids, jobs, theta, msgs, ids), msgs,
                                       losses, s.cfg.on_nonfinite, s.groups)
    return theta, state, {"train_loss": loss, **s.method.round_metrics(state)}


def _history(method, fed, cfg, rows, theta, model, seconds) -> History:
    meta = {"method": method.name, "dataset": fed.dataset.name, "partition": fed.partition.name,
            "clients": fed.num_clients, "seed": cfg.seed, "rounds": cfg.rounds, "lr": cfg.lr,
            "batch_size": cfg.batch_size, "local_epochs": cfg.local_epochs, "seed_batched": True,
            "seconds_all_seeds": seconds}
    hist = History.from_rows(rows, meta)
    hist.theta, hist.model = theta, model
    return hist
