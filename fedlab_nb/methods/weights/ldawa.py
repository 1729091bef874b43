"""L-DAWA — Yasar Abbas Ur Rehman, Yan Gao, Pedro Porto Buarque de Gusmão, Mina Alibeigi, Jiajun Shen,
Nicholas D. Lane, "L-DAWA: Layer-wise Divergence Aware Weight Aggregation in Federated Self-Supervised Visual
Representation Learning", ICCV 2023 (arXiv:2307.07393). Official code: https://github.com/yasar-rehman/L-DAWA
(`L-DAWA-Agg.py`, a Flower aggregation function).

For every layer l (one parameter tensor: a weight matrix or a bias, as in the official code's list of
arrays) the server measures the angular divergence between each client's *model weights* w_k^l (not its
update) and the broadcast global weights θ^l,

    δ_k^l = ⟨θ^l, w_k^l⟩ / (‖θ^l‖ ‖w_k^l‖)      (capped at 1, as the official code does for rounding)

scales the client's layer by it and averages over the m clients of the round:

    θ^l ← (1/m) Σ_k δ_k^l w_k^l                              normalise="clients" (the official code)

The weights δ_k^l / m do not sum to one, so a round also shrinks every layer a little (the closer the
clients stay to θ, the less). Negative cosines are kept as they are (the official code only caps values
above 1). With a `Weighting` other than uniform, 1/m becomes p_k = weight_k / Σ weights. A flagged variant,
normalise="delta", divides by Σ_k p_k max(δ_k^l, 0) instead (a convex combination, no shrinking; FedAvg
when δ is the same for every client). A zero-norm layer has no direction: δ = 1 there (the official code
would divide by zero when the global layer is zero).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ...core.method import Method, RoundInfo, ServerAssign, UniformWeighting
from ...core.registry import register
from ...models import param_spec

NORMALISATIONS = ("clients", "delta")


def layer_cosines(models: torch.Tensor, global_layer: torch.Tensor) -> torch.Tensor:
    """δ_k = cos(w_k, θ) for each row w_k of `models` [m, n] against `global_layer` [n]; 1 where a norm
    is zero; capped at 1 (rounding can push it a hair above), negative values kept, as in the official code."""
    norms = models.norm(dim=1) * global_layer.norm()
    dots = models @ global_layer
    cos = torch.where(norms > 0, dots / norms.clamp_min(torch.finfo(models.dtype).tiny), torch.ones_like(dots))
    return cos.clamp(max=1.0)


@dataclass
class LDAWARule:
    """The L-DAWA rule for `Method.rule`: gets Δ_k and θ (`info.theta`), returns the new global model
    (use it with `ServerAssign`). `spec`: (name, shape) of the aggregated tensors in flat order (the
    model's `param_spec`); each tensor is one layer. State: the last round's δ [m, L] and client ids."""
    spec: tuple
    normalise: str = "clients"
    uses_context: ClassVar[bool] = True
    _segments: list = field(init=False, repr=False)

    def __post_init__(self):
        if self.normalise not in NORMALISATIONS:
            raise ValueError(f"normalise must be one of {NORMALISATIONS}, got {self.normalise!r}")
        self.spec = tuple((str(n), tuple(s)) for n, s in self.spec)
        if not self.spec:
            raise ValueError("spec is empty: pass the model's param_spec(model), one (name, shape) per tensor")
        ends = [0]
        for _, shape in self.spec:
            ends.append(ends[-1] + math.prod(shape))
        self._segments = list(zip(ends[:-1], ends[1:]))

    @property
    def layers(self) -> list[str]:
        return [n for n, _ in self.spec]

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        self._check_width(theta.numel(), "θ")
        return {"delta": torch.zeros(0, len(self.spec), dtype=torch.float64), "ids": torch.zeros(0, dtype=torch.int64),
                "drift": torch.zeros(0, dtype=torch.float64)}

    def _check_width(self, width: int, what: str):
        if width != self._segments[-1][1]:
            raise ValueError(f"LDAWARule: {what} has {width} entries but spec describes {self._segments[-1][1]}; "
                             "pass param_spec(model) of the trained model (with ParamGroups(local=...) L-DAWA "
                             "is not supported: every tensor must be sent)")

    def aggregate(self, state: dict, deltas: torch.Tensor, weights: torch.Tensor | None, info: RoundInfo | None = None):
        if info is None or info.theta is None:
            raise ValueError("LDAWARule needs the broadcast θ: call it through a Method (uses_context = True "
                             "passes info=RoundInfo(theta=...))")
        theta = info.theta.to(deltas.dtype)
        self._check_width(deltas.shape[1], "each client's update")
        p = torch.ones(len(deltas), dtype=deltas.dtype, device=deltas.device) if weights is None else weights.to(deltas)
        if (p < 0).any() or not p.sum() > 0:
            raise ValueError("LDAWARule: aggregation weights must be non-negative with a positive sum")
        p = p / p.sum()
        models = theta + deltas                      # the clients' weights w_k: L-DAWA compares weights, not updates
        new, table = torch.empty_like(theta), []
        for a, b in self._segments:
            delta = layer_cosines(models[:, a:b], theta[a:b])
            new[a:b] = self._coefficients(p, delta) @ models[:, a:b]
            table.append(delta)
        ids = torch.as_tensor(info.client_ids, dtype=torch.int64)
        drift = deltas.norm(dim=1) / theta.norm().clamp_min(torch.finfo(theta.dtype).tiny)  # ‖w_k − θ‖ / ‖θ‖, logged
        return new, {"delta": torch.stack(table, 1).double().cpu(), "ids": ids, "drift": drift.double().cpu()}

    def _coefficients(self, p: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if self.normalise == "clients":
            return p * delta                          # (1/m) Σ δ_k w_k with uniform p: the official code
        c = p * delta.clamp_min(0)                    # the flagged convex variant
        return c / c.sum() if c.sum() > 0 else p      # every client opposite to θ: fall back to FedAvg

    def metrics(self, state: dict) -> dict:
        """History columns: mean δ per layer over the round's clients, δ per (layer, client) and each
        client's relative drift ‖w_k − θ‖ / ‖θ‖."""
        delta, ids = state["delta"], state["ids"].tolist()
        if not len(ids):
            return {}
        out = {f"delta[{name}]": float(delta[:, j].mean()) for j, name in enumerate(self.layers)}
        for i, k in enumerate(ids):
            out[f"drift[{k}]"] = float(state["drift"][i])
            out.update({f"delta[{name}][{k}]": float(delta[i, j]) for j, name in enumerate(self.layers)})
        return out


def delta_table(history) -> "pd.DataFrame":
    """Long table (round, layer, client, delta, drift) from a run's History columns `delta[layer][client]`
    and `drift[client]` (the rule's `metrics`)."""
    import pandas as pd
    rows = []
    for col in history.columns:
        if col.startswith("delta[") and col.count("[") == 2:
            layer, client = col[len("delta["):-1].split("][")
            has = history[col].notna()
            rows.append(pd.DataFrame({"round": history["round"][has].to_numpy(), "layer": layer, "client": int(client),
                                      "delta": history[col][has].to_numpy(dtype=float),
                                      "drift": history[f"drift[{client}]"][has].to_numpy(dtype=float)}))
    if not rows:
        raise ValueError("history has no delta[layer][client] columns: was it run with an L-DAWA method?")
    return pd.concat(rows, ignore_index=True)


@register("ldawa", claims="ldawa")
def ldawa(model: nn.Module | list | tuple, normalise: str = "clients") -> Method:
    """L-DAWA: layer-wise cosine-scaled averaging of the clients' weights, uniform client weights (the
    official code's 1/m). `model`: the trained `nn.Module` or its `param_spec`."""
    spec = param_spec(model) if isinstance(model, nn.Module) else model
    name = "ldawa" if normalise == "clients" else f"ldawa_{normalise}"
    return Method(name, weighting=UniformWeighting(), rule=LDAWARule(spec, normalise), server_opt=ServerAssign())
