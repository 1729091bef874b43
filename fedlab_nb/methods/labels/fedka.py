"""FedKA — Sun, Chong, Ochiai, "Feature Distribution Matching for Federated Domain Generalization", ACML 2022
(arXiv:2203.11635). Official code: https://github.com/yuweisunn/federated-knowledge-alignment
(`FedKA-Digit-Five.ipynb`, the only implementation file).

Setting: K clients each hold one labelled source domain; the server ("cloud") holds unlabelled images of
an unseen target domain. One round, as the official notebook runs it:

1. clients train on their labelled rows (cross-entropy) and then match their features to the target:
   a multi-kernel MMD between the client's features of its source rows and the *global* model's features of
   target rows (embedding matching), weighted by the ramp α(p) = 2 / (1 + e^{−5p}) − 1 of training progress p;
2. the server averages the client models (plain mean, as the code divides by the client count);
3. federated voting: every client model predicts the target rows, the plurality label is the pseudo-label,
   and the server fine-tunes the averaged model on the pseudo-labelled rows with the loss weighted by α
   (the code's "adoption rate"); the fine-tuned model is the one evaluated and the one whose target
   features the next round matches. In the code the clients restart from the plain average, not from the
   fine-tuned model (`restart_from_average=True`, the default here).

Here the server broadcasts the global model's 64-d target embeddings (a random subset of target rows each
round) — the "global workspace"; clients never see target images. The client's MMD uses `mmd.mk_mmd2`
(unbiased, bandwidths {0.5, 1, 2} × the median distance; the official code uses the biased statistic with five
bandwidths around the mean squared distance). The voting adds an agreement threshold τ (keep a pseudo-label
when at least a fraction τ of the clients vote for it); τ = 0, the default, is the official plurality vote.

Simplifications, named: (i) the official FedKA also trains a DANN "feature disentangler" (a domain classifier
behind a gradient-reversal layer, which needs target images on every client); it is not included here;
(ii) plain SGD at the run's step size on clients and server instead of Adam (lr 3e-4); (iii) MMD and
cross-entropy share each local step instead of a separate MMD pass. Group Effect (`group_effect`) is read as
the aggregated model's target accuracy minus the mean target accuracy of the client models it was averaged
from (the paper's definition could not be read offline).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...core.method import ClientUpdate, LocalObjective, Method, ServerAssign, UniformWeighting, weighted_mean
from ...core.registry import register
from ...core.streams import register_stream
from ...merging import fit, logits
from .mmd import DEFAULT_SCALES, mk_mmd2
from ...models import param_spec, representation, unflatten

FEDKA_STREAM = register_stream("fedka", 65)


def adoption_rate(progress: float) -> float:
    """α(p) = 2 / (1 + e^{−5p}) − 1 for training progress p ∈ [0, 1] (0 at the start, ≈ 0.99 at the end)."""
    if not 0 <= progress <= 1:
        raise ValueError(f"progress must be in [0, 1], got {progress}")
    return 2.0 / (1.0 + math.exp(-5.0 * progress)) - 1.0


def federated_vote(predictions: torch.Tensor, num_classes: int, threshold: float = 0.0):
    """Pseudo-labels from K clients' predicted classes [K, n]: the plurality label of each row (the smallest
    label among tied ones), its agreement (share of clients voting for it) and `keep` = agreement ≥ threshold.
    Returns (labels [n], keep [n] bool, agreement [n])."""
    if predictions.ndim != 2 or len(predictions) == 0 or predictions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"predictions must be integer class ids [K, n] with K >= 1, got {tuple(predictions.shape)} "
                         f"{predictions.dtype}")
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold is a share of the clients in [0, 1], got {threshold}")
    if predictions.min() < 0 or predictions.max() >= num_classes:
        raise ValueError(f"predictions must lie in 0 … {num_classes - 1}")
    counts = F.one_hot(predictions.long(), num_classes).sum(0)          # [n, C] votes per class
    top, labels = counts.max(1)                                         # first maximum: smallest tied label
    agreement = top.to(torch.float64) / len(predictions)
    return labels, agreement >= threshold - 1e-12, agreement


def vote_quality(labels: torch.Tensor, keep: torch.Tensor, y_true: torch.Tensor) -> tuple[float, float]:
    """(precision, coverage) of kept pseudo-labels: accuracy on the kept rows (nan if none) and their share."""
    coverage = float(keep.double().mean())
    precision = float((labels[keep] == y_true[keep]).double().mean()) if keep.any() else float("nan")
    return precision, coverage


def group_effect(global_acc: float, client_accs) -> float:
    """Gain of aggregation: the aggregated model's target accuracy minus the mean of its client models'."""
    accs = torch.as_tensor(client_accs, dtype=torch.float64).reshape(-1)
    if len(accs) == 0:
        raise ValueError("client_accs must hold at least one client model's accuracy")
    return float(global_acc) - float(accs.mean())


# --- client: cross-entropy + MMD to the broadcast target embeddings --------------------------------
@dataclass
class MatchTargetFeatures(LocalObjective):
    """extra_loss = w · MK-MMD²(features of the batch, broadcast target embeddings), constant per row.
    The context row packs [w, embeddings.flatten()] (the server's `fedka_ctx`)."""
    feature_dim: int = 64
    scales: tuple = DEFAULT_SCALES
    vmappable = False  # the median bandwidth and the per-step kernel matrix: loop backend

    def client_state(self, theta):
        return {"participations": torch.zeros(())}

    def context(self, down, cstate):
        return down["fedka_ctx"].expand(len(cstate["participations"]), -1)

    def extra_loss(self, model, params, x, y, anchor, ctx):
        weight, target = ctx[0], ctx[1:].reshape(-1, self.feature_dim)
        z = representation(model, params, x)
        if len(z) < 2:  # a one-row batch has no unbiased MMD
            return z.sum(1) * 0
        return weight * mk_mmd2(z, target, scales=self.scales) * z.new_ones(len(z))

    def finish(self, deltas, down, cstate, steps, lr):
        return {}, {"participations": cstate["participations"] + 1}


class FromAverage(ClientUpdate):
    """Clients start from the plain average `theta_avg` when the server broadcasts it (the official code's
    reset of the clients to the averaged weights), else from θ; the message is then Δ = w − theta_avg, so the
    server rebuilds the client models without float rounding through the fine-tuned θ."""

    def start(self, track, theta, down, cstate, done, groups, m):
        if "theta_avg" in down:
            return down["theta_avg"].repeat(m, 1)
        return super().start(track, theta, down, cstate, done, groups, m)

    def finish(self, done, theta, down, cstate, steps, lr, method, groups):
        return super().finish(done, down.get("theta_avg", theta), down, cstate, steps, lr, method, groups)


# --- server: average, vote, fine-tune, embed the target --------------------------------------------
@dataclass
class FedKAServer:
    """Stateful rule (returns the new θ for `ServerAssign`): the mean of the client models, then — with
    `voting` — fine-tuning on the clients' pseudo-labels of the target pool, and — with `mmd` — the target
    embeddings of the resulting model for the next round's clients. `y_target` (optional) is used only for
    the diagnostic columns vote_precision / vote_coverage, never for training."""
    model: torch.nn.Module
    x_target: torch.Tensor
    num_classes: int
    mmd: bool = True
    voting: bool = True
    mmd_weight: float = 0.1
    threshold: float = 0.0
    rounds: int = 30
    n_embed: int = 128
    finetune_epochs: int = 1
    finetune_lr: float = 0.05
    batch_size: int = 32
    restart_from_average: bool = True
    y_target: torch.Tensor | None = None
    uses_context = True

    def _embed(self, theta, g):
        rows = torch.randperm(len(self.x_target), generator=g)[: self.n_embed]
        with torch.no_grad():
            return representation(self.model, unflatten(theta, param_spec(self.model)), self.x_target[rows])

    def init_state(self, theta, num_clients):
        g = torch.Generator().manual_seed(FEDKA_STREAM)
        return {"round": torch.zeros(()), "avg": theta.clone(), "clients": theta.new_zeros(0, theta.numel()),
                "emb": self._embed(theta, g) if self.mmd else theta.new_zeros(0)}

    def broadcast(self, state):
        out = {}
        if self.mmd:
            w = self.mmd_weight * adoption_rate(min(float(state["round"]) / self.rounds, 1.0))
            out["fedka_ctx"] = torch.cat([state["emb"].new_tensor([w]), state["emb"].reshape(-1)])
        if self.voting and self.restart_from_average:
            out["theta_avg"] = state["avg"]
        return out

    def client_predictions(self, W):
        """[m, n] predicted classes of the client models (rows of W) on the target pool."""
        with torch.no_grad():
            return torch.stack([logits(self.model, w, self.x_target).argmax(1) for w in W])

    def aggregate(self, state, deltas, weights, info):
        base = state["avg"] if self.voting and self.restart_from_average else info.theta  # what clients started from
        W = base + deltas                              # the client models
        avg = base + weighted_mean(deltas, weights)
        theta, g = avg, info.generator(FEDKA_STREAM)
        r = int(state["round"]) + 1
        metrics = {}  # diagnostics only (y_target is never used for training)
        if self.voting:
            labels, keep, _ = federated_vote(self.client_predictions(W), self.num_classes, self.threshold)
            alpha = adoption_rate(min(r / self.rounds, 1.0))
            if keep.any() and alpha > 0:
                scaled_ce = lambda out, y: alpha * F.cross_entropy(out, y)  # noqa: E731  (the adoption rate)
                theta = fit(self.model, avg, self.x_target[keep], labels[keep], epochs=self.finetune_epochs,
                            lr=self.finetune_lr, batch_size=self.batch_size, seed=int(torch.randint(2**62, (1,), generator=g)),
                            loss_fn=scaled_ce).to(avg.dtype)
            if self.y_target is not None:
                metrics["vote_precision"], metrics["vote_coverage"] = vote_quality(labels, keep, self.y_target)
        new = {"round": state["round"] + 1, "avg": avg, "clients": W.detach().clone(),  # kept for Group Effect
               "emb": self._embed(theta, g) if self.mmd else state["emb"],
               **{k: torch.tensor(v) for k, v in metrics.items()}}
        return theta, new

    def metrics(self, state):
        return {k: float(v) for k, v in state.items() if k.startswith("vote_")}


@register("fedka", claims="fedka", kind="method")
def fedka(model: torch.nn.Module, x_target: torch.Tensor, num_classes: int, *, mmd: bool = True, voting: bool = True,
          mmd_weight: float = 0.1, threshold: float = 0.0, rounds: int = 30, n_embed: int = 128, finetune_epochs: int = 1,
          finetune_lr: float = 0.05, batch_size: int = 32, restart_from_average: bool = True,
          y_target: torch.Tensor | None = None) -> Method:
    """FedKA on the round pipeline. `x_target`: the server's unlabelled target rows; `model`: the module the
    run trains (it needs `representation(x)`, e.g. make_model("mlp", ..., hidden=(128, 64)) for 64-d features).
    Ablations: `mmd=False` (voting only), `voting=False` (MMD only); both False is FedAvg with the plain mean.
    `mmd_weight` 0.1 approximates the official code's effective MMD weight (about 4 MMD steps of loss/8 per 32
    classification steps); `rounds` sets the length of the ramp α."""
    if not callable(getattr(model, "representation", None)):
        raise ValueError("fedka needs a model with representation(x) (its feature layer), e.g. make_model('mlp', ...)")
    if not torch.is_tensor(x_target) or x_target.ndim != 2 or len(x_target) < 2:
        raise ValueError(f"x_target must be a [n, d] tensor of target rows with n >= 2, got {getattr(x_target, 'shape', x_target)}")
    if not mmd_weight >= 0 or not 0 <= threshold <= 1:
        raise ValueError(f"need mmd_weight >= 0 and threshold in [0, 1], got {mmd_weight}, {threshold}")
    for name, v in (("rounds", rounds), ("n_embed", n_embed), ("finetune_epochs", finetune_epochs),
                    ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "n_embed" else 1):
            raise ValueError(f"{name} must be an int >= {2 if name == 'n_embed' else 1}, got {v!r}")
    with torch.no_grad():
        dim = model.representation(x_target[:2]).shape[1]
    server = FedKAServer(model, x_target, int(num_classes), mmd, voting, float(mmd_weight), float(threshold), rounds,
                         min(n_embed, len(x_target)), finetune_epochs, float(finetune_lr), batch_size,
                         restart_from_average, y_target)
    objective = MatchTargetFeatures(int(dim)) if mmd else LocalObjective()
    name = {(True, True): "fedka", (True, False): "fedka_mmd_only", (False, True): "fedka_voting_only",
            (False, False): "fedavg_uniform"}[(mmd, voting)]
    return Method(name, objective, UniformWeighting(), server, ServerAssign(), client=FromAverage())
