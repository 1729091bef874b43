"""FRL — Federated Rank Learning (Mozaffari, Shejwalkar, Houmansadr, "Every Vote Counts: Ranking-Based
Training of Federated Learning to Resist Poisoning Attacks", USENIX Security 2023; code: SPIN-UMass/FRL).

The network's weights W_l are frozen at a random "signed constant" initialisation (±sqrt(2 / fan_in)).
Every edge has a score s; the forward pass uses only the top-k% edges of each layer by score (a
*supermask*, edge-popup). Clients never send weights or scores: they send, per layer, the **ranking** of
their edges (edge ids sorted by ascending score). The server votes:

    reputation_i(e) = position of edge e in client i's ranking      (0 = least important)
    global ranking  = argsort_e  Σ_i reputation_i(e)                (Borda count; one vote per client)

and maps the global ranking onto the fixed sorted initial scores, so the global scores are always a
permutation of the initial ones. The pieces are pure functions of tensors; `frl_method` puts them on the
round pipeline (`simulate`): a supermask nn.Module whose parameters are the scores, a client update whose
local training is edge-popup and whose message is the "ranking", the vote as the rule with θ ← the voted
scores, the attack on the ranking rows, and bytes_up measured from the packed rankings. `run_frl` is a thin
wrapper over `simulate`.

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
from torch import nn

from ...core.history import History
from ...core.messages import Transform
from ...core.method import Method, OwnTraining, ServerAssign, UniformWeighting
from ...core.registry import register
from ...core.round import batch_schedule
from ...core.streams import SAMPLE
from ...engine import simulate
from ...utils import check_positive_int, rng


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
# Clients and evaluation (pure functions)


def _schedule(batches, sizes, batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-step batch indices [T, m, B], validity [T, m, B] and epoch [T, m] (−1: that client is done) of the
    clients' batch lists (the engine's schedules: a fresh permutation per epoch, cut into batches);
    clients with less data finish earlier."""
    per_client = []
    for n, steps in zip(sizes, batches):
        per_epoch = -(-int(n) // batch_size)
        per_client.append([(t // per_epoch, torch.as_tensor(np.asarray(b), dtype=torch.long)) for t, b in enumerate(steps)])
    T, m = max(len(p) for p in per_client), len(sizes)
    idx = torch.zeros(T, m, batch_size, dtype=torch.long)
    valid = torch.zeros(T, m, batch_size, dtype=torch.bool)
    epoch = torch.full((T, m), -1)
    for i, steps in enumerate(per_client):
        for t, (e, batch) in enumerate(steps):
            idx[t, i, :len(batch)], valid[t, i, :len(batch)], epoch[t, i] = batch, True, e
    return idx, valid, epoch


def edge_popup(net: SupermaskNet, start: list[Tensor], data, batches, *, epochs: int, batch_size: int, lr: float,
               momentum: float = 0.9, weight_decay: float = 1e-4) -> tuple[list[Tensor], Tensor]:
    """Edge-popup on m clients at once: client i trains the scores `start[l]` ([n_l], the same for all) on
    its `data[i] = (x, y)` along its batch list `batches[i]`, by SGD with momentum and weight decay and a
    cosine lr over the local epochs (the repository's optimiser). Returns the final scores [m, n_l] of each
    layer and each client's mean training loss [m]. The clients are independent; batching is for speed."""
    m, dev = len(data), data[0][0].device
    sizes = [len(y) for _, y in data]
    x_pad = torch.zeros(m, max(sizes), data[0][0].shape[1], device=dev)
    y_pad = torch.zeros(m, max(sizes), dtype=torch.long, device=dev)
    for i, (x, y) in enumerate(data):
        x_pad[i, :len(y)], y_pad[i, :len(y)] = x, y
    idx, valid, epoch = (t.to(dev) for t in _schedule(batches, sizes, batch_size))
    lr_of_epoch = torch.tensor([lr * 0.5 * (1 + math.cos(math.pi * e / epochs)) for e in range(epochs)] + [0.0],
                               device=dev)
    scores = [s.detach().to(dev).expand(m, -1).clone().requires_grad_(True) for s in start]
    velocity = [torch.zeros_like(s) for s in scores]
    rows = torch.arange(m, device=dev)[:, None]
    total = torch.zeros(m, device=dev)
    for t in range(idx.shape[0]):
        weight = valid[t].float() / valid[t].sum(1, keepdim=True).clamp_min(1)  # per-client batch mean
        logits = forward(net, scores, x_pad[rows, idx[t]])
        per_client = (F.cross_entropy(logits.transpose(1, 2), y_pad[rows, idx[t]], reduction="none") * weight).sum(1)
        grads = torch.autograd.grad(per_client.sum(), scores)
        active = (epoch[t] >= 0)[:, None]
        step_lr = lr_of_epoch[epoch[t]][:, None]  # epoch −1 picks the trailing 0
        with torch.no_grad():
            total += per_client.detach() * active[:, 0]
            for s, v, g in zip(scores, velocity, grads):
                v.copy_(torch.where(active, momentum * v + g + weight_decay * s, v))
                s.sub_(step_lr * v)
    steps = torch.tensor([len(b) for b in batches], device=dev, dtype=total.dtype).clamp_min(1)
    return [s.detach() for s in scores], total / steps


def clients_rank_update(net: SupermaskNet, global_ranking: list[Tensor], data, *, epochs: int = 2,
                        batch_size: int = 8, lr: float = 0.4, momentum: float = 0.9, weight_decay: float = 1e-4,
                        generators=None) -> list[list[Tensor]]:
    """`edge_popup` from the global ranking's scores for m clients (`data`: their (x, y)), each shuffling
    with its own generator; returns each client's ranking of every layer."""
    m = len(data)
    generators = generators if generators is not None else [np.random.default_rng(i) for i in range(m)]
    batches = [batch_schedule(len(y), batch_size, epochs, None, g) for (_, y), g in zip(data, generators)]
    start = [scores_from_ranking(r, s) for r, s in zip(global_ranking, net.sorted_scores)]
    scores, _ = edge_popup(net, start, data, batches, epochs=epochs, batch_size=batch_size, lr=lr, momentum=momentum,
                           weight_decay=weight_decay)
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


# ----------------------------------------------------------------------------------------------------
# FRL on the round pipeline: the supermask module, the client update, the vote rule, the attack, the bytes


class SupermaskMLP(nn.Module):
    """The supermask network as an nn.Module for `simulate`: frozen signed-constant weights (`weight<l>`)
    and the sorted initial scores (`sorted<l>`) are buffers; the flat scores of each layer (`scores<l>`,
    [n_l]) are the only parameters, so θ = the concatenated scores. forward = top-k% mask by score."""

    def __init__(self, sizes, k: float = 0.5, seed: int = 0):
        super().__init__()
        net, ranking = make_supermask_net(sizes, k=k, seed=seed)
        self.k, self.num_layers = net.k, len(net.weights)
        for l, (w, s, r) in enumerate(zip(net.weights, net.sorted_scores, ranking)):
            self.register_buffer(f"weight{l}", w)
            self.register_buffer(f"sorted{l}", s)
            self.register_parameter(f"scores{l}", nn.Parameter(scores_from_ranking(r, s)))

    @property
    def net(self) -> SupermaskNet:
        L = range(self.num_layers)
        return SupermaskNet([getattr(self, f"weight{l}") for l in L], [getattr(self, f"sorted{l}") for l in L], self.k)

    @property
    def layer_sizes(self) -> list[int]:
        return self.net.layer_sizes

    def forward(self, x: Tensor) -> Tensor:
        return forward(self.net, [getattr(self, f"scores{l}") for l in range(self.num_layers)], x.flatten(1))


def _layers(flat: Tensor, layer_sizes) -> list[Tensor]:
    """Split [..., Σ n_l] into the layers' [..., n_l] parts."""
    return list(flat.split(list(layer_sizes), dim=-1))


@dataclass
class FRLClientUpdate(OwnTraining):
    """FRL's local training (`local_train`): edge-popup from the broadcast scores on the engine's batch
    schedules, at lr · lr_decay^round with a cosine over the local epochs; the message is the "ranking"
    of every layer (int64, the layers' rankings concatenated, each in layer-local edge ids)."""
    lr_decay: float = 0.999
    momentum: float = 0.9
    weight_decay: float = 1e-4

    def local_train(self, method, ctx, jobs, down, cstate):
        model = ctx.model
        net = model.net
        start = _layers(down["theta"], net.layer_sizes)
        scores, losses = edge_popup(net, start, [(j.x, j.y) for j in jobs], [j.batches for j in jobs],
                                    epochs=ctx.local_epochs, batch_size=ctx.batch_size,
                                    lr=ctx.lr * self.lr_decay ** ctx.round, momentum=self.momentum,
                                    weight_decay=self.weight_decay)
        ranking = torch.cat([s.argsort(dim=1, stable=True) for s in scores], dim=1)  # ranking_of, row by row
        return {"ranking": ranking}, cstate, losses


@dataclass
class RankVote:
    """The server rule: Borda `vote` on each layer's rankings [m, n_l], mapped onto the fixed sorted initial
    scores (`scores_from_ranking`), so the new global scores are always a permutation of the initial ones."""
    layer_sizes: tuple
    sorted_scores: Tensor   # the layers' sorted initial scores, concatenated

    def __call__(self, rankings: Tensor, weights: Tensor | None = None) -> Tensor:
        sorted_scores = _layers(self.sorted_scores.to(rankings.device), self.layer_sizes)
        return torch.cat([scores_from_ranking(vote(r), s)
                          for r, s in zip(_layers(rankings, self.layer_sizes), sorted_scores)])


@dataclass
class ReversedVoteAttack:
    """The repository's attack as a `simulate(attack=...)` on the ranking rows: the malicious clients of the
    round train honestly, vote among themselves, and all submit the reversed result (per layer)."""
    layer_sizes: tuple

    def __call__(self, rankings: Tensor, byzantine: Tensor, generator=None) -> Tensor:
        out = rankings.clone()
        bad = rankings[byzantine]
        evil = torch.cat([reverse_ranking(vote(r)) for r in _layers(bad, self.layer_sizes)])
        out[byzantine] = evil
        return out


@dataclass
class PackedRankingBytes(Transform):
    """Uplink transform: the wire size of each client's message is its rankings packed at ⌈log₂ n_l⌉ bits per
    edge id (`pack_ranking`, one blob per layer), measured from the encoding."""
    layer_sizes: tuple

    def __call__(self, msgs, cstate, ctx):
        rows = msgs["ranking"]
        msgs.bytes = torch.tensor([sum(len(pack_ranking(r)) for r in _layers(rows[i], self.layer_sizes))
                                   for i in range(len(rows))], dtype=torch.int64)
        return msgs, cstate


def frl_method(model: SupermaskMLP, *, lr_decay: float = 0.999, momentum: float = 0.9,
               weight_decay: float = 1e-4) -> Method:
    """FRL as a pipeline `Method` for the supermask `model`: edge-popup clients sending rankings, the vote,
    θ ← the voted scores (`ServerAssign`), bytes_up from the packed rankings. Use with `simulate(method,
    fed, model, clients_per_round=HonestMajoritySampler(...), attack=ReversedVoteAttack(...))`."""
    sizes = tuple(model.layer_sizes)
    sorted_scores = torch.cat([getattr(model, f"sorted{l}") for l in range(model.num_layers)]).detach().cpu()
    return Method("frl", weighting=UniformWeighting(), rule=RankVote(sizes, sorted_scores), server_opt=ServerAssign(),
                  uplink=(PackedRankingBytes(sizes),),
                  client=FRLClientUpdate(lr_decay, momentum, weight_decay), aggregate_key="ranking")


@register("frl", claims="frl", kind="module")
def run_frl(fed, hidden=(128, 64), *, k: float = 0.5, rounds: int = 30, clients_per_round: int = 10,
            local_epochs: int = 2, batch_size: int = 8, lr: float = 0.4, lr_decay: float = 0.999,
            momentum: float = 0.9, malicious=(), seed: int = 0, eval_every: int = 1) -> History:
    """FRL on a `FederatedDataset`, returning a `History` (round, n_sampled, n_malicious, test_loss, test_acc,
    bytes_up ...): `simulate` of `frl_method` with the honest-majority sampler.

    `malicious`: ids of clients running the repository's attack — train honestly, vote among the
    malicious clients of the round, and all submit the reversed result. `hist.meta["upload_bits"]` is one
    client's upload per round; `hist.theta` is the final global ranking (one per layer), `hist.model` the
    `SupermaskMLP`."""
    check_positive_int("rounds", rounds)
    check_positive_int("eval_every", eval_every)
    model = SupermaskMLP([math.prod(fed.input_shape), *hidden, fed.num_classes], k=k, seed=seed)
    sizes = tuple(model.layer_sizes)
    bad = tuple(sorted(int(i) for i in malicious))
    sampler = HonestMajoritySampler(clients_per_round, bad)
    hist = simulate(frl_method(model, lr_decay=lr_decay, momentum=momentum), fed, model, rounds=rounds,
                    clients_per_round=sampler, local_epochs=local_epochs, batch_size=batch_size, lr=lr, seed=seed,
                    eval_every=eval_every, attack=ReversedVoteAttack(sizes) if bad else None, byzantine=bad,
                    backend="loop", progress=False)
    is_bad = np.isin(np.arange(fed.num_clients), bad)  # the engine's draws, replayed: malicious clients per round
    hist.insert(2, "n_malicious", [int(is_bad[sampler(r, fed.num_clients, rng(seed, SAMPLE, r))].sum())
                                   for r in range(rounds)])
    hist.meta.update({"method": "frl", "k": k, "hidden": tuple(hidden), "malicious": len(bad),
                      "upload_bits": rank_upload_bits(sizes)})
    hist.theta = [ranking_of(s) for s in _layers(hist.theta, sizes)]
    return hist
