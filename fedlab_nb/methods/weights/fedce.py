"""FedCE — Meirui Jiang, Holger R. Roth, Wenqi Li, Dong Yang, Can Zhao, Vishwesh Nath, Daguang Xu, Qi Dou,
Ziyue Xu, "Fair Federated Medical Image Segmentation via Client Contribution Estimation", CVPR 2023,
https://arxiv.org/abs/2303.16520. Official code: https://github.com/NVIDIA/NVFlare/tree/main/research/fed-ce
(`aggregators/fedce_assembler.py`, server; `learners/supervised_monai_prostate_fedce_learner.py`, client).

FedCE aggregates the clients' updates with weights c_k that estimate each client's contribution, from two scores
that both grow when client k brings something the others do not (the formulas as the official code computes them):

* gradient space (server): with the consensus update g = Σ_j c_j Δ_j and the others' part g_{−k} = g − c_k Δ_k,
  s_k^t = cos(Δ_k, g_{−k}) and a_k = 1 − mean_{rounds ≤ t} s_k (a client whose update points elsewhere scores high);
* data space (client): the "minus model" θ_{−k} = (θ − c_k θ_k)/(1 − c_k), i.e. the global model without client k's
  share of the last aggregate, is scored on client k's validation data (Dice in the paper, accuracy here), and
  b_k = 1 − mean_{rounds ≤ t} metric_k (the round-0 metric counts as 0, as in the code): the others' model is bad
  on k's data → k is needed.

Each score is normalised to sum to one and clipped below at 1e-3; c_k ∝ a_k · b_k ("times") or a_k + b_k ("plus"),
normalised and clipped again; we renormalise after the last clip so that Σ c = 1 (the port does not; it matters
only when a weight hits 1e-3). Round 0 starts from c = 1/K.

Leave-one-out identity: if θ = Σ_j c_j θ_j with Σ_j c_j = 1 (full participation, server lr 1, θ_j = θ^prev + Δ_j),
then (θ − c_k θ_k)/(1 − c_k) = Σ_{j≠k} c_j θ_j / Σ_{j≠k} c_j exactly — the minus model is the others' weighted
average (`leave_one_out_average`).

Simulation shortcut: the minus-model score is one float the client would send; here the weighting evaluates it on
each client's validation rows itself (by default the client's training rows; the paper uses a validation split).
Two choices differ between the port and the notebook's reading of the paper and are options here: the port builds
g with c = 1/K every round (its `self.fedce_coef` is set at round 0 and never updated), `consensus="uniform"`;
the default `consensus="current"` uses the current c_k, as the code's comment ("with current FedCE coefficients")
and the paper describe."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...core.history import per_client_columns
from ...core.registry import register
from ...engine.evaluate import evaluate
from ...core.method import LocalObjective, Method, RoundInfo, ServerSGD

CLIP = 1e-3   # the official code's lower clip on every normalised score


def minus_models(theta: torch.Tensor, coef: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """[m, d] minus models θ_{−k} = (θ − c_k θ_k)/(1 − c_k) from the global θ [d], the weights c [m] that built it
    and the clients' local models θ_k [m, d]."""
    if not ((coef >= 0) & (coef < 1)).all():
        raise ValueError("coef: every weight c_k must lie in [0, 1) (c_k = 1 leaves no other client to average)")
    return (theta - coef[:, None] * local) / (1 - coef[:, None])


