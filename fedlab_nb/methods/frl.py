"""FRL — Federated Rank Learning (Mozaffari, Shejwalkar, Houmansadr, "Every Vote Counts: Ranking-Based
Training of Federated Learning to Resist Poisoning Attacks", USENIX Security 2023; code: SPIN-UMass/FRL).

The network's weights W_l are frozen at a random "signed constant" initialisation (±sqrt(2 / fan_in)).
Every edge has a score s; the forward pass uses only the top-k% edges of each layer by score (a
*supermask*, edge-popup). Clients never send weights or scores: they send, per layer, the **ranking** of
their edges (edge ids sorted by ascending score). The server votes:

    reputation_i(e) = position of edge e in client i's ranking      (0 = least important)
    global ranking  = argsort_e  Σ_i reputation_i(e)                (Borda count; one vote per client)

and maps the global ranking onto the fixed sorted initial scores, so the global scores are always a
permutation of the initial ones. Everything here is a pure function of tensors; `run_frl` is the small
round loop that strings them together (FRL is not a Δ-averaging method, so it does not use `simulate`).

One deliberate difference from the repository: its mask is the top-k% of |s| (edge-popup's code), while
the paper describes the top-k% of s. With voted scores the two differ (the least-voted edges get the most
negative scores), so we follow the paper: mask = top-k% by score = the last k% of the global ranking.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..engine.client import batch_schedule
from ..engine.history import History
from ..utils import check_positive_int, rng

SAMPLE, BATCHES = 11, 12  # stream ids for `rng(seed, stream, round, client)`


# ----------------------------------------------------------------------------------------------------
# The supermask network: frozen weights + one score per edge


@dataclass
class SupermaskNet:
    """A bias-free ReLU MLP whose weights are frozen; only the choice of edges is learned.

    `weights[l]` is W_l [out, in]; `sorted_scores[l]` holds layer l's initial scores sorted ascending —
    the values a ranking is mapped onto (`scores_from_ranking`); `k` is the fraction of active edges."""
    weights: list[Tensor]
    sorted_scores: list[Tensor]
    k: float

    @property
    def layer_sizes(self) -> list[int]:
        """n_l, the number of edges (= ranked items) of each layer."""
        return [w.numel() for w in self.weights]


def make_supermask_net(sizes, k: float = 0.5, seed: int = 0) -> tuple[SupermaskNet, list[Tensor]]:
    """Signed-constant weights and Kaiming-uniform scores for layer widths `sizes`, e.g. (64, 128, 64, 10).

    Returns the net and the initial global ranking of each layer (argsort of the initial scores)."""
    sizes = [check_positive_int("sizes[i]", s) for s in sizes]
    if len(sizes) < 2:
        raise ValueError(f"sizes needs at least an input and an output width, got {sizes}")
    if not 0 < k <= 1:
        raise ValueError(f"k is the fraction of active edges per layer, in (0, 1]; got {k}")
    g = torch.Generator().manual_seed(seed)
    weights, sorted_scores, rankings = [], [], []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        sign = torch.randint(0, 2, (fan_out, fan_in), generator=g).float() * 2 - 1
        weights.append(sign * math.sqrt(2.0 / fan_in))  # signed constant: ReLU gain / sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)), PyTorch's default Linear init
        scores = (torch.rand(fan_out * fan_in, generator=g) * 2 - 1) * bound
        sorted_scores.append(scores.sort().values)
        rankings.append(ranking_of(scores))
    return SupermaskNet(weights, sorted_scores, float(k)), rankings


def num_active(n: int, k: float) -> int:
    """Edges kept by a top-k% mask over n edges: round(k·n), at least one."""
    return max(1, int(round(k * n)))


def topk_mask(scores: Tensor, k: float) -> Tensor:
    """0/1 float mask of the round(k·n) highest scores in each row of `scores` [..., n].

    A selection (`kthvalue`, linear time) rather than `topk` (about 3× slower here): an edge is kept when
    its score is above the (n − round(k·n))-th smallest. Exact for distinct scores; FRL's scores are a
    permutation of continuous random values, so ties do not occur in practice."""
    n = scores.shape[-1]
    drop = n - num_active(n, k)
    if drop == 0:
        return torch.ones_like(scores)
    threshold = scores.kthvalue(drop, dim=-1, keepdim=True).values
    return (scores > threshold).to(scores.dtype)


def forward(net: SupermaskNet, scores: list[Tensor], x: Tensor) -> Tensor:
    """Logits of the subnetworks chosen by `scores`, for m clients at once: scores[l] is [m, n_l] and x is
    [m, B, D] (or one client: [n_l] and [B, D]). The mask passes gradients straight through
    (m + s − s.detach() equals m forward and has ∂/∂s = 1), so ∂L/∂s_e = ∂L/∂(W⊙m)_e · W_e (edge-popup)."""
    if x.dim() == 2:
        return forward(net, [s[None] for s in scores], x[None])[0]
    h = x
    for layer, (w, s) in enumerate(zip(net.weights, scores)):
        mask = topk_mask(s.detach(), net.k) + s - s.detach()
        h = h @ (w * mask.view(-1, *w.shape)).transpose(1, 2)
        if layer < len(net.weights) - 1:
            h = F.relu(h)
    return h


# ----------------------------------------------------------------------------------------------------
# Rankings and the vote


def ranking_of(scores: Tensor) -> Tensor:
    """A client's upload for one layer: edge ids sorted by ascending score (the repo's `Find_rank`)."""
    return scores.detach().reshape(-1).argsort(stable=True)


def reputations(rankings: Tensor) -> Tensor:
    """[m, n] rankings → [m, n] positions: entry (i, e) is where edge e sits in client i's ranking."""
    rankings = torch.as_tensor(rankings)
    if rankings.dim() == 1:
        rankings = rankings[None]
    pos = torch.empty_like(rankings)
    steps = torch.arange(rankings.shape[1], device=rankings.device).expand_as(rankings)
    return pos.scatter_(1, rankings, steps)


