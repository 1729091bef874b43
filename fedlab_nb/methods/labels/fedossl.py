"""FedoSSL — Zhang, Ma, Guo, Xu, "Towards Unbiased Training in Federated Open-world Semi-supervised
Learning", ICML 2023 (https://arxiv.org/abs/2305.00771). Official code: https://github.com/cugzj/FedoSSL

Open world: clients hold labelled rows of the *seen* classes and unlabelled rows of seen and *unseen*
classes. An unseen class held by several clients is "locally unseen", one held by a single client is
"globally unseen"; FedAvg favours the former. FedoSSL adds two things to an ORCA-style FedAvg client:

1. an uncertainty-aware suppressed loss: with N_c the client's unlabelled rows predicted as c in its
   previous local epoch, p_c = β^(1 − N_c/N_max) (β = 0.2) and L_s = mean_i p_{ĉ_i}·mean_c |q_i − t_i|,
   t_i = q_i with its argmax entry set to 1 (so L_s = mean_i p_{ĉ_i}(1 − max q_i)/C); it enters the loss
   as −λ_s·L_s (λ_s = 2), lowering the confidence of the classes the client already predicts most;
2. a calibration module: clients cluster their features into local centroids, the server clusters those
   into C global centroids (Sinkhorn–Knopp assignments, Orchestra-style) and puts the centroid nearest to
   each seen class's averaged labelled-feature mean at that class's index; clients then add a cluster
   consistency loss and a cross-entropy on confident (> 0.95) centroid pseudo-labels.

Taken from the official `fedossl_cinic.py` / `models/resnet_s.py` (the paper's full text was not read
offline): the ORCA base (CE with the uncertainty margin −min(ū, 0.5)·s on labelled rows, BCE of
pairwise similarities of positive pairs, minus the entropy of the mean prediction), the warm-up switches
(cluster loss after round 4, pseudo-label CE after round 6), uniform 1/K averaging of everything except
the centroids, the cosine head (10·cos) and T = 0.1. In the inspected repository the suppressed term is
commented out of the loss (cinic: "- 2 * L_reg1", cifar: "+ 2 * L_reg1"); here it is switchable and
follows the cinic sign, active with the pseudo-label CE. Simplifications (named in the claims file): an
MLP from scratch instead of a SimCLR ResNet-18; Gaussian-noise views; local centroids from the current
features of all local rows instead of a 1024-row memory; by default (`server="kmeans"`) the server
clusters the uploaded centroids by warm-started Sinkhorn-balanced spherical k-means (the repository's
local-clustering routine) instead of Orchestra's SGD on the centroids (`server="orchestra"`, kept: at
lr 0.01 it moved the centroids little in a few hundred steps in our checks); the uncertainty ū on the
client's unlabelled rows (ORCA) instead of the test set.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

from ...core.optim import SGD
from ...core.registry import register
from ...core.streams import register_stream
from ...utils import rng

FEDOSSL = register_stream("fedossl", 61)

# The repository's 5-client layout (fedossl_cifar.py / fedossl_cinic.py, "全集"): classes 0–5 labelled,
# 6 everywhere unlabelled, 7 and 8 at two clients each (locally unseen), 9 at one client (globally unseen).
REPO_LAYOUT = ((0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3, 4, 5, 6, 8),
               (0, 1, 2, 3, 4, 5, 6, 8), (0, 1, 2, 3, 4, 5, 6, 9))


# --- metrics -------------------------------------------------------------------------------------------
def hungarian_match(y_pred, y_true, num_classes: int | None = None) -> dict[int, int]:
    """The one-to-one map predicted label → true class maximising the matched count (Kuhn–Munkres via
    scipy.optimize.linear_sum_assignment on the contingency table)."""
    y_pred, y_true = np.asarray(y_pred, dtype=np.int64), np.asarray(y_true, dtype=np.int64)
    if y_pred.shape != y_true.shape or y_pred.ndim != 1 or y_pred.size == 0:
        raise ValueError("y_pred and y_true must be non-empty 1-D arrays of the same length")
    D = int(max(y_pred.max(), y_true.max()) + 1) if num_classes is None else int(num_classes)
    table = np.zeros((D, D), dtype=np.int64)
    np.add.at(table, (y_pred, y_true), 1)
    rows, cols = linear_sum_assignment(table, maximize=True)
    return dict(zip(rows.tolist(), cols.tolist()))


def cluster_accuracy(y_pred, y_true) -> float:
    """Hungarian-matched accuracy: the fraction of rows right after the best one-to-one relabelling."""
    mapping = hungarian_match(y_pred, y_true)
    return float(np.mean(np.vectorize(mapping.get)(np.asarray(y_pred)) == np.asarray(y_true)))


def per_class_matched_accuracy(y_pred, y_true, num_seen: int, num_classes: int) -> np.ndarray:
    """Per-class accuracy [C]: seen classes (< num_seen) against their own label, as the repository's
    seen accuracy; unseen classes after the Hungarian relabelling fitted on the unseen rows only (the
    repository's unseen accuracy). NaN for a class with no rows."""
    y_pred, y_true = np.asarray(y_pred), np.asarray(y_true)
    unseen = y_true >= num_seen
    mapped = y_pred.copy()
    if unseen.any():
        mapping = hungarian_match(y_pred[unseen], y_true[unseen], num_classes)
        mapped[unseen] = [mapping[int(p)] for p in y_pred[unseen]]
    return np.array([np.mean(mapped[y_true == c] == c) if np.any(y_true == c) else np.nan
                     for c in range(num_classes)])


def suppression_weights(counts, beta: float = 0.2) -> np.ndarray:
    """p_c = β^(1 − N_c/N_max) from the previous epoch's predicted-class counts; β for all if none."""
    counts = np.asarray(counts, dtype=np.float64)
    if not 0 < beta <= 1:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    if counts.ndim != 1 or np.any(counts < 0):
        raise ValueError("counts must be a 1-D array of non-negative class counts")
    top = counts.max()
    return np.full_like(counts, beta) if top <= 0 else beta ** (1 - counts / top)


# --- data ----------------------------------------------------------------------------------------------
@dataclass
class ClientData:
    x_lab: torch.Tensor
    y_lab: torch.Tensor
    x_unl: torch.Tensor
    y_unl: torch.Tensor  # true labels of the unlabelled rows, for diagnostics only


def role_permutation(num_classes: int, seed: int) -> np.ndarray:
    """perm[j] = the data set class that plays role j of the layout (roles 0–5 seen, 6 unseen at every
    client, 7–8 locally unseen, 9 globally unseen in REPO_LAYOUT); keyed by (seed, stream 61)."""
    return rng(seed, FEDOSSL, 4).permutation(num_classes)


def relabel_by_role(y: torch.Tensor, perm: np.ndarray) -> torch.Tensor:
    """Labels in role order: a row of class perm[j] gets label j (so the layout's class ids are roles)."""
    role = torch.empty(len(perm), dtype=torch.long)
    role[torch.as_tensor(perm)] = torch.arange(len(perm))
    return role[y]


def open_world_split(x, y, layout=REPO_LAYOUT, num_seen: int = 6, labeled_ratio: float = 0.5,
                     seed: int = 0) -> list[ClientData]:
    """Each class's rows are dealt evenly to the clients that hold it (`layout`); a `labeled_ratio`
    fraction of a client's rows of a seen class (< num_seen) is labelled, everything else unlabelled."""
    if not 0 < labeled_ratio < 1:
        raise ValueError(f"labeled_ratio must be in (0, 1), got {labeled_ratio}")
    g = rng(seed, FEDOSSL, 0)
    y_np = np.asarray(y)
    lab = [[] for _ in layout]
    unl = [[] for _ in layout]
    for c in np.unique(y_np):
        holders = [k for k, classes in enumerate(layout) if int(c) in classes]
        if not holders:
            raise ValueError(f"class {c} is held by no client; give every class a holder in `layout`")
        for k, part in zip(holders, np.array_split(g.permutation(np.flatnonzero(y_np == c)), len(holders))):
            n_lab = int(round(labeled_ratio * len(part))) if c < num_seen else 0
            lab[k].append(part[:n_lab])
            unl[k].append(part[n_lab:])
    out = []
    for li, ui in zip(lab, unl):
        li, ui = np.concatenate(li), np.concatenate(ui)
        out.append(ClientData(x[li], y[li], x[ui], y[ui]))
    return out


# --- model ---------------------------------------------------------------------------------------------
class OpenWorldNet(nn.Module):
    """MLP backbone → features; cosine classifier 10·cos(z, w_c) (the repository's NormedLinear); global
    cluster centroids (unit rows, set by the server, never averaged)."""

    def __init__(self, in_features: int, num_classes: int, hidden=(128, 64), seed: int = 0):
        super().__init__()
        sizes = [in_features, *hidden]
        with torch.random.fork_rng():  # a keyed initialisation that leaves the global stream alone
            torch.manual_seed(int(rng(seed, FEDOSSL, 3).integers(2**62)))
            layers = []
            for a, b in zip(sizes[:-1], sizes[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.body = nn.Sequential(*layers[:-1])  # linear features, as the ResNet's pooled output
            self.head = nn.Parameter(torch.empty(sizes[-1], num_classes).uniform_(-1, 1))
            self.register_buffer("centroids", F.normalize(torch.randn(num_classes, sizes[-1]), dim=1))

    def forward(self, x):
        z = self.body(x)
        return 10 * F.normalize(z, dim=1) @ F.normalize(self.head, dim=0), z


# --- client ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FedoSSLConfig:
    """`suppress`: the uncertainty-aware suppressed loss; `calibrate`: centroid calibration (+ the cluster
    and pseudo-label losses it drives). Both False = the ORCA-style FedAvg baseline."""
    suppress: bool = True
    calibrate: bool = True
    beta: float = 0.2
    suppress_weight: float = 2.0
    cluster_weight: float = 0.5
    threshold: float = 0.95
    temperature: float = 0.1
    cluster_after: int = 4      # the repository's `global_round > 4`
    pseudo_after: int = 6       # `global_round > 6`
    local_centroids: int = 32
    server: str = "kmeans"      # "kmeans" (warm-started balanced k-means) | "orchestra" (the repository's SGD)
    server_iters: int = 10      # k-means iterations per round
    global_steps: int = 500     # Orchestra SGD steps per round (the repository's 500)
    server_sinkhorn_iters: int = 100
    noise: float = 0.1          # std of the Gaussian-noise views
    lr: float = 0.1
    batch_size: int = 32


class ParamSGD:
    """The library's SGD (`core.optim.SGD`: torch.optim.SGD's update) on a module's parameters, with
    persistent momentum buffers; avoids importing torch.optim (seconds on one core)."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
        self.params, self.lr = list(params), lr
        self.rule = SGD(lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.state = [{"buf": torch.zeros_like(p)} for p in self.params]
        self.t = torch.zeros(())

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.t += 1
        for p, st in zip(self.params, self.state):
            if p.grad is not None:
                self.rule.step_(p, p.grad, st, self.t, self.lr)


def _positive_pairs(y_lab, feat, g: np.random.Generator) -> torch.Tensor:
    """ORCA's partners: another labelled row of the same class; for unlabelled rows the nearest other
    row of the batch by cosine similarity of the (detached) features."""
    n_lab, y = len(y_lab), y_lab.numpy()
    pairs = []
    for i in range(n_lab):
        same = np.flatnonzero(y == y[i])
        others = same[same != i]
        pairs.append(int(g.choice(others)) if len(others) else i)
    z = F.normalize(feat.detach(), dim=1)
    nearest = (z[n_lab:] @ z.T).topk(2, dim=1).indices[:, 1]
    return torch.cat([torch.tensor(pairs, dtype=torch.long), nearest])


def margin_ce(logits, target, margin: float, scale: float = 10.0):
    """The repository's MarginLoss: CE with `margin·scale` subtracted from the target logit."""
    return F.cross_entropy(logits - margin * scale * F.one_hot(target, logits.shape[1]), target)


def suppressed_loss(prob_unl: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """L_s = mean_i p_{ĉ_i} · mean_c |q_i − t_i|, t_i = q_i (detached) with its argmax entry set to 1."""
    top = prob_unl.argmax(1)
    target = prob_unl.detach().clone()
    target[torch.arange(len(top)), top] = 1.0
    return (weights[top] * (prob_unl - target).abs().mean(1)).mean()


def batch_loss(model, cfg: FedoSSLConfig, r: int, xl, yl, xu, margin, weights, g_np, g_t):
    """One mini-batch of the client objective (labelled rows first); returns (loss, predicted classes)."""
    x = torch.cat([xl, xu])
    views = [x + cfg.noise * torch.randn(x.shape, generator=g_t) for _ in range(2)]
    (out1, feat1), (out2, feat2) = model(views[0]), model(views[1])
    prob1, prob2 = out1.softmax(1), out2.softmax(1)
    n = len(yl)
    pos = _positive_pairs(yl, feat1, g_np)
    bce = -torch.log((prob1 * prob2[pos]).sum(1).clamp_min(1e-7)).mean()
    mean_prob = prob1.mean(0).clamp_min(1e-8)
    loss = margin_ce(out1[:n], yl, -margin) + bce + (mean_prob * mean_prob.log()).sum()  # − entropy
    if cfg.calibrate and r > cfg.cluster_after:
        C = model.centroids.detach()
        t1 = (F.normalize(feat1, dim=1) @ C.T / cfg.temperature).softmax(1)
        t2 = (F.normalize(feat2, dim=1) @ C.T / cfg.temperature).softmax(1)
        loss = loss - cfg.cluster_weight * (t1 * t2[pos].clamp_min(1e-8).log()).sum(1).mean()
        if r > cfg.pseudo_after:
            conf, cluster = t1[n:].max(1)
            keep = conf > cfg.threshold
            if keep.any():
                loss = loss + F.cross_entropy(out1[n:][keep], cluster[keep])
    if cfg.suppress and r > cfg.pseudo_after:
        loss = loss - cfg.suppress_weight * suppressed_loss(prob1[n:], weights)
    return loss, prob1[n:].argmax(1)


def local_epoch(model, opt, data: ClientData, cfg: FedoSSLConfig, r: int, counts, seed: int, k: int):
    """E = 1 pass over the labelled rows, each batch joined by unlabelled rows in the size ratio (the
    repository's loaders); returns the unlabelled predicted-class counts N_c for the next round."""
    g_np = rng(seed, FEDOSSL, 1, r, k)
    g_t = torch.Generator().manual_seed(int(g_np.integers(2**62)))
    n_l, n_u = len(data.y_lab), len(data.y_unl)
    b_l = max(2, int(cfg.batch_size * n_l / (n_l + n_u)))
    b_u = cfg.batch_size - b_l
    with torch.no_grad():
        margin = min(1 - model(data.x_unl)[0].softmax(1).max(1).values.mean().item(), 0.5)
    weights = torch.as_tensor(suppression_weights(counts, cfg.beta), dtype=torch.float32)
    lab, unl = g_np.permutation(n_l), g_np.permutation(n_u)
    new_counts = np.zeros(len(counts))
    model.train()
    for step in range(n_l // b_l):
        il = lab[step * b_l:(step + 1) * b_l]
        iu = unl[np.arange(step * b_u, (step + 1) * b_u) % n_u]
        loss, pred = batch_loss(model, cfg, r, data.x_lab[il], data.y_lab[il], data.x_unl[iu], margin,
                                weights, g_np, g_t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        new_counts += np.bincount(pred.numpy(), minlength=len(counts))
    return new_counts


# --- calibration (server) ---------------------------------------------------------------------------------
def sinkhorn(scores: torch.Tensor, lam: float = 25.0, iters: int = 100) -> torch.Tensor:
    """Balanced soft assignments [N, K] of N rows to K centroids (the repository's `sknopp`)."""
    P = (scores * lam).softmax(1).T  # [K, N]
    K, N = P.shape
    c = torch.ones(N, 1) / N
    for it in range(iters):
        r = (1 / K) / (P @ c)
        c_new = (1 / N) / (r.T @ P).T
        done = it % 10 == 0 and torch.nansum((c / c_new - 1).abs()) < 1e-2
        c = c_new
        if done:
            break
    return (P * c.squeeze()).T * r.squeeze() * N


@torch.no_grad()
def balanced_kmeans(z: torch.Tensor, cent: torch.Tensor, g: np.random.Generator, iters: int = 5):
    """Spherical k-means with Sinkhorn-balanced assignments from the starting centroids `cent` (an
    empty cluster takes a random row), as the repository's `local_clustering`."""
    z, cent = F.normalize(z, dim=1), cent.clone()
    for _ in range(iters):
        assign = sinkhorn(z @ cent.T, iters=10).argmax(1)
        for j in range(len(cent)):
            rows = z[assign == j]
            cent[j] = F.normalize((rows if len(rows) else z[g.integers(len(z))][None]).mean(0), dim=0)
    return cent


def local_centroids(z: torch.Tensor, n_centroids: int, g: np.random.Generator, iters: int = 5):
    """A client's upload: balanced k-means of its normalised features from random rows."""
    z = F.normalize(z, dim=1)
    return balanced_kmeans(z, z[g.choice(len(z), min(n_centroids, len(z)), replace=False)], g, iters)


def global_centroids(start: torch.Tensor, local: torch.Tensor, cfg: FedoSSLConfig) -> torch.Tensor:
    """Orchestra's server step: SGD on the C centroids so that their softmax assignments of the uploaded
    local centroids match the Sinkhorn assignments (cosine), renormalising after each step."""
    cent = start.clone().requires_grad_(True)
    opt = ParamSGD([cent], lr=0.01, momentum=0.9, weight_decay=1e-4)
    zn = F.normalize(local, dim=1)
    for _ in range(cfg.global_steps):
        with torch.no_grad():
            target = sinkhorn(local @ cent.T, iters=cfg.server_sinkhorn_iters)
        loss = -F.cosine_similarity(target, (zn @ cent.T / cfg.temperature).softmax(1), dim=-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            cent.copy_(F.normalize(cent, dim=1))
    return cent.detach()


def align_seen(cent: torch.Tensor, labeled_means: torch.Tensor) -> torch.Tensor:
    """Put at index c < num_seen the centroid closest (cosine) to seen class c's labelled-feature mean
    (the repo's greedy top-1, else top-2, else — our fallback — the best free one); the rest fill the
    unseen indices in their order (`set_labeled_feature_centroids`)."""
    sims = F.normalize(labeled_means, dim=1) @ cent.T
    taken: list[int] = []
    for c in range(len(labeled_means)):
        order = [j for j in sims[c].argsort(descending=True).tolist() if j not in taken]
        taken.append(order[0])
    rest = [j for j in range(len(cent)) if j not in taken]
    return cent[taken + rest]


# --- the federated run ------------------------------------------------------------------------------------
@torch.no_grad()
def _features(model, x):
    model.eval()
    return model(x)[1]


def evaluate(model, x_test, y_test, num_seen: int, num_classes: int) -> dict:
    """Seen accuracy (plain, as the repository), Hungarian accuracy overall and on the unseen rows, and
    the per-class accuracies of `per_class_matched_accuracy`."""
    with torch.no_grad():
        pred = model(x_test)[0].argmax(1).numpy()
    y = np.asarray(y_test)
    seen = y < num_seen
    return {"seen_acc": float(np.mean(pred[seen] == y[seen])),
            "unseen_acc": cluster_accuracy(pred[~seen], y[~seen]),
            "all_acc": cluster_accuracy(pred, y),
            "per_class": per_class_matched_accuracy(pred, y, num_seen, num_classes)}


def run_fedossl(clients: list[ClientData], x_test, y_test, cfg: FedoSSLConfig, rounds: int, seed: int = 0,
                num_seen: int = 6, num_classes: int = 10, hidden=(128, 64)) -> dict:
    """FedAvg over all clients every round (uniform 1/K weights, as the repository), E = 1; with
    `cfg.calibrate` the server also builds the global centroids. Returns the final evaluation."""
    global_model = OpenWorldNet(clients[0].x_lab.shape[1], num_classes, hidden, seed=seed)
    models = [copy.deepcopy(global_model) for _ in clients]
    opts = [ParamSGD(m.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=5e-4) for m in models]
    counts = [np.zeros(num_classes) for _ in clients]
    for r in range(rounds):
        for k, (m, opt, data) in enumerate(zip(models, opts, clients)):
            counts[k] = local_epoch(m, opt, data, cfg, r, counts[k], seed, k)
        with torch.no_grad():
            for name, p in global_model.named_parameters():
                p.copy_(torch.stack([dict(m.named_parameters())[name] for m in models]).mean(0))
        if cfg.calibrate:
            g = rng(seed, FEDOSSL, 2, r)
            feats = [_features(m, torch.cat([d.x_lab, d.x_unl])) for m, d in zip(models, clients)]
            local = torch.cat([local_centroids(f, cfg.local_centroids, g) for f in feats])
            means = torch.stack([torch.stack([f[:len(d.y_lab)][d.y_lab == c].mean(0) for c in range(num_seen)])
                                 for f, d in zip(feats, clients)]).mean(0)  # averaged labelled means
            cent = (global_centroids(global_model.centroids, local, cfg) if cfg.server == "orchestra"
                    else balanced_kmeans(local, global_model.centroids, g, cfg.server_iters))
            global_model.centroids.copy_(align_seen(cent, means))
        for m in models:
            m.load_state_dict(global_model.state_dict())
    return evaluate(global_model, x_test, y_test, num_seen, num_classes)


VARIANTS = {"baseline": (False, False), "suppress": (True, False), "calibrate": (False, True),
            "fedossl": (True, True)}


@register("fedossl", claims="fedossl", kind="module")
def fedossl(variant: str = "fedossl", **overrides) -> FedoSSLConfig:
    """The FedoSSL client/server configuration: `variant` "fedossl" (both additions), "suppress",
    "calibrate" or "baseline" (ORCA-style FedAvg); other fields of FedoSSLConfig by keyword."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    suppress, calibrate = VARIANTS[variant]
    unknown = set(overrides) - set(FedoSSLConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown FedoSSL option(s) {sorted(unknown)}; see FedoSSLConfig")
    cfg = replace(FedoSSLConfig(), suppress=suppress, calibrate=calibrate, **overrides)
    if cfg.server not in ("kmeans", "orchestra"):
        raise ValueError(f"server must be 'kmeans' or 'orchestra', got {cfg.server!r}")
    return cfg