def leave_one_out_average(coef: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """[m, d] Σ_{j≠k} c_j θ_j / Σ_{j≠k} c_j for every k (what the minus model equals when θ = Σ_j c_j θ_j)."""
    total = coef @ local
    return (total - coef[:, None] * local) / (coef.sum() - coef)[:, None]


def gradient_similarity(deltas: torch.Tensor, coef: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """s_k = cos(Δ_k, g − c_k Δ_k) with g = Σ_j c_j Δ_j: how much client k's update agrees with the others'."""
    others = coef @ deltas - coef[:, None] * deltas
    return (deltas * others).sum(1) / (deltas.norm(dim=1) * others.norm(dim=1)).clamp_min(eps)


def _normalise_clip(x: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    x = x / total if total > 0 else torch.full_like(x, 1.0 / len(x))  # all-zero scores (exact copies): uniform
    return x.clamp_min(CLIP)


def fedce_weights(a: torch.Tensor, b: torch.Tensor, mode: str = "times") -> torch.Tensor:
    """The FedCE aggregation weights from the gradient scores a [m] and data scores b [m] (both ≥ 0)."""
    if mode not in ("times", "plus"):
        raise ValueError(f"mode must be 'times' (c ∝ a·b) or 'plus' (c ∝ a + b), got {mode!r}")
    if a.shape != b.shape or a.dim() != 1 or (a < 0).any() or (b < 0).any():
        raise ValueError(f"a and b must be non-negative scores of the same shape [m], got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = _normalise_clip(a), _normalise_clip(b)
    c = _normalise_clip(a * b if mode == "times" else a + b)
    return c / c.sum()   # renormalised: Σ c = 1 keeps θ = Σ c_k θ_k (and the leave-one-out identity)


@dataclass
class FedCEWeighting:
    """The FedCE weights for the `Method.weighting` slot. `model`: the module the run trains (to score minus models),
    `val`: each client's validation (x, y). Logs `fedce_c<k>`, `fedce_a<k>`, `fedce_b<k>` in History."""
    model: torch.nn.Module
    val: list
    mode: str = "times"
    consensus: str = "current"
    uses_context = True

    def __post_init__(self):
        if self.consensus not in ("current", "uniform"):
            raise ValueError(f"consensus must be 'current' (g = Σ c_k Δ_k) or 'uniform' (the port's 1/K), got {self.consensus!r}")
        fedce_weights(torch.ones(1), torch.ones(1), self.mode)   # checks mode

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        if len(self.val) != num_clients:
            raise ValueError(f"val must hold one (x, y) per client: {num_clients} clients, got {len(self.val)}")
        zeros = torch.zeros(num_clients, dtype=torch.float64)
        return {"coef": torch.full((num_clients,), 1.0 / num_clients, dtype=torch.float64), "cos_sum": zeros.clone(),
                "metric_sum": zeros.clone(), "rounds": 0, "local": None,
                "a": zeros.clone(), "b": zeros.clone(), "minus": None}

    def minus_metric(self, minus: torch.Tensor) -> torch.Tensor:
        """Accuracy of each client's minus model on its own validation rows (the client's one-float report)."""
        return torch.tensor([evaluate(self.model, minus[k], x.to(minus.device), y.to(minus.device))[1]
                             for k, (x, y) in enumerate(self.val)], dtype=torch.float64)

    def __call__(self, state: dict, info: RoundInfo) -> tuple[torch.Tensor, dict]:
        ids = np.asarray(info.client_ids)
        if len(ids) != info.num_clients or not (np.sort(ids) == np.arange(info.num_clients)).all():
            raise ValueError("FedCE needs every client in every round (clients_per_round = number of clients): "
                             "its minus models and running means are per client")
        order = torch.as_tensor(np.argsort(ids))
        deltas, theta = info.messages["delta"][order].double(), info.theta.double()
        state = dict(state)
        if state["local"] is not None:                       # round t > 0: score the minus models
            state["minus"] = minus_models(theta, state["coef"], state["local"])
            state["metric_sum"] = state["metric_sum"] + self.minus_metric(state["minus"].to(info.theta.dtype))
        state["rounds"] += 1
        coef = state["coef"] if self.consensus == "current" else torch.full_like(state["coef"], 1.0 / len(ids))
        state["cos_sum"] = state["cos_sum"] + gradient_similarity(deltas, coef)
        state["a"] = 1 - state["cos_sum"] / state["rounds"]
        state["b"] = 1 - state["metric_sum"] / state["rounds"]
        state["coef"] = fedce_weights(state["a"], state["b"], self.mode)
        state["local"] = theta + deltas                       # θ_k, for next round's minus models
        weights = torch.empty_like(state["coef"])
        weights[order] = state["coef"]                        # back to the order of info.client_ids
        return weights.to(info.sizes.dtype), state

    def metrics(self, state: dict) -> dict:
        return per_client_columns(fedce_c=state["coef"], fedce_a=state["a"], fedce_b=state["b"])


@register("fedce", claims="fedce", kind="method")
def fedce(model: torch.nn.Module, val, mode: str = "times", consensus: str = "current") -> Method:
    """FedAvg's local training, aggregated with the FedCE weights (server lr 1: θ ← Σ_k c_k θ_k).
    `val`: a FederatedDataset (its clients' training rows serve as validation) or a list of (x, y) per client."""
    if hasattr(val, "client_train"):
        val = list(val.client_train)
    if not isinstance(val, (list, tuple)) or not all(isinstance(v, (list, tuple)) and len(v) == 2 for v in val):
        raise ValueError("val must be a FederatedDataset or a list of (x, y) per client (each client's validation rows)")
    return Method(f"fedce({mode})", LocalObjective(), FedCEWeighting(model, list(val), mode, consensus),
                  server_opt=ServerSGD(lr=1.0))