def vote(rankings: Tensor) -> Tensor:
    """FRL's server aggregation: the edges sorted by the sum of their reputations over clients
    (ties → lower edge id). Each client contributes a permutation, so no client weighs more than another."""
    rankings = torch.as_tensor(rankings)
    if rankings.dim() != 2 or rankings.shape[0] == 0:
        raise ValueError(f"rankings must be an [m, n] tensor of m >= 1 permutations, got shape {tuple(rankings.shape)}")
    n = rankings.shape[1]
    if not torch.equal(rankings.sort(dim=1).values, torch.arange(n, device=rankings.device).expand_as(rankings)):
        raise ValueError("every row of rankings must be a permutation of 0..n-1 (edge ids); "
                         "build one with ranking_of(scores)")
    return reputations(rankings).sum(dim=0).argsort(stable=True)


def scores_from_ranking(ranking: Tensor, sorted_scores: Tensor) -> Tensor:
    """Scores s with s[ranking[j]] = sorted_scores[j]: the j-th least important edge gets the j-th smallest
    initial score (the repo's `FRL_Vote` assignment)."""
    scores = torch.empty_like(sorted_scores)
    scores[ranking] = sorted_scores
    return scores


def mask_from_ranking(ranking: Tensor, k: float) -> Tensor:
    """Flat 0/1 mask keeping the top-k% edges of a ranking (its last round(k·n) entries)."""
    n = ranking.numel()
    mask = torch.zeros(n)
    mask[ranking[n - num_active(n, k):]] = 1.0
    return mask


def reverse_ranking(ranking: Tensor) -> Tensor:
    """The repository's rank-space attack: the most important edges are submitted as the least important."""
    return ranking.flip(-1)


# ----------------------------------------------------------------------------------------------------
# Upload size


def rank_upload_bits(layer_sizes) -> int:
    """Bits one client uploads per round: Σ_l n_l·⌈log₂ n_l⌉ (n_l edge ids of ⌈log₂ n_l⌉ bits each)."""
    return sum(n * max(1, math.ceil(math.log2(n))) for n in layer_sizes)


def float_upload_bits(layer_sizes) -> int:
    """Bits of the same number of float32 values (a FedAvg update of the same edges): 32·Σ_l n_l."""
    return 32 * sum(layer_sizes)


def pack_ranking(ranking: Tensor) -> bytes:
    """Encode a ranking of n edges with exactly ⌈log₂ n⌉ bits per id (big-endian bit stream)."""
    n = ranking.numel()
    width = max(1, math.ceil(math.log2(n)))
    ids = ranking.cpu().numpy().astype(np.uint64)
    bits = (ids[:, None] >> np.arange(width - 1, -1, -1, dtype=np.uint64)) & np.uint64(1)
    return np.packbits(bits.astype(np.uint8).reshape(-1)).tobytes()


