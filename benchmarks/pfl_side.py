"""pfl-research's side of `bench_pfl.py`: FedAvg rounds in pfl's own simulation loop on a workload that
the fedlab_nb side exported to a folder (`bench_pfl.export_workload`).

    .venv-pfl/bin/python benchmarks/pfl_side.py FOLDER      # prints one JSON line; writes FOLDER/pfl_theta.npy

Runs in `.venv-pfl` (scripts/setup_pfl.sh: torch and pfl 0.6.0, no fedlab_nb). It imports only numpy, torch and
pfl; the model classes come from fedlab_nb/models.py loaded by its path (that file imports torch alone), so both
sides train the same eager modules from the same initial state_dict. `load_workload` (no pfl needed) is also
what the round-trip test reads.

What pfl runs: `FederatedAveraging` with `SimulatedBackend`, its `PyTorchModel` adapter (local optimiser
`torch.optim.SGD` at the workload's lr, a new one per user, pfl's own `do_multiple_epochs_of` loop: one epoch
of consecutive batches of the user's `Dataset`), `WeightByDatapoints` (each update weighted by the user's rows,
as fedlab_nb's FedAvg weights by data size) and a central `torch.optim.SGD` with lr 1 on the averaged update
(θ ← θ + Σ n_k Δ_k / Σ n_k, fedlab_nb's `ServerSGD(lr=1)`). The cohort of each round is fedlab_nb's (every
client on bench_backends' workloads; 50 of 1,000 on pfl's headline workload), drawn in the same order.
pfl's Dataset iterates in order without shuffling, so the user's rows for round r
are handed to it in fedlab_nb's batch order of that round (the exported schedule): both sides then take the
same SGD steps on the same batches, and the final weights agree up to float rounding.

On a GPU (PFL_PYTORCH_DEVICE=cuda, `bench_pfl.py --device cuda`) the data, the model and every user's rows live
on the device; the clock synchronises before each reading.

Timing: CPU seconds (time.process_time, this process) and wall seconds between the ends of consecutive central
iterations (pfl's `after_central_iteration` callback): each includes sampling the cohort, making each user's
dataset, local training, the weighting postprocessor, aggregation and the central update.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

MODELS_FILE = Path(__file__).resolve().parents[1] / "fedlab_nb" / "models.py"


def models_module(path: Path = MODELS_FILE):
    """fedlab_nb/models.py as a stand-alone module (it imports only torch), without importing fedlab_nb."""
    spec = importlib.util.spec_from_file_location("fedlab_models_standalone", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_workload(folder) -> dict:
    """What `bench_pfl.export_workload` wrote: meta, the data, the partitions, each round's batch order and
    the initial state_dict. `rows(r, k)`: the row indices (into x_train) client k trains on in round r, in
    its batch order; `cohorts[r]`: the clients of round r, in fedlab_nb's sampling order."""
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    parts = np.load(folder / "partitions.npz")
    offsets, index, order, cohorts = parts["offsets"], parts["index"], parts["order"], parts["cohorts"]
    K = meta["clients"]
    w = dict(meta=meta, offsets=offsets, index=index, order=order, cohorts=cohorts,
             x_train=np.load(folder / "x_train.npy"), y_train=np.load(folder / "y_train.npy"),
             x_test=np.load(folder / "x_test.npy"), y_test=np.load(folder / "y_test.npy"),
             state_dict=torch.load(folder / "init.pt", weights_only=True))
    # order[r, offsets[k]:offsets[k+1]]: positions within client k's rows, in round r's batch order
    w["rows"] = lambda r, k: index[offsets[k]:offsets[k + 1]][order[r, offsets[k]:offsets[k + 1]]]
    w["client_rows"] = [int(offsets[k + 1] - offsets[k]) for k in range(K)]
    return w


class SimpleCNN(torch.nn.Module):
    """pfl-research's `simple_cnn` (benchmarks/model/pytorch/cnn.py, its CIFAR-10 model): 3×3 conv 32, 3×3 conv
    64, 2×2 max-pool, dense 128, output; Glorot-uniform weights. Differences: no dropout (fedlab_nb's vmap
    backend trains pure functions of (θ, batch), and dropout's random masks would make the two sides' weights
    differ), and inputs are flat C×H×W rows reshaped here (pfl's model permutes H×W×C images)."""

    def __init__(self, input_shape, num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.input_shape = tuple(input_shape)
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(c, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Flatten())
        self.head = torch.nn.Sequential(torch.nn.Linear(64 * ((h - 4) // 2) * ((w - 4) // 2), 128),
                                        torch.nn.ReLU(), torch.nn.Linear(128, num_classes))
        for m in self.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                torch.nn.init.xavier_uniform_(m.weight)

    def forward(self, x):
        return self.head(self.features(x.reshape(x.shape[0], *self.input_shape)))


def build_model(meta: dict, state_dict=None) -> torch.nn.Module:
    """The workload's model (fedlab_nb's own class by name, or pfl's simple CNN above) with the exported
    initial weights."""
    shape, classes = tuple(meta["input_shape"]), meta["num_classes"]
    model = SimpleCNN(shape, classes) if meta["model_name"] == "pfl_simple_cnn" else \
        models_module().make_model(meta["model_name"], shape, classes, **meta["model_kwargs"])
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2048) -> float:
    with torch.no_grad():
        correct = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum()) for i in range(0, len(y), batch))
    return correct / len(y)


