"""FED-PUB — Jinheon Baek, Wonyong Jeong, Jiongdao Jin, Jaehong Yoon, Sung Ju Hwang, "Personalized Subgraph
Federated Learning", ICML 2023, https://arxiv.org/abs/2206.10206. Official code: https://github.com/JinheonBaek/FED-PUB
(`models/fedpub/server.py`, `models/fedpub/client.py`, `models/layers.py`, `models/nets.py`, `parser.py`).

Each client holds one subgraph of a larger graph (the edges to other clients' nodes are lost) and a two-layer GCN.

* **Server (functional embedding).** A random proxy graph, fixed by the seed (the code: a planted-partition graph of
  5 blocks of 100 nodes, p_in = 0.1, p_out = 0, N(0, 1) features), is fed to every client's model; client i's
  embedding e_i is the node mean of the second GCN layer's pre-activation output. The server sets
  α_ij = softmax_j(τ · cos(e_i, e_j)) (τ = `--norm-scale`, default 10) and sends client i its own average
  Σ_j α_ij θ_j. (It also keeps a size-weighted global average, used only for the first round's broadcast.)
* **Client (masks).** Every weight matrix W has a real-valued mask M (initialised to ones, as the official scripts'
  `--laye-mask-one --clsf-mask-one`) and the layer uses W ⊙ M. The masks are trained with the weights and never
  leave the client (the code uploads them but skips them on loading). Local loss:
  CE + λ₁ Σ_M ‖M‖₁ + λ₂ Σ_W ‖θ_W − θ_W^received‖₂ (the proximal term per tensor, not squared; skipped in round 0),
  λ₁ = λ₂ = 1e-3, Adam (lr 1e-2, weight decay 1e-6, state kept across rounds), full-graph steps. At evaluation, and
  for the embedding, mask entries with |m| < λ₁ are zeroed.

**Repository quirk.** The official client adds the L1 and proximal terms over `model.state_dict()` tensors, which
PyTorch returns detached, so in the code as written these terms add no gradient. Here they are applied to the
parameters (the paper's objective); `FedPubConfig(detached_regularisers=True)` reproduces the code's behaviour.

Simplifications (named): dense adjacency (no torch_geometric), zero-initialised biases, all clients every round.
The synthetic data (`two_group_sbm`) stand in for the paper's METIS-split citation and Amazon graphs."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from ...core.registry import register
from ...core.streams import register_stream
from .graphs import (WEIGHTS, gcn_forward, gcn_init, normalized_adjacency, random_partition_graph, sample_sbm,
                      split_communities)
from ...utils import rng

FED_PUB = register_stream("fed_pub", 64)   # graph data, proxy graph, initial weights and dropout of a FED-PUB run
_DATA, _PROXY, _INIT, _DROPOUT = 0, 1, 2, 3   # sub-keys of that stream

AGGREGATIONS = ("similarity", "size", "none")


@dataclass(frozen=True)
class FedPubConfig:
    """One subgraph-FL method. aggregation: "similarity" (FED-PUB's α), "size" (FedAvg), "none" (local only)."""
    name: str = "fed_pub"
    aggregation: str = "similarity"
    scale: float = 10.0                 # τ in α_ij = softmax_j(τ cos(e_i, e_j)); 0 gives the plain mean
    masks: bool = True                  # train a mask M per weight matrix (kept local)
    l1: float = 1e-3                    # λ₁ on ‖M‖₁, and the pruning threshold |m| < λ₁ at evaluation
    loc_l2: float = 1e-3                # λ₂ on the non-squared proximal term Σ_W ‖θ_W − θ_W^received‖₂
    detached_regularisers: bool = False  # True: the official code's state_dict terms (values only, no gradient)
    lr: float = 1e-2
    weight_decay: float = 1e-6
    dropout: float = 0.5
    hidden: int = 128
    local_epochs: int = 1
    n_proxy: int = 5                    # proxy graph: n_proxy blocks of proxy_nodes nodes, p_in inside, none across
    proxy_nodes: int = 100
    proxy_p: float = 0.1

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        for name in ("scale", "l1", "loc_l2", "lr", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("hidden", "local_epochs", "n_proxy", "proxy_nodes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


@register("fed_pub", claims="fed_pub", kind="method")
def fed_pub(**overrides) -> FedPubConfig:
    """FED-PUB with the official defaults (τ = 10, λ₁ = λ₂ = 1e-3, masks of ones, Adam 1e-2); run it with
    `run_subgraph_fl(fed_pub(), data, rounds)`."""
    return FedPubConfig(**overrides)


def baselines(base: FedPubConfig | None = None) -> dict[str, FedPubConfig]:
    """FED-PUB, its two ablations and the two baselines, all with the same optimiser and GCN."""
    base = base or FedPubConfig()
    plain = dict(masks=False, l1=0.0, loc_l2=0.0)
    return {
        "fed_pub": base,
        "no_masks": replace(base, name="no_masks", masks=False, l1=0.0),
        "uniform_alpha": replace(base, name="uniform_alpha", scale=0.0),
        "fedavg": replace(base, name="fedavg", aggregation="size", **plain),
        "local": replace(base, name="local", aggregation="none", **plain),
    }


# --- data ----------------------------------------------------------------------------------------------------------
@dataclass
class SubgraphData:
    """K equal-sized client subgraphs for each of S seeds, stacked: a_hat [S, K, n, n], x [S, K, n, f], y, train,
    test [S, K, n]; groups [K] (which client holds which kind of data); dropped [S] cross-client edges lost."""
    seeds: list[int]
    a_hat: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    train: torch.Tensor
    test: torch.Tensor
    groups: np.ndarray
    dropped: list[int] = field(default_factory=list)

    @property
    def n_classes(self) -> int:
        return int(self.y.max()) + 1


def _class_permutation(n_classes: int) -> np.ndarray:
    return np.roll(np.arange(n_classes), -1)   # a cyclic shift: every class's mean moves to another class


def two_group_sbm(seeds, n_communities: int = 6, nodes: int = 150, n_classes: int = 4, n_feat: int = 16,
                  p_same: float = 0.08, p_diff: float = 0.01, p_out: float = 0.002, mean_scale: float = 0.5,
                  train_frac: float = 0.2, test_frac: float = 0.4) -> SubgraphData:
    """One SBM per seed: n_communities communities of `nodes` nodes (one per client), balanced labels, homophilous
    edges (p_same / p_diff inside a community, p_out across, then dropped by the split); features N(μ_y, I) with
    μ_c ~ N(0, mean_scale² I). The first half of the communities (group A) use μ_y, the second half (group B) use
    μ_{π(y)} with π a cyclic shift of the classes, so the two groups' label knowledge is incompatible.
    Per client, train_frac of the nodes are training and test_frac test nodes (the official split: 20 % / 40 %)."""
    if n_communities < 2 or n_communities % 2:
        raise ValueError(f"n_communities must be an even number >= 2 (two equal groups), got {n_communities!r}")
    if nodes < n_classes:
        raise ValueError(f"nodes must be >= n_classes = {n_classes} (balanced labels), got {nodes!r}")
    if not (0 < train_frac and 0 < test_frac and train_frac + test_frac <= 1):
        raise ValueError(f"train_frac, test_frac must be > 0 with sum <= 1, got {train_frac!r}, {test_frac!r}")
    groups = (np.arange(n_communities) >= n_communities // 2).astype(int)
    perm = _class_permutation(n_classes)
    out = {k: [] for k in ("a_hat", "x", "y", "train", "test")}
    dropped = []
    for s in seeds:
        g = rng(s, FED_PUB, _DATA)
        community = np.repeat(np.arange(n_communities), nodes)
        labels = np.concatenate([g.permutation(np.arange(nodes) % n_classes) for _ in range(n_communities)])
        adj = sample_sbm(labels, community, p_same, p_diff, p_out, g)
        parts, blocks, lost = split_communities(adj, community)
        means = g.normal(0.0, mean_scale, size=(n_classes, n_feat))
        rows = {k: [] for k in out}
        for c, (idx, block) in enumerate(zip(parts, blocks)):
            y = labels[idx]
            mu = means[perm[y]] if groups[c] else means[y]
            order = g.permutation(nodes)
            n_train, n_test = round(train_frac * nodes), round(test_frac * nodes)
            train = np.zeros(nodes, bool)
            train[order[:n_train]] = True
            test = np.zeros(nodes, bool)
            test[order[n_train:n_train + n_test]] = True
            rows["a_hat"].append(normalized_adjacency(block))
            rows["x"].append(torch.as_tensor(mu + g.normal(size=mu.shape), dtype=torch.float32))
            rows["y"].append(torch.as_tensor(y, dtype=torch.long))
            rows["train"].append(torch.as_tensor(train))
            rows["test"].append(torch.as_tensor(test))
        for k in out:
            out[k].append(torch.stack(rows[k]))
        dropped.append(lost)
    return SubgraphData(list(seeds), *(torch.stack(out[k]) for k in ("a_hat", "x", "y", "train", "test")),
                        groups=groups, dropped=dropped)


# --- server --------------------------------------------------------------------------------------------------------
def proxy_graph(seed: int, n_feat: int, n_blocks: int = 5, block_nodes: int = 100, p_in: float = 0.1):
    """(Â, X) of the server's random proxy input, a pure function of the seed (every client gets the same one): a
    planted-partition graph with no edges across blocks and N(0, 1) features. Returned per block, Â [n_blocks, m, m]
    and X [n_blocks, m, f]: with p_out = 0 the graph is block diagonal, so propagating block by block is exact and
    n_blocks times cheaper; the embedding's node mean is the mean over blocks of the block means (equal sizes)."""
    g = rng(seed, FED_PUB, _PROXY)
    adj = random_partition_graph([block_nodes] * n_blocks, p_in, 0.0, g)
    blocks = np.stack([adj[b * block_nodes:(b + 1) * block_nodes, b * block_nodes:(b + 1) * block_nodes]
                       for b in range(n_blocks)])
    x = torch.as_tensor(g.normal(size=(n_blocks, block_nodes, n_feat)), dtype=torch.float32)
    return normalized_adjacency(blocks), x


def prune(masks: dict[str, torch.Tensor], threshold: float) -> dict[str, torch.Tensor]:
    """The evaluation-time masks: entries with |m| < threshold set to 0 (the official `prune`)."""
    return {k: m.masked_fill(m.abs() < threshold, 0.0) for k, m in masks.items()}


def functional_embedding(params, masks, proxy_a_hat, proxy_x) -> torch.Tensor:
    """[..., hidden] node mean of the second GCN layer's pre-activation output on the proxy graph (eval mode), for
    params / masks [..., *shape] and the proxy per block, Â [..., n_blocks, m, m] and X [..., n_blocks, m, f]."""
    with torch.no_grad():
        per_block = {k: v.unsqueeze(-3 if k.endswith("weight") else -2) for k, v in params.items()}
        blocks = None if masks is None else {k: m.unsqueeze(-3) for k, m in masks.items()}
        return gcn_forward(per_block, proxy_a_hat, proxy_x, blocks, embedding=True).mean((-3, -2))


def similarity_weights(embeddings: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos [..., K, K], α [..., K, K]) with α_ij = softmax_j(scale · cos(e_i, e_j)) from embeddings [..., K, d]."""
    if embeddings.dim() < 2:
        raise ValueError(f"embeddings must be [..., K, d], got shape {tuple(embeddings.shape)}")
    if scale < 0:
        raise ValueError(f"scale must be >= 0 (0 gives uniform weights), got {scale!r}")
    unit = F.normalize(embeddings.double(), dim=-1)
    cos = unit @ unit.transpose(-1, -2)
    return cos, torch.softmax(scale * cos, dim=-1)


def personalised_average(params: dict[str, torch.Tensor], alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    """Client i's model Σ_j α_ij θ_j for every i: params [..., K, *shape], α [..., K, K]."""
    out = {}
    for k, v in params.items():
        flat = v.reshape(*alpha.shape[:-1], -1).to(alpha.dtype)
        out[k] = (alpha @ flat).reshape(v.shape).to(v.dtype)
    return out


# --- client --------------------------------------------------------------------------------------------------------
def _per_client_ce(logits, y, train):
    ce = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="none").reshape(y.shape)
    return (ce * train).sum(-1) / train.sum(-1)


def local_loss(cfg: FedPubConfig, params, masks, anchor, a_hat, x, y, train, generator=None) -> torch.Tensor:
    """Sum over clients of CE + λ₁ Σ‖M‖₁ + λ₂ Σ_W ‖θ_W − θ_W^received‖₂ (`anchor` None: no proximal term)."""
    logits = gcn_forward(params, a_hat, x, masks if cfg.masks else None, dropout=cfg.dropout, generator=generator)
    loss = _per_client_ce(logits, y, train).sum()
    batch = y.dim() - 1   # the leading (seed, client) dimensions

    def reg(t):   # the official code reads the terms off detached state_dict tensors
        return t.detach() if cfg.detached_regularisers else t
    if cfg.masks and cfg.l1:
        loss = loss + cfg.l1 * sum(reg(m).abs().flatten(batch).sum(-1).sum() for m in masks.values())
    if anchor is not None and cfg.loc_l2:
        diffs = [(reg(params[k]) - anchor[k]).flatten(batch) for k in params]
        loss = loss + cfg.loc_l2 * sum(torch.linalg.vector_norm(d, dim=-1).sum() for d in diffs)
    return loss


@torch.no_grad()
def accuracy(params, masks, a_hat, x, y, where) -> torch.Tensor:
    """[...] accuracy of each client's model on its `where` nodes (eval mode: no dropout)."""
    pred = gcn_forward(params, a_hat, x, masks).argmax(-1)
    return ((pred == y) & where).sum(-1) / where.sum(-1)


# --- the loop ------------------------------------------------------------------------------------------------------
@dataclass
class SubgraphRun:
    """What `run_subgraph_fl` returns: personal accuracy [S, K] at the end and per round [R, S, K], the FedAvg
    global model's accuracy (size aggregation only), the last and first rounds' cosine similarity and α [S, K, K],
    the mask sparsity [S] (fraction of mask entries with |m| < λ₁) and the final client params and masks."""
    config: FedPubConfig
    personal_acc: torch.Tensor
    curve: torch.Tensor
    global_acc: torch.Tensor | None
    cos: torch.Tensor | None
    alpha: torch.Tensor | None
    cos_first: torch.Tensor | None
    sparsity: torch.Tensor
    params: dict
    masks: dict


def initial_params(data: SubgraphData, hidden: int) -> dict[str, torch.Tensor]:
    """One GCN initialisation per seed, broadcast to its K clients: [S, K, ...]."""
    S, K, _, f = data.x.shape
    per_seed = []
    for s in data.seeds:
        g = torch.Generator().manual_seed(int(rng(s, FED_PUB, _INIT).integers(2**62)))
        per_seed.append(gcn_init(f, hidden, data.n_classes, g))
    return {k: torch.stack([p[k] for p in per_seed])[:, None].expand(S, K, *per_seed[0][k].shape).clone()
            for k in per_seed[0]}


def run_subgraph_fl(cfg: FedPubConfig, data: SubgraphData, rounds: int) -> SubgraphRun:
    """Train every seed's K clients for `rounds` rounds (all clients every round, batched over seeds and clients)."""
    if int(rounds) < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    S, K = data.y.shape[:2]
    params = {k: v.requires_grad_(True) for k, v in initial_params(data, cfg.hidden).items()}
    masks = {k: torch.ones_like(params[k]).requires_grad_(cfg.masks) for k in WEIGHTS}
    trained = list(params.values()) + (list(masks.values()) if cfg.masks else [])
    opt = torch.optim.Adam(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)   # one Adam per client: elementwise
    proxies = [proxy_graph(s, data.x.shape[-1], cfg.n_proxy, cfg.proxy_nodes, cfg.proxy_p) for s in data.seeds]
    proxy_a = torch.stack([p[0] for p in proxies])[:, None]   # [S, 1, blocks, m, m]: the same proxy for every client
    proxy_x = torch.stack([p[1] for p in proxies])[:, None]
    dropout_g = [torch.Generator().manual_seed(int(rng(s, FED_PUB, _DROPOUT).integers(2**62))) for s in data.seeds]
    curve, cos, alpha, cos_first, global_acc = [], None, None, None, None
    for r in range(rounds):
        anchor = None if r == 0 or cfg.aggregation == "none" else {k: v.detach().clone() for k, v in params.items()}
        for _ in range(cfg.local_epochs):
            opt.zero_grad()
            local_loss(cfg, params, masks, anchor, data.a_hat, data.x, data.y, data.train, dropout_g).backward()
            opt.step()
        eval_masks = prune({k: m.detach() for k, m in masks.items()}, cfg.l1) if cfg.masks else None
        curve.append(accuracy(params, eval_masks, data.a_hat, data.x, data.y, data.test))
        if cfg.aggregation == "none":
            continue
        with torch.no_grad():
            if cfg.aggregation == "similarity":
                emb = functional_embedding(params, eval_masks, proxy_a, proxy_x)
                cos, alpha = similarity_weights(emb, cfg.scale)
                cos_first = cos if cos_first is None else cos_first
            else:   # FedAvg: n_j / Σ n, the same row for every client
                sizes = data.train.sum(-1).double()
                alpha = (sizes / sizes.sum(-1, keepdim=True))[:, None, :].expand(S, K, K)
            new = personalised_average({k: v.detach() for k, v in params.items()}, alpha)
            for k, v in params.items():
                v.copy_(new[k])
    if cfg.aggregation == "size":
        global_acc = accuracy(params, None, data.a_hat, data.x, data.y, data.test)
    final = prune({k: m.detach() for k, m in masks.items()}, cfg.l1)
    pruned = sum((m == 0).flatten(2).sum(-1) for m in final.values()).sum(-1)
    total = K * sum(m[0, 0].numel() for m in final.values())
    return SubgraphRun(cfg, curve[-1], torch.stack(curve), global_acc, cos, alpha, cos_first,
                       (pruned / total).float() if cfg.masks else torch.zeros(S),
                       {k: v.detach() for k, v in params.items()}, final if cfg.masks else {})
