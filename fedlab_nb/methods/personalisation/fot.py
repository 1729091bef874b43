"""FOT — Bakman, Yaldiz, Ezzeldin, Avestimehr, "Federated Orthogonal Training: Mitigating Global Catastrophic
Forgetting in Continual Federated Learning", ICLR 2024 (arXiv 2309.01289).
Official code: https://github.com/duygunuryldz/Federated_Orthogonal_Training

Continual FL: tasks arrive one after the other; a task is one `simulate` run that starts from the previous
task's global model. FOT has two parts, both on the server side of the round pipeline:

- **FedProject** (during task t > 1): clients train plainly; the server projects the aggregated update of
  every linear layer orthogonally to the old tasks' input subspace, ΔW_l ← ΔW_l − ΔW_l U_l U_lᵀ
  (`LayerBases.project`, applied by the server optimiser `OrthogonalServerSGD`). For an old-task input x in
  span(U_l) the layer's output does not move: (W + ΔW)x = Wx.
- **Global principal subspace extraction** (at the end of each task): client k stacks the inputs of layer l
  on its task data as columns, R_k (d_l × n_k), removes what the current basis already explains,
  R̂_k = R_k − U Uᵀ R_k, and uploads only the sketch R̂_k G_k with a private random G_k ∈ U(−1, 1)^{n_k × d_l}
  (plus ‖R̂_k‖/‖R_k‖ and n_k). The sum Σ_k R̂_k G_k = [R̂_1 … R̂_K] [G_1; …; G_K] is what secure aggregation
  hands the server: a randomised range sketch of all clients' residual activations, d_l × d_l whatever
  the data size, with no raw activation revealed. The server takes its top left singular vectors up to an
  energy threshold and appends them to U_l (QR keeps it orthonormal).

Checked against the official code (FedAVGAggregator.expand_orth_set / aggregate, trainer/mnist_trainer.py
collect_activations): the random matrix's shape and U(−1, 1) entries; the threshold adapted for what the old
basis already captures, ε' = (r̄ − (1 − ε)) / r̄ with r̄ the sample-weighted mean of the clients' norm ratios
‖R̂_k‖_F / ‖R_k‖_F, and the smallest k with Σ_{i≤k} σ_i² / ‖S‖_F² > ε'; ε grows by `eps_inc` after each task;
only the layers' weight matrices are projected (biases, as there, move freely); activations are taken on
each client's training data of the finished task (here from every client of the task; the official code
asks the clients of the task's last round, the same set when all clients take part). Evaluation as there: ACC = mean accuracy over all tasks
after the last one, forgetting = mean over the old tasks of (accuracy at the end of its own task − final).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...core.registry import get_method, register
from ...core.streams import register_stream
from ...engine import simulate
from ...engine.evaluate import evaluate
from ...models import load_flat, param_spec
from ...utils import rng
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean

FOT_SKETCH = register_stream("fot_sketch", 47)  # each client's private random sketch matrix G_k


# --- FedProject: the orthogonal projection of the aggregated update ------------------------------------
def linear_layers(spec) -> dict[str, tuple[int, int, int]]:
    """{weight name: (offset in the flat vector, out, in)} of every 2-D weight (the linear layers)."""
    out, offset = {}, 0
    for name, shape in spec:
        n = int(np.prod(shape))
        if len(shape) == 2 and name.endswith("weight"):
            out[name] = (offset, int(shape[0]), int(shape[1]))
        offset += n
    return out


@dataclass
class LayerBases:
    """An orthonormal basis U_l (in_l × k_l) of the old tasks' input subspace for each linear layer."""
    spec: list
    bases: dict = field(default_factory=dict)

    def __post_init__(self):
        layers = linear_layers(self.spec)
        for name, U in self.bases.items():
            if name not in layers:
                raise ValueError(f"bases has {name!r}, which is not a linear layer's weight; use one of {sorted(layers)}")
            if U.dim() != 2 or U.shape[0] != layers[name][2]:
                raise ValueError(f"basis of {name} must be (in={layers[name][2]}, k), got {tuple(U.shape)}")

    def dims(self) -> dict[str, int]:
        """k_l: the number of protected directions of each layer."""
        return {name: int(U.shape[1]) for name, U in self.bases.items()}

    def project(self, update: torch.Tensor) -> torch.Tensor:
        """ΔW_l ← ΔW_l − ΔW_l U_l U_lᵀ for every layer with a basis (computed in float64); all other entries
        (biases, layers without a basis) are returned untouched, bit for bit."""
        out = update.clone()
        layers = linear_layers(self.spec)
        for name, U in self.bases.items():
            if U.shape[1] == 0:
                continue
            o, rows, cols = layers[name]
            dW = update[o:o + rows * cols].reshape(rows, cols).double()
            U = U.to(device=update.device, dtype=torch.float64)
            out[o:o + rows * cols] = (dW - (dW @ U) @ U.T).reshape(-1).to(update.dtype)
        return out

    def residual(self, update: torch.Tensor) -> float:
        """max_l ‖ΔW_l U_l‖_F / ‖ΔW_l‖_F: how much of an update lies in the protected subspaces (0 after
        `project`, up to rounding)."""
        worst, layers = 0.0, linear_layers(self.spec)
        for name, U in self.bases.items():
            o, rows, cols = layers[name]
            dW = update[o:o + rows * cols].reshape(rows, cols).double()
            norm = float(dW.norm())
            if U.shape[1] and norm > 0:
                worst = max(worst, float((dW @ U.to(dW)).norm()) / norm)
        return worst