def unpack_ranking(blob: bytes, n: int) -> Tensor:
    """Inverse of `pack_ranking` for a ranking of n edges."""
    width = max(1, math.ceil(math.log2(n)))
    bits = np.unpackbits(np.frombuffer(blob, np.uint8))[: n * width].reshape(n, width).astype(np.int64)
    return torch.from_numpy(bits @ (1 << np.arange(width - 1, -1, -1, dtype=np.int64)))


# ----------------------------------------------------------------------------------------------------
# Clients, evaluation, and the round loop


def _schedule(sizes, epochs: int, batch_size: int, generators) -> tuple[Tensor, Tensor, Tensor]:
    """Per-step batch indices [T, m, B], validity [T, m, B] and epoch [T, m] (−1: that client is done).
    Each client shuffles its own data every epoch; clients with less data finish earlier."""
    per_client = []
    for n, g in zip(sizes, generators):  # the engine's schedule: a fresh permutation per epoch, cut into batches
        per_epoch = -(-int(n) // batch_size)
        batches = batch_schedule(int(n), batch_size, epochs, None, g)
        per_client.append([(t // per_epoch, torch.from_numpy(b)) for t, b in enumerate(batches)])
    T, m = max(len(p) for p in per_client), len(sizes)
    idx = torch.zeros(T, m, batch_size, dtype=torch.long)
    valid = torch.zeros(T, m, batch_size, dtype=torch.bool)
    epoch = torch.full((T, m), -1)
    for i, steps in enumerate(per_client):
        for t, (e, batch) in enumerate(steps):
            idx[t, i, :len(batch)], valid[t, i, :len(batch)], epoch[t, i] = batch, True, e
    return idx, valid, epoch


def clients_rank_update(net: SupermaskNet, global_ranking: list[Tensor], data, *, epochs: int = 2,
                        batch_size: int = 8, lr: float = 0.4, momentum: float = 0.9, weight_decay: float = 1e-4,
                        generators=None) -> list[list[Tensor]]:
    """Edge-popup on m clients at once (`data`: their (x, y)): each starts from the global scores, trains
    them by SGD with momentum and weight decay and a cosine lr over the local epochs (the repo's optimiser),
    and returns its ranking of every layer. The clients are independent; batching them is only for speed."""
    m = len(data)
    generators = generators if generators is not None else [np.random.default_rng(i) for i in range(m)]
    sizes = [len(y) for _, y in data]
    x_pad = torch.zeros(m, max(sizes), data[0][0].shape[1])
    y_pad = torch.zeros(m, max(sizes), dtype=torch.long)
    for i, (x, y) in enumerate(data):
        x_pad[i, :len(y)], y_pad[i, :len(y)] = x, y
    idx, valid, epoch = _schedule(sizes, epochs, batch_size, generators)
    lr_of_epoch = torch.tensor([lr * 0.5 * (1 + math.cos(math.pi * e / epochs)) for e in range(epochs)] + [0.0])
    scores = [scores_from_ranking(r, s).expand(m, -1).clone().requires_grad_(True)
              for r, s in zip(global_ranking, net.sorted_scores)]
    velocity = [torch.zeros_like(s) for s in scores]
    rows = torch.arange(m)[:, None]
    for t in range(idx.shape[0]):
        weight = valid[t].float() / valid[t].sum(1, keepdim=True).clamp_min(1)  # per-client batch mean
        logits = forward(net, scores, x_pad[rows, idx[t]])
        loss = (F.cross_entropy(logits.transpose(1, 2), y_pad[rows, idx[t]], reduction="none") * weight).sum()
        grads = torch.autograd.grad(loss, scores)
        active = (epoch[t] >= 0)[:, None]
        step_lr = lr_of_epoch[epoch[t]][:, None]  # epoch −1 picks the trailing 0
        with torch.no_grad():
            for s, v, g in zip(scores, velocity, grads):
                v.copy_(torch.where(active, momentum * v + g + weight_decay * s, v))
                s.sub_(step_lr * v)
    return [[ranking_of(s[i]) for s in scores] for i in range(m)]


def client_rank_update(net: SupermaskNet, global_ranking: list[Tensor], x: Tensor, y: Tensor, *,
                       generator: np.random.Generator | None = None, **hyper) -> list[Tensor]:
    """One client's FRL update: its ranking of every layer after local edge-popup training (see
    `clients_rank_update` for the hyperparameters)."""
    gens = None if generator is None else [generator]
    return clients_rank_update(net, global_ranking, [(x, y)], generators=gens, **hyper)[0]


@torch.no_grad()
def evaluate(net: SupermaskNet, ranking: list[Tensor], x: Tensor, y: Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the supermask chosen by a global ranking."""
    scores = [scores_from_ranking(r, s) for r, s in zip(ranking, net.sorted_scores)]
    logits = forward(net, scores, x)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


@dataclass
class HonestMajoritySampler:
    """m clients uniformly without replacement, redrawn while the malicious ones reach half of the round
    (the repository's sampler). A `simulate`-compatible sampler, so FedAvg baselines can use it too."""
    clients_per_round: int
    malicious: tuple = ()

    def __call__(self, round: int, num_clients: int, g: np.random.Generator) -> np.ndarray:
        m = self.clients_per_round
        if not 1 <= m <= num_clients:
            raise ValueError(f"clients_per_round={m} must be between 1 and the {num_clients} clients")
        if 2 * len(self.malicious) >= num_clients:
            raise ValueError(f"{len(self.malicious)} malicious of {num_clients} clients: need a honest majority")
        bad = np.zeros(num_clients, bool)
        bad[list(self.malicious)] = True
        while True:
            ids = np.sort(g.choice(num_clients, m, replace=False))
            if 2 * bad[ids].sum() < m:
                return ids


def run_frl(fed, hidden=(128, 64), *, k: float = 0.5, rounds: int = 30, clients_per_round: int = 10,
            local_epochs: int = 2, batch_size: int = 8, lr: float = 0.4, lr_decay: float = 0.999,
            momentum: float = 0.9, malicious=(), seed: int = 0, eval_every: int = 1) -> History:
    """FRL on a `FederatedDataset`, returning a `History` (round, n_sampled, test_loss, test_acc).

    `malicious`: ids of clients running the repository's attack — train honestly, vote among the
    malicious clients of the round, and all submit the reversed result. `hist.meta["upload_bits"]` is one
    client's upload per round; `hist.theta` is the final global ranking (one per layer), `hist.model` the
    `SupermaskNet`."""
    check_positive_int("rounds", rounds)
    check_positive_int("eval_every", eval_every)
    net, ranking = make_supermask_net([math.prod(fed.input_shape), *hidden, fed.num_classes], k=k, seed=seed)
    sampler = HonestMajoritySampler(clients_per_round, tuple(int(i) for i in malicious))
    bad = set(sampler.malicious)
    rows = []
    for r in range(rounds):
        ids = sampler(r, fed.num_clients, rng(seed, SAMPLE, r))
        lr_r = lr * lr_decay ** r

        def local(clients):  # honest local training of these clients, batched
            data = [tuple(t.cpu() for t in fed.client_train[c]) for c in clients]
            gens = [rng(seed, BATCHES, r, c) for c in clients]
            return clients_rank_update(net, ranking, data, epochs=local_epochs, batch_size=batch_size, lr=lr_r,
                                       momentum=momentum, generators=gens) if clients else []

        honest = [c for c in ids if c not in bad]
        attackers = [c for c in ids if c in bad]
        uploads = local(honest + attackers)
        if attackers:  # every attacker submits the reversed vote of the attackers' honest rankings
            honest_view = uploads[len(honest):]
            evil = [reverse_ranking(vote(torch.stack(layer))) for layer in zip(*honest_view)]
            uploads = uploads[:len(honest)] + [evil] * len(attackers)
        ranking = [vote(torch.stack(layer)) for layer in zip(*uploads)]
        row = {"round": r + 1, "n_sampled": len(ids), "n_malicious": len(attackers)}
        if (r + 1) % eval_every == 0 or r + 1 == rounds:
            row["test_loss"], row["test_acc"] = evaluate(net, ranking, fed.x_test.cpu(), fed.y_test.cpu())
        rows.append(row)
    meta = {"method": "frl", "k": k, "hidden": tuple(hidden), "malicious": len(bad), "seed": seed,
            "upload_bits": rank_upload_bits(net.layer_sizes)}
    hist = History.from_rows(rows, meta)
    hist.theta, hist.model = ranking, net
    return hist
