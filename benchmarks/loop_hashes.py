"""Bit-identity guard for the `loop` backend (issue 43, item 2): runs `simulate(backend="loop")` for a set of
representative methods and run options on a tiny federation and hashes every number a run produces: the History
(every column, every round, NaN included), the final θ, the model's buffers, the client store and the server state.

    python benchmarks/loop_hashes.py --save /tmp/loop_hashes.json     # on the commit before a change
    python benchmarks/loop_hashes.py --check /tmp/loop_hashes.json    # after it: every hash must be equal

A change to the loop that keeps every result bit for bit passes `--check`; any difference in any bit of any
tensor or History value fails it, naming the runs. ≈ 1 min on one thread."""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb.core.optim import SGD, Adam
from fedlab_nb.engine.sampling import BernoulliSampler
from fedlab_nb.methods import get_method
from fedlab_nb.models import flatten_buffers


def _digest(obj, h) -> None:
    """Feed every tensor / array / number / string inside obj into the hash h, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(f"K{k}".encode())
            _digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _digest(v, h)
    elif isinstance(obj, (bool, int, float, str, type(None), np.generic)):
        h.update(repr(obj).encode())
    else:  # an object in the state (an accountant ...): its public fields
        _digest({k: v for k, v in vars(obj).items() if not k.startswith("_")} if hasattr(obj, "__dict__")
                else repr(obj), h)


def run_hashes(hist) -> dict:
    """{part: sha256} of one run's History, final θ, buffers, client store and server state."""
    out = {}
    frame = hist.astype({c: float for c in hist.columns if hist[c].dtype != object})
    for name, obj in (("history", {c: frame[c].to_numpy() for c in frame.columns}), ("theta", hist.theta),
                      ("buffers", flatten_buffers(hist.model, hist.theta.dtype)),
                      ("store", hist.store.state_dict() if hist.store else {}), ("state", hist.state)):
        h = hashlib.sha256()
        _digest(obj, h)
        out[name] = h.hexdigest()[:16]
    return out


def runs():
    """(name, method, model, simulate kwargs): the representative set."""
    half = BernoulliSampler(np.linspace(0.3, 0.9, 8))
    return [
        ("fedavg", "fedavg", "mlp", {}),
        ("fedavg_logreg", "fedavg", "logreg", {}),
        ("fedavg_cnn", "fedavg", "cnn", dict(rounds=2)),
        ("fedavg_cnn_mnist", "fedavg", "cnn", dict(rounds=1, dataset="mnist5k", batch_size=10)),
        ("fedavg_steps_partial", "fedavg", "mlp", dict(local_steps=7, clients_per_round=3)),
        ("fedavg_momentum", get_method("fedavg"), "mlp", dict(optimizer=SGD(momentum=0.9, weight_decay=1e-3))),
        ("fedavg_adam", get_method("fedavg"), "mlp", dict(optimizer=Adam(lr=1e-3))),
        ("fedprox", "fedprox", "mlp", {}),
        ("scaffold", "scaffold", "mlp", {}),
        ("feddyn", "feddyn", "mlp", {}),
        ("fednova", "fednova", "mlp", dict(local_epochs=2)),
        ("fedadam", "fedadam", "mlp", {}),
        ("dp_fedavg", get_method("dp_fedavg", sampling_rate=0.5, sampling="fixed"), "mlp", dict(clients_per_round=4)),
        ("ditto", "ditto", "mlp", {}),
        ("fedrep", "fedrep", "mlp", {}),
        ("fedbn", "fedbn", "mlp_bn", {}),
        ("fedavg_bn", "fedavg", "cnn_bn", dict(rounds=2)),
        ("moon", "moon", "mlp", dict(rounds=2)),
        ("qffl", "qffl", "mlp", {}),
        ("robust_median", get_method("robust", rule="median"), "mlp", {}),
        ("pfedme", "pfedme", "mlp", dict(rounds=2)),
        ("per_fedavg", "per_fedavg", "mlp", dict(rounds=2)),
        ("pgfed", "pgfed", "mlp", {}),
        ("stragglers", "fedavg", "mlp", dict(stragglers=0.5)),
        ("drop_stragglers", "fedavg", "mlp", dict(stragglers=0.5, drop_stragglers=True)),
        ("bernoulli_sampling", "fedavg", "mlp", dict(clients_per_round=half)),
        ("fedavg_float64", "fedavg", "double", {}),
        ("fedavg_criterion", "fedavg", "mlp", dict(loss=partial(F.cross_entropy, label_smoothing=0.1))),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save")
    ap.add_argument("--check")
    ap.add_argument("--only", default="", help="comma-separated run names")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    only = {s for s in a.only.split(",") if s}
    got = {}
    for name, method, model, kw in runs():
        if only and name not in only:
            continue
        kw = dict(kw)
        opt = kw.pop("optimizer", None)
        dataset = kw.pop("dataset", "digits")
        if opt is not None:
            method.optimizer = opt
        fed = fl.federate(dataset, "dirichlet", n_clients=8, seed=0, alpha=0.5)
        if model == "double":  # float64 rows and a float64 module (kept as given by from_clients)
            fed = fl.FederatedDataset.from_clients([(x.double(), y) for x, y in fed.client_train],
                                                   num_classes=10)
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(fed.client_train[0][0].shape[1], 10)).double()
        base = dict(rounds=3, clients_per_round=None, batch_size=16, lr=0.05, seed=1, progress=False,
                    backend="loop", model_kwargs=None)
        base.update(kw)
        t0 = time.process_time()
        hist = fl.simulate(get_method(method) if isinstance(method, str) else method, fed, model, **base)
        got[name] = run_hashes(hist)
        print(f"{name:22s} {time.process_time() - t0:6.2f} s  " + " ".join(f"{k}={v[:8]}" for k, v in got[name].items()),
              flush=True)
    if a.save:
        with open(a.save, "w") as f:
            json.dump(got, f, indent=1)
    if a.check:
        with open(a.check) as f:
            want = json.load(f)
        bad = [f"{n}.{k}" for n in got for k in got[n] if want.get(n, {}).get(k) != got[n][k]]
        print("bit-identical" if not bad else "DIFFERENT: " + ", ".join(bad))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
