"""FedSA-LoRA — share A, keep B local (Guo, Zeng, Wang, Fan, Wang, Qu, "Selective Aggregation for Low-Rank
Adaptation in Federated Learning", ICLR 2025, https://arxiv.org/abs/2410.01463; code:
https://github.com/Pengxin-Guo/FedSA-LoRA), with the three other ways of placing LoRA's factors.

Every client fine-tunes a LoRA model W₀ + (α/r)·B A (`fedlab_nb.lora.add_lora`: A Kaiming-uniform, B = 0,
every other weight frozen) with plain local SGD on both factors; the variants differ only in which factors
go to the server and are averaged (p_k ∝ n_k) and which stay in the client's store:

    variant       sent (averaged)   kept local      personal model of client k
    "fedsa"       A                 B               (Ā, B_k)      FedSA-LoRA
    "share_b"     B                 A               (A_k, B̄)
    "share_both"  A and B           —               (Ā, B̄)        FedAvg on the factors ("LoRA" in the paper)
    "local_only"  —                 A and B         (A_k, B_k)

The paper's observation behind the choice: across clients the learned A matrices are more alike than the B
matrices ("A matrices are responsible for learning general knowledge, while B matrices focus on capturing
client-specific knowledge"); `factor_similarity` measures it on the clients' factors.

Details from the official code (federatedscope/glue/yamls/fedsa-lora.yaml and the FederatedScope FedAvg
aggregator): `personalization.local_param: ['lora_B', 'classifier']` — B (and the task head, which our
frozen-head toy does not train) never leave the client; A is averaged with weights n_k / Σ n (the
aggregator's default, `ignore_weight: False`); local SGD, r = 8, lora_alpha = 16, 10 local steps per round,
3 clients, Dirichlet(0.5) label skew. Here each client is scored with its personal model on its own test
split (`personal_acc_*` columns). On the round pipeline this is nothing but parameter groups:
`ParamGroups(local=("*lora_B",))` (B trained, stored per client, never sent) and the FedAvg server step on
the sent rows, so "B never leaves the client" is the engine's guarantee, measured in `bytes_up`.
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ...core.groups import ParamGroups
from ...core.history import History
from ...core.method import ClientUpdate, DataSizeWeighting, LocalObjective, Method, ServerKeep, ServerSGD, weighted_mean
from ...core.registry import register
from ...engine import simulate
from ...lora import LoRALayout, add_lora
from ...models import param_spec
from ...utils import check_positive_int

A_TENSORS, B_TENSORS = "*lora_A", "*lora_B"   # glob patterns over add_lora's names (`body.0.lora_A`, ...)
KEPT_LOCAL = {"fedsa": (B_TENSORS,), "share_b": (A_TENSORS,), "share_both": (), "local_only": ("*",)}
VARIANTS = tuple(KEPT_LOCAL)
LABELS = {"fedsa": "FedSA-LoRA (share A)", "share_b": "share B", "share_both": "share A and B (FedAvg-LoRA)",
          "local_only": "local only"}


def check_variant(variant: str) -> str:
    if variant not in KEPT_LOCAL:
        raise ValueError(f"variant must be one of {VARIANTS} (which LoRA factors are sent), got {variant!r}")
    return variant


class FrozenBaseClient(ClientUpdate):
    """The default client update (train, store the kept-local tensors, send Δ of the others) with the frozen
    pretrained weights — buffers of an `add_lora` model — held by each client (`local_buffers`): they never
    move, whereas the engine's global buffers are re-averaged over the round's clients every round
    (a BatchNorm statistic's treatment), which rounds identical copies by an ulp."""
    local_buffers = True


@register("fedsa_lora", claims="fedsa_lora")
def fedsa_lora(variant: str = "fedsa", optimizer=None, server_lr: float = 1.0) -> Method:
    """FedSA-LoRA (`variant="fedsa"`: A sent and averaged, B kept local) or one of its comparisons
    ("share_b", "share_both", "local_only") for a LoRA model built by `fedlab_nb.lora.add_lora`.
    `optimizer`: the clients' optimiser (None: plain SGD at the run's lr, as in the official code)."""
    check_variant(variant)
    if not server_lr > 0:
        raise ValueError(f"server_lr must be > 0 (1.0: FedAvg's θ ← θ + mean Δ), got {server_lr!r}")
    server = ServerKeep() if variant == "local_only" else ServerSGD(lr=server_lr)
    return Method(f"fedsa_lora[{variant}]", LocalObjective(), DataSizeWeighting(), weighted_mean, server,
                  optimizer=optimizer, groups=ParamGroups(local=KEPT_LOCAL[variant]), client=FrozenBaseClient())


def run_fedsa_lora(fed, base_model, variant: str = "fedsa", *, rank: int = 8, alpha: float | None = None,
                   targets=None, rounds: int = 20, local_epochs: int = 1, local_steps: int | None = None,
                   batch_size: int = 32, lr: float = 0.1, seed: int = 0, eval_every: int | None = None,
                   clients_per_round=None) -> History:
    """Wrap `base_model` with LoRA (`add_lora(base_model, rank, alpha, targets, seed)`; the same A₀ for every
    variant at a seed) and run `variant` on the round pipeline. `hist.model` is the LoRA model, `hist.theta`
    the server's factors, `hist.store` every client's kept-local factors; `personal_factors(hist)` gives each
    client's own (A, B)."""
    check_positive_int("rounds", rounds)
    model = add_lora(base_model, rank, alpha, targets, seed=seed)
    hist = simulate(fedsa_lora(variant), fed, model, rounds=rounds, clients_per_round=clients_per_round,
                    local_epochs=local_epochs, local_steps=local_steps, batch_size=batch_size, lr=lr, seed=seed,
                    eval_every=eval_every or rounds, backend="loop", progress=False)
    hist.meta.update({"variant": variant, "rank": rank, "alpha": float(rank if alpha is None else alpha)})
    return hist


def personal_factors(hist: History, variant: str | None = None) -> Tensor:
    """[K, size] every client's personal LoRA factors after a run (`run_fedsa_lora`, or `simulate` of
    `fedsa_lora(variant)`): the server's θ with the client's kept-local tensors from the store written in."""
    variant = check_variant(hist.meta.get("variant") if variant is None else variant)
    groups = ParamGroups(local=KEPT_LOCAL[variant]).resolve(param_spec(hist.model))
    if not groups.local:  # share_both: the server's factors are everyone's
        return hist.theta.repeat(hist.store.K, 1)
    return ClientUpdate().personal(None, hist.theta, hist.store.all(hist.theta.device), groups)


def mean_pairwise_cosine(rows: Tensor) -> float:
    """Mean cosine similarity over all pairs of the rows [K, d] (flattened matrices, one per client)."""
    if rows.dim() != 2 or len(rows) < 2:
        raise ValueError(f"need a [K, d] matrix with K >= 2 clients, got shape {tuple(rows.shape)}")
    unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    sims = [float(unit[i] @ unit[j]) for i, j in itertools.combinations(range(len(rows)), 2)]
    return sum(sims) / len(sims)


def factor_similarity(layout: LoRALayout, clients: Tensor, start: Tensor | None = None) -> dict:
    """Cross-client similarity of the LoRA factors, per layer: the mean pairwise cosine similarity of the
    clients' A_k and of their B_k (`clients`: [K, size] rows of factors). With `start` (the common θ₀ the
    clients began from) the changes A_k − A₀ and B_k − B₀ are compared instead, which removes the shared
    random initialisation of A (identical A₀ makes raw A's look alike whether or not they learned alike).
    Returns {layer: {"A": float, "B": float}}."""
    if start is not None:
        clients = clients - start
    out = {}
    for name, (a, b) in zip(layout.names, layout.split(clients)):
        out[name] = {"A": mean_pairwise_cosine(a.flatten(1)), "B": mean_pairwise_cosine(b.flatten(1))}
    return out


def sent_entries(variant: str, layout: LoRALayout) -> int:
    """How many numbers one client sends per round in `variant` (A's, B's, both or none)."""
    check_variant(variant)
    n_a = sum(r * k for _, k, r in layout.shapes)
    n_b = sum(d * r for d, _, r in layout.shapes)
    return {"fedsa": n_a, "share_b": n_b, "share_both": n_a + n_b, "local_only": 0}[variant]


__all__ = ["fedsa_lora", "run_fedsa_lora", "personal_factors", "factor_similarity", "mean_pairwise_cosine",
           "sent_entries", "VARIANTS", "LABELS", "KEPT_LOCAL"]