def run(folder) -> dict:
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.metrics import Weighted
    from pfl.model.pytorch import PyTorchModel

    w = load_workload(folder)
    meta = w["meta"]
    R, cohorts = meta["rounds"], w["cohorts"]
    m = cohorts.shape[1]
    torch.set_num_threads(meta["threads"])
    device = torch.device(os.environ.get("PFL_PYTORCH_DEVICE", "cpu"))   # pfl's own setting, read by PyTorchModel
    x_train, y_train = torch.from_numpy(w["x_train"]).to(device), torch.from_numpy(w["y_train"]).to(device)
    net = build_model(meta, w["state_dict"]).to(device)
    trained = [0] * R          # rows pfl's loop put through the loss, per round (the same-work check)
    round_of = {"r": 0}

    def loss(self, x, y):
        trained[round_of["r"]] += len(y)
        return torch.nn.functional.cross_entropy(self(x), y)

    def metrics(self, x, y):
        with torch.no_grad():
            out = self(x)
            return {"loss": Weighted(float(torch.nn.functional.cross_entropy(out, y, reduction="sum")), len(y)),
                    "accuracy": Weighted(float((out.argmax(1) == y).sum()), len(y))}
    net.loss = loss.__get__(net)        # pfl's PyTorchModel needs `loss` and `metrics` on the module itself
    net.metrics = metrics.__get__(net)

    # Users are drawn in fedlab_nb's sampling order: the c-th draw is client cohorts[c // m][c % m] of round c // m.
    draws = iter(range(R * m))

    def make_dataset(c):
        r, i = divmod(c, m)
        k = int(cohorts[r, i])
        rows = torch.from_numpy(w["rows"](r, k)).to(device)
        return Dataset(raw_data=[x_train[rows], y_train[rows]], user_id=k)

    training = FederatedDataset(make_dataset, lambda: next(draws))
    backend = SimulatedBackend(training_data=training, val_data=None, postprocessors=[WeightByDatapoints()])
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    algorithm_params = NNAlgorithmParams(central_num_iterations=R, evaluation_frequency=R + 1,
                                         train_cohort_size=m, val_cohort_size=0)
    train_params = NNTrainHyperParams(local_learning_rate=meta["lr"], local_num_epochs=1,
                                      local_batch_size=meta["batch"])
    stamps = []

    def now():
        if device.type == "cuda":
            torch.cuda.synchronize(device)   # wall time must include the queued kernels
        return time.process_time(), time.perf_counter()

    class Clock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            stamps.append(now())
            return super().on_train_begin(model=model)

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stamps.append(now())
            round_of["r"] = min(central_iteration + 1, R - 1)
            return super().after_central_iteration(aggregate_metrics, model, central_iteration=central_iteration)

    FederatedAveraging().run(algorithm_params=algorithm_params, backend=backend, model=model,
                             model_train_params=train_params, callbacks=[Clock()])
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu().numpy()
    np.save(Path(folder) / "pfl_theta.npy", theta)
    return dict(cpu_seconds=[b[0] - a[0] for a, b in zip(stamps, stamps[1:])],
                seconds=[b[1] - a[1] for a, b in zip(stamps, stamps[1:])],
                rows_per_round=trained,
                test_acc=accuracy(net, torch.from_numpy(w["x_test"]).to(device), torch.from_numpy(w["y_test"]).to(device)),
                threads=torch.get_num_threads(), torch=torch.__version__, pfl=_pfl_version())


def _pfl_version() -> str:
    try:
        from importlib.metadata import version
        return version("pfl")
    except Exception:   # noqa: BLE001 - only a label
        return "?"


if __name__ == "__main__":
    os.environ.setdefault("PFL_PYTORCH_DEVICE", "cpu")
    print(json.dumps(run(sys.argv[1])))