@dataclass
class OrthogonalServerSGD(ServerSGD):
    """θ ← θ + η_g · P(Δ̄): FedAvg's server step on the projected aggregate (FOT's FedProject). The History
    column `fot_residual` is max_l ‖P(Δ̄)_l U_l‖ / ‖P(Δ̄)_l‖ of the round's applied update."""
    bases: LayerBases | None = None

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {**super().init_state(theta, num_clients), "residual": torch.zeros((), dtype=torch.float64)}

    def step(self, theta: torch.Tensor, update: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        if self.bases is not None:
            update = self.bases.project(update)
        theta, inner = super().step(theta, update, {k: v for k, v in state.items() if k != "residual"})
        residual = self.bases.residual(update) if self.bases is not None else 0.0
        return theta, {**inner, "residual": torch.tensor(residual, dtype=torch.float64)}

    def metrics(self, state: dict) -> dict:
        return {"fot_residual": float(state["residual"])}


@register("fot", claims="fot")
def fot(bases: LayerBases | None = None, server_lr: float = 1.0) -> Method:
    """FedAvg clients and weighting; the server projects the aggregate orthogonally to `bases` (the old
    tasks' subspaces; None on the first task, where FOT is FedAvg). Run a task sequence with `run_continual`."""
    return Method("fot", LocalObjective(), DataSizeWeighting(), weighted_mean,
                  OrthogonalServerSGD(lr=server_lr, bases=bases))


# --- global principal subspace extraction --------------------------------------------------------------
@torch.no_grad()
def layer_inputs(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """{weight name: the inputs of that linear layer on the rows of x, as columns (in × n)}, for the model
    with flat parameters θ."""
    load_flat(model, theta)
    seen, hooks = {}, []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            key = f"{mod_name}.weight" if mod_name else "weight"
            hooks.append(mod.register_forward_pre_hook(lambda m, inp, key=key: seen.__setitem__(key, inp[0].detach())))
    was = model.training
    try:
        model.eval()(x)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return {k: v.reshape(len(x), -1).T.double() for k, v in seen.items()}


def client_sketch(acts: dict[str, torch.Tensor], bases: LayerBases, generator: torch.Generator) -> dict:
    """Client k's upload for each layer: (R̂_k G_k [in × in], ‖R̂_k‖_F/‖R_k‖_F, n_k) with R̂_k the part of
    its activations R_k outside the current basis and G_k its private U(−1, 1) matrix."""
    out = {}
    for name, R in acts.items():
        U = bases.bases.get(name)
        ratio = 1.0
        if U is not None and U.shape[1]:
            U = U.to(R)
            total = float(R.norm())
            R = R - U @ (U.T @ R)
            ratio = float(R.norm()) / total if total > 0 else 0.0
        G = torch.rand(R.shape[1], R.shape[0], generator=generator, dtype=torch.float64) * 2 - 1
        out[name] = (R @ G, ratio, R.shape[1])
    return out


def expand_bases(bases: LayerBases, uploads: list[dict], threshold: float) -> LayerBases:
    """The server's step: sum the clients' sketches (what secure aggregation reveals), take the top left
    singular vectors of the sum up to the adapted energy threshold, append them to each layer's basis."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold is an energy fraction in (0, 1], e.g. 0.97, got {threshold!r}")
    new = dict(bases.bases)
    for name in uploads[0]:
        S = sum(u[name][0] for u in uploads)
        sizes = np.array([u[name][2] for u in uploads], dtype=float)
        r = float(np.sum(sizes / sizes.sum() * np.array([u[name][1] for u in uploads])))
        old = new.get(name)
        k_old = 0 if old is None else old.shape[1]
        total = float((S ** 2).sum())
        if r <= 0 or total <= 0 or k_old >= S.shape[0]:
            continue  # nothing left outside the basis (or the layer is full)
        eps = (r - (1 - threshold)) / r  # the old basis already explains part of the energy
        U, sigma, _ = torch.linalg.svd(S, full_matrices=False)
        energy = torch.cumsum(sigma ** 2, 0) / total
        k = int((energy > eps).nonzero()[0]) + 1 if bool((energy > eps).any()) else len(sigma)
        k = min(k, S.shape[0] - k_old)
        stacked = U[:, :k] if old is None else torch.cat([old.to(U), U[:, :k]], dim=1)
        new[name] = torch.linalg.qr(stacked).Q
    return LayerBases(bases.spec, new)


def extract_subspaces(model: torch.nn.Module, theta: torch.Tensor, fed, bases: LayerBases, threshold: float,
                      seed: int = 0, task: int = 0) -> tuple[LayerBases, int]:
    """End of a task: every client of `fed` sketches its layer inputs on its training data (its random
    matrix keyed by (seed, FOT_SKETCH, task, k)); the server expands the bases from the summed sketches.
    Returns (the new bases, the bytes uploaded: sketches in θ's dtype plus two numbers per layer)."""
    uploads, sent = [], 0
    for k, (x, _) in enumerate(fed.client_train):
        g = torch.Generator().manual_seed(int(rng(seed, FOT_SKETCH, task, k).integers(2**62)))
        uploads.append(client_sketch(layer_inputs(model, theta, x), bases, g))
        sent += sum((S.numel() + 2) * theta.element_size() for S, _, _ in uploads[-1].values())
    return expand_bases(bases, uploads, threshold), sent


# --- a task sequence ---------------------------------------------------------------------------------
@dataclass
class ContinualResult:
    """acc[t, j]: the global model's accuracy on task j's test set after training task t."""
    acc: np.ndarray
    basis_dims: list = field(default_factory=list)     # {layer: k_l} after each task (FOT)
    residual: list = field(default_factory=list)       # the largest fot_residual of each task's rounds
    thetas: list = field(default_factory=list)         # the global model after each task
    bytes_up: int = 0                                  # model updates uploaded during training, all tasks
    sketch_bytes: int = 0                              # FOT's subspace uploads (the clients' sketches), all tasks

    @property
    def average_accuracy(self) -> float:
        """ACC: mean accuracy over all tasks after the last one."""
        return float(self.acc[-1].mean())

    @property
    def forgetting(self) -> float:
        """FGT: mean over the old tasks of (accuracy at the end of its own task − accuracy at the end)."""
        T = len(self.acc)
        return float(np.mean([self.acc[j, j] - self.acc[-1, j] for j in range(T - 1)])) if T > 1 else 0.0


def run_continual(method, tasks: list, model: torch.nn.Module, *, threshold: float = 0.97, eps_inc: float = 0.0,
                  seed: int = 0, method_kwargs: dict | None = None, **simulate_kwargs) -> ContinualResult:
    """Train `model` on the federated tasks in order, each task one `simulate` call from the previous
    task's global model (the engine takes an nn.Module's weights as θ₀). `method`: "fot" (with subspace
    extraction at `threshold` after every task) or the name of a fine-tuning baseline ("fedavg", "fedprox").
    Task t's run uses seed 1000·seed + t. Returns the accuracy matrix and FOT's basis sizes."""
    if not isinstance(method, str):
        raise ValueError(f"method must be a registered name ('fot', 'fedavg', 'fedprox', ...), got {method!r}")
    if not tasks:
        raise ValueError("tasks is empty; build them with fedlab_nb.data.continual.federate_tasks(...)")
    model = model.to(tasks[0].device)
    bases = LayerBases(param_spec(model))
    T = len(tasks)
    result = ContinualResult(np.zeros((T, T)))
    for t, fed in enumerate(tasks):
        if method == "fot":
            m = fot(bases if bases.bases else None, **(method_kwargs or {}))
        else:
            m = get_method(method, **(method_kwargs or {}))
        hist = simulate(m, fed, model, seed=1000 * seed + t, progress=False, **simulate_kwargs)
        theta = hist.theta
        result.bytes_up += int(hist["bytes_up"].sum())
        load_flat(model, theta)  # the next task starts from this global model
        if "fot_residual" in hist:
            result.residual.append(float(hist["fot_residual"].max()))
        for j, other in enumerate(tasks):
            result.acc[t, j] = evaluate(model, theta, other.x_test, other.y_test)[1]
        if method == "fot" and t < T - 1:
            bases, sent = extract_subspaces(model, theta, fed, bases, min(1.0, threshold + t * eps_inc), seed, t)
            result.sketch_bytes += sent
            result.basis_dims.append(bases.dims())
        result.thetas.append(theta.clone())
    return result
