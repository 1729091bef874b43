"""HDEE — heterogeneous domain-expert ensembles, as a toy character-level analogue.

Oğuzhan Ersoy, Jari Kolehmainen, Gabriel Passamani Andrade, "HDEE: Heterogeneous Domain Expert Ensemble",
arXiv 2502.19385 (2025), https://arxiv.org/abs/2502.19385 . Official code: https://github.com/gensyn-ai/hdee .

Small domain experts are trained independently (no communication) and ensembled only at inference. HDEE lets the
experts differ by domain: in M_He-I_Ho the experts have different sizes (small / medium / large, larger for harder
domains) and the same number of steps; in M_Ho-I_He they have the same size and more or fewer steps per domain;
M_Ho-I_Ho (same size, same steps) is the homogeneous baseline at the same compute. Taken from the official code
(configs/ and src/hdee/eval_ensemble.py):
- three experts start from "seed" language models (s / m / l, here widths 48 / 64 / 80, mean 64 like the repo's
  intermediate sizes 2304 / 3072 / 3840) and then take one domain each per iteration, for three iterations, each
  continuing from its own previous checkpoint; the homogeneous experts all start from the one m seed;
- a domain phase runs a 600-step cosine schedule with warm-up and keeps the checkpoint at 300 / 400 / 500 steps
  (easy / medium / hard domain) for M_Ho-I_He, 400 for the others;
- three combination rules: `simple_avg` (the mean of the experts' log-probabilities — a geometric mean, not a
  mixture), `uniform_prior` and `cached_prior` (per-token Branch-Train-Merge posterior over experts given the
  sequence so far, with a uniform prior or a prior cached on a domain's dev sequences with decay 0.3).

The toy's "languages" are Markov chains of order 1–3 over 27 symbols (a–z, space) fitted to Shakespeare plays
(`fedlab_nb.data.natural_data`): the order sets how much an expert must learn, and the exact entropy rate gives
each domain's optimal perplexity. Experts are batched next-character MLPs on a 3-character context.

Exact facts (tests, float64): for a mixture p = Σ_e π_e p_e and every e, −log p(y) ≤ −log p_e(y) − log π_e; the
per-token posterior mixture telescopes into the Bayes mixture of whole sequences, so under a uniform prior the
ensemble's sequence loss is within log E of the best expert's.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...core.registry import register

ALPHABET = "abcdefghijklmnopqrstuvwxyz "  # 27 symbols: letters and one space
RULES = ("simple_avg", "uniform_prior", "cached_prior")  # the official eval_ensemble.py's three rules
WIDTHS = {"s": 48, "m": 64, "l": 80}  # mean of s and l = m: the same total parameters as three m experts
STEPS = {"easy": 300, "medium": 400, "hard": 500}  # checkpoints of the repo's 600-step domain schedule


# --- the toy languages: Markov chains fitted to text -------------------------------------------------------
def to_alphabet(text: str) -> np.ndarray:
    """Lower-case letters kept, every other run of characters → one space; codes into ALPHABET."""
    text = re.sub(r"[^a-z]+", " ", text.lower()).strip()
    return np.frombuffer(text.encode(), np.uint8).astype(np.int64) - ord("a")


def _codes(text_codes: np.ndarray) -> np.ndarray:
    return np.where(text_codes < 0, 26, text_codes)  # ' ' - 'a' < 0 → the space symbol 26


@dataclass
class Chain:
    """A Markov chain of `order` over `n_symbols`: probs[state, next], state = the last `order` symbols in base
    n_symbols; `stationary` is its stationary distribution over states."""
    order: int
    n_symbols: int
    probs: np.ndarray
    stationary: np.ndarray


def fit_chain(text: str, order: int, n_symbols: int = len(ALPHABET)) -> Chain:
    """Maximum-likelihood chain of `order` fitted to `text` read cyclically. With cyclic counts the empirical
    state frequencies are exactly stationary (Σ_a N(a w b) = N(w b)), so the entropy rate is exact."""
    if isinstance(order, bool) or not isinstance(order, int) or not 1 <= order <= 4:
        raise ValueError(f"order must be an integer in 1 … 4, got {order!r}")
    c = _codes(to_alphabet(text))
    if len(c) <= order:
        raise ValueError(f"text must hold more than order = {order} symbols, got {len(c)}")
    ext = np.concatenate([c, c[:order]])
    state = np.zeros(len(c), np.int64)
    for i in range(order):
        state = state * n_symbols + ext[i:i + len(c)]
    counts = np.zeros((n_symbols ** order, n_symbols))
    np.add.at(counts, (state, ext[order:order + len(c)]), 1.0)
    rows = counts.sum(1, keepdims=True)
    probs = np.where(rows > 0, counts / np.maximum(rows, 1), 1.0 / n_symbols)  # unseen states are never visited
    return Chain(order, n_symbols, probs, rows[:, 0] / len(c))


def entropy_rate(chain: Chain) -> float:
    """H = −Σ_s π(s) Σ_b P(b|s) log P(b|s), in nats; exp(H) is the best perplexity any model can reach."""
    p = chain.probs
    return float(-(chain.stationary * np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0).sum(1)).sum())


def sample_chain(chain: Chain, n_seqs: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[n_seqs, order + length] symbols: a stationary start state, then `length` transitions (vectorised)."""
    k, S = chain.order, chain.n_symbols
    state = rng.choice(len(chain.stationary), size=n_seqs, p=chain.stationary)
    start = np.stack([(state // S ** (k - 1 - i)) % S for i in range(k)], 1)
    cdf = np.cumsum(chain.probs, 1)
    out = np.empty((n_seqs, length), np.int64)
    for t in range(length):
        nxt = np.minimum((cdf[state] < rng.random(n_seqs)[:, None]).sum(1), S - 1)
        out[:, t] = nxt
        state = (state * S) % S ** k + nxt
    return np.concatenate([start, out], 1)


def chain_log_probs(chain: Chain, seqs: np.ndarray) -> np.ndarray:
    """log P(x_t | previous `order` symbols) under the true chain for every t >= order: [n, length]."""
    k, S = chain.order, chain.n_symbols
    state = np.zeros((len(seqs), seqs.shape[1] - k), np.int64)
    for i in range(k):
        state = state * S + seqs[:, i:seqs.shape[1] - k + i]
    return np.log(chain.probs[state, seqs[:, k:]])


def windows(seqs: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-symbol rows of sequences [n, context + T]: x [n·T, context] (the previous symbols), y [n·T]."""
    n, L = seqs.shape
    idx = np.arange(context, L)
    x = seqs[:, idx[:, None] - context + np.arange(context)]
    return torch.as_tensor(x.reshape(-1, context)), torch.as_tensor(seqs[:, context:].reshape(-1))


# --- batched experts: one padded MLP per expert, width set by a mask ------------------------------------------
def init_experts(widths: Sequence[int], generators: Sequence[torch.Generator], *, context: int = 3,
                 embed: int = 8, vocab: int = len(ALPHABET), max_width: int | None = None) -> dict:
    """M next-symbol MLPs (embed each context symbol → hidden ReLU layer of widths[m] → vocab logits), stored
    padded to `max_width` with a 0/1 unit mask so that all M train in one batched step. Init as torch.nn
    (uniform ±1/√fan_in, embedding N(0, 1)), each expert from its own generator."""
    if len(widths) != len(generators) or not widths:
        raise ValueError(f"widths and generators must be non-empty and of equal length, got {len(widths)} and "
                         f"{len(generators)}")
    H = max_width or max(widths)
    if min(widths) < 1 or max(widths) > H:
        raise ValueError(f"every width must be in 1 … max_width = {H}, got {list(widths)}")
    d_in, parts = context * embed, {k: [] for k in ("emb", "w1", "b1", "w2", "b2", "mask")}
    for w, g in zip(widths, generators):
        u = lambda shape, fan: (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(fan)
        mask = (torch.arange(H) < w).double()
        parts["emb"].append(torch.randn(vocab, embed, generator=g, dtype=torch.float64))
        parts["w1"].append(u((d_in, H), d_in) * mask)
        parts["b1"].append(u((H,), d_in) * mask)
        parts["w2"].append(u((H, vocab), w) * mask[:, None])
        parts["b2"].append(u((vocab,), w))
        parts["mask"].append(mask)
    return {k: torch.stack(v).float() for k, v in parts.items()}


def expert_logits(params: dict, x: torch.Tensor) -> torch.Tensor:
    """Logits [M, B, vocab] for contexts x [M, B, context] (expert m reads x[m])."""
    M, V = params["emb"].shape[:2]
    offset = (torch.arange(M) * V).view(M, 1, 1)
    z = params["emb"].reshape(M * V, -1)[x + offset].flatten(2)
    h = torch.relu(torch.baddbmm(params["b1"][:, None], z, params["w1"])) * params["mask"][:, None]
    return torch.baddbmm(params["b2"][:, None], h, params["w2"])


def cosine_lr(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warm-up then cosine decay to min_lr over `total` steps (the repo's CosineWarmupLR)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    ratio = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)


def train_experts(params: dict, data: Sequence[tuple[torch.Tensor, torch.Tensor]], steps: Sequence[int],
                  generators: Sequence[torch.Generator], *, schedule_steps: int, warmup: int, lr: float,
                  min_lr: float, batch_size: int = 64, betas=(0.9, 0.999), eps: float = 1e-8) -> dict:
    """Adam on all M experts at once: expert m draws its batches from data[m] with generators[m] and stops after
    steps[m] steps of a shared `schedule_steps` cosine schedule (a checkpoint of a longer run, as the repo's
    model_300 / 400 / 500). Returns new params; the experts never exchange anything."""
    M = params["emb"].shape[0]
    if not (len(data) == len(steps) == len(generators) == M):
        raise ValueError(f"data, steps and generators need one entry per expert ({M}), got "
                         f"{len(data)}, {len(steps)}, {len(generators)}")
    if max(steps) > schedule_steps:
        raise ValueError(f"steps must not exceed schedule_steps = {schedule_steps}, got max {max(steps)}")
    names = ("emb", "w1", "b1", "w2", "b2")
    p = {k: params[k].clone().requires_grad_(k in names) for k in params}
    m1 = {k: torch.zeros_like(p[k]) for k in names}
    m2 = {k: torch.zeros_like(p[k]) for k in names}
    sizes = torch.tensor([len(y) for _, y in data])
    offsets = torch.cumsum(sizes, 0) - sizes
    X, Y = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    stop = torch.tensor(list(steps))
    for t in range(int(stop.max())):
        u = torch.stack([torch.rand(batch_size, generator=g) for g in generators])
        idx = offsets[:, None] + (u * sizes[:, None]).long()
        logits = expert_logits(p, X[idx])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), Y[idx].reshape(-1), reduction="sum") / batch_size
        grads = torch.autograd.grad(loss, [p[k] for k in names])
        rate = cosine_lr(t, schedule_steps, warmup, lr, min_lr)
        active = (t < stop).float()
        with torch.no_grad():
            for k, g in zip(names, grads):
                on = active.view(-1, *[1] * (g.dim() - 1))
                m1[k] += on * (1 - betas[0]) * (g - m1[k])
                m2[k] += on * (1 - betas[1]) * (g * g - m2[k])
                step = (m1[k] / (1 - betas[0] ** (t + 1))) / ((m2[k] / (1 - betas[1] ** (t + 1))).sqrt() + eps)
                p[k] -= on * rate * step
    return {k: v.detach() for k, v in p.items()}


def select(params: dict, rows: Sequence[int]) -> dict:
    """The experts at `rows` (copies), e.g. to branch experts from seed models."""
    index = torch.as_tensor(list(rows))
    return {k: v[index].clone() for k, v in params.items()}


def stack(*groups: dict) -> dict:
    return {k: torch.cat([g[k] for g in groups]) for k in groups[0]}


@torch.no_grad()
def token_log_probs(params: dict, experts: Sequence[int], seqs: np.ndarray, context: int = 3) -> torch.Tensor:
    """log p_e(x_t | context) of the observed symbols for each expert e in `experts`: float64 [E, n, T]."""
    x, y = windows(seqs, context)
    sub = select(params, experts)
    logp = torch.log_softmax(expert_logits(sub, x.expand(len(experts), *x.shape)).double(), -1)
    return logp.gather(2, y.expand(len(experts), -1)[..., None])[..., 0].view(len(experts), len(seqs), -1)


# --- combining the experts' outputs (the official eval_ensemble.py's three rules) ---------------------------
def posterior(logp: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """Per-token posterior over experts given the sequence so far: w_e(t) ∝ π_e Π_{s<t} p_e(x_s), [E, n, T]."""
    before = torch.cumsum(torch.cat([torch.zeros_like(logp[..., :1]), logp[..., :-1]], -1), -1)
    return torch.softmax(before + log_prior.view(-1, 1, 1), 0)


def cached_log_prior(logp_dev: torch.Tensor, max_sequences: int = 100, decay: float = 0.3) -> torch.Tensor:
    """The repo's cached prior (after Branch-Train-Merge): run over dev sequences; each one's posterior given its
    whole likelihood and the current prior is added to the prior, whose old mass decays by decay^(n+1).
    Returns log π, normalised. logp_dev: [E, n, T]."""
    if not 0 <= decay < 1:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    log_prior = torch.zeros(logp_dev.shape[0], dtype=logp_dev.dtype)
    for n, seq_ll in enumerate(logp_dev.sum(-1).unbind(1)[:max_sequences]):
        log_post = torch.log_softmax(seq_ll + log_prior, 0)
        log_prior = torch.logaddexp(math.log(decay ** (n + 1)) + log_prior, log_post)
    return torch.log_softmax(log_prior, 0)


@register("hdee", claims="hdee", kind="module")
def ensemble_log_probs(logp: torch.Tensor, rule: str, log_prior: torch.Tensor | None = None) -> torch.Tensor:
    """The ensemble's log-probability of each observed token, [n, T], from the experts' [E, n, T]:
    simple_avg → mean_e log p_e (a geometric mean, unnormalised, as in the repo); uniform_prior / cached_prior →
    log Σ_e w_e(t) p_e(x_t) with the posterior w of `posterior` under a uniform or the given (cached) prior."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    if rule == "simple_avg":
        return logp.mean(0)
    if rule == "uniform_prior":
        log_prior = torch.full((logp.shape[0],), -math.log(logp.shape[0]), dtype=logp.dtype)
    elif log_prior is None:
        raise ValueError("rule='cached_prior' needs log_prior (use cached_log_prior on the domain's dev sequences)")
    return torch.logsumexp(torch.log(posterior(logp, log_prior)) + logp, 0)


def perplexity(token_logp: torch.Tensor) -> float:
    return float(torch.exp(-token_logp.mean()))


def mixture_bound_violation(logp: torch.Tensor, weights: torch.Tensor) -> float:
    """max over tokens and experts of [−log Σ π p] − [−log p_e − log π_e]; ≤ 0 by the mixture bound.
    logp [E, N] (log p_e(y) per token), weights [E] (a probability vector) or [E, N] (per token)."""
    w = weights if weights.dim() == 2 else weights[:, None].expand_as(logp)
    mix = -torch.logsumexp(torch.log(w) + logp, 0)
    return float((mix[None] - (-logp - torch.log(w))).max())


# --- the toy experiment: domains, seed models, three iterations of domain training ----------------------------
TIERS = ("hard", "medium", "easy")  # one domain of each per iteration
ORDER_OF_TIER = {"hard": 3, "medium": 2, "easy": 1}  # the toy's a-priori difficulty: the chain's order
SIZE_OF_TIER = {"hard": "l", "medium": "m", "easy": "s"}  # the repo: large expert on math / physics / cs


@dataclass
class ToyDomains:
    """Training domains train[i][tier] (iteration i), held-out domains, their chains and entropy rates,
    and the natural-text corpus for the seed models."""
    names: list
    chains: dict
    entropy: dict
    plan: list  # plan[i] = {tier: domain name} for iteration i
    held_out: list
    corpus: np.ndarray  # [n, 3 + T] natural-text windows for the seed models


def toy_domains(texts: dict, iterations: int = 3, held_out_orders: Sequence[int] = (1, 2, 3),
                seed_texts: Sequence[str] = ()) -> ToyDomains:
    """Fit one chain per play: iteration i trains one hard (order 3), medium (2) and easy (1) domain, in the
    sorted order of `texts` ({play: text}); the next plays give held-out chains of `held_out_orders`, and a
    sequence-level mixture of the training chains is one more held-out domain. `seed_texts` (other plays) are
    the seed models' natural corpus."""
    plays = sorted(texts)
    need = iterations * len(TIERS) + len(held_out_orders)
    if len(plays) < need:
        raise ValueError(f"texts must hold at least {need} plays ({iterations} iterations × 3 + held-out), got {len(plays)}")
    chains, plan, k = {}, [], 0
    for i in range(iterations):
        plan.append({})
        for tier in TIERS:
            name = f"{plays[k]}/o{ORDER_OF_TIER[tier]}"
            chains[name], plan[i][tier], k = fit_chain(texts[plays[k]], ORDER_OF_TIER[tier]), name, k + 1
    held = []
    for order in held_out_orders:
        name = f"{plays[k]}/o{order}"
        chains[name], k = fit_chain(texts[plays[k]], order), k + 1
        held.append(name)
    held.append("mixture")
    entropy = {n: entropy_rate(c) for n, c in chains.items()}
    train_names = [plan[i][t] for i in range(iterations) for t in TIERS]
    entropy["mixture"] = float(np.mean([entropy[n] for n in train_names]))  # ≈ the optimum for long sequences
    codes = _codes(to_alphabet(" ".join(seed_texts))) if seed_texts else np.zeros(0, np.int64)
    L = 3 + 256
    corpus = codes[: len(codes) // L * L].reshape(-1, L)
    return ToyDomains(train_names + held, chains, entropy, plan, held, corpus)


def sample_domain(dom: ToyDomains, name: str, n_seqs: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[n_seqs, 3 + length] sequences of one domain (3 context symbols, then `length` scored ones); 'mixture'
    draws each sequence from a random training chain."""
    if name != "mixture":
        return sample_chain(dom.chains[name], n_seqs, length + 3 - dom.chains[name].order, rng)
    train = [n for n in dom.names if n not in dom.held_out]
    pick = rng.integers(len(train), size=n_seqs)
    out = np.empty((n_seqs, 3 + length), np.int64)
    for j, n in enumerate(train):
        rows = np.flatnonzero(pick == j)
        if len(rows):
            s = sample_chain(dom.chains[n], len(rows), length + 3 - dom.chains[n].order, rng)
            out[rows] = s
    return out


ENSEMBLES = ("M_He-I_Ho", "M_Ho-I_He", "M_Ho-I_Ho")


def expert_plan(ensemble: str) -> list[tuple[str, int]]:
    """(seed-model size, steps per iteration) for the hard, medium and easy expert of an ensemble."""
    if ensemble not in ENSEMBLES + ("dense",):
        raise ValueError(f"ensemble must be one of {', '.join(ENSEMBLES)} or 'dense', got {ensemble!r}")
    if ensemble == "M_He-I_Ho":
        return [(SIZE_OF_TIER[t], STEPS["medium"]) for t in TIERS]
    if ensemble == "M_Ho-I_He":
        return [("m", STEPS[t]) for t in TIERS]
    if ensemble == "dense":
        return [("dense", STEPS["medium"])]
    return [("m", STEPS["medium"])] * len(TIERS)


def train_ensembles(dom: ToyDomains, seeds: Sequence[int], *, n_train_seqs: int = 64, length: int = 512,
                    seed_steps: int = 1000, seed_lr: float = 1e-2, domain_lr: float = 3e-3, schedule_steps: int = 600,
                    warmup: int = 50, batch_size: int = 64, dense_width: int = 3 * WIDTHS["m"]) -> dict:
    """Train, for every seed, the three ensembles of `ENSEMBLES` and a dense model of `dense_width` at the same
    compute (one model, the iteration's three domains pooled, `STEPS['medium']` steps per iteration), all batched.
    Seed models: s / m / l / dense trained `seed_steps` on the natural corpus (cosine, 5 % warm-up, lr/10 at the
    end); every homogeneous expert starts from the one m seed, as in the repo. Returns {'experts': params,
    'dense': params, 'index': {(seed, ensemble): rows}}."""
    if schedule_steps < max(STEPS.values()):
        raise ValueError(f"schedule_steps must be >= {max(STEPS.values())} (the longest checkpoint), got {schedule_steps}")
    sizes = ["s", "m", "l"]
    gen = lambda s, tag, i: torch.Generator().manual_seed(int(s) * 100_003 + tag * 1_009 + i)  # keyed by the seed
    xs, ys = windows(dom.corpus, 3)
    # seed models: per seed s, m, l (batched, padded to l's width) and one dense model
    g_small = [gen(s, 1, i) for s in seeds for i in range(3)]
    seed_small = init_experts([WIDTHS[z] for _ in seeds for z in sizes], g_small, max_width=WIDTHS["l"])
    seed_small = train_experts(seed_small, [(xs, ys)] * len(g_small), [seed_steps] * len(g_small), g_small,
                               schedule_steps=seed_steps, warmup=max(1, seed_steps // 20), lr=seed_lr,
                               min_lr=seed_lr / 10, batch_size=batch_size)
    g_dense = [gen(s, 2, 0) for s in seeds]
    seed_dense = train_experts(init_experts([dense_width] * len(seeds), g_dense), [(xs, ys)] * len(seeds),
                               [seed_steps] * len(seeds), g_dense, schedule_steps=seed_steps,
                               warmup=max(1, seed_steps // 20), lr=seed_lr, min_lr=seed_lr / 10, batch_size=batch_size)
    # branch the experts
    rows, steps, tiers, index = [], [], [], {}
    for j, s in enumerate(seeds):
        for ens in ENSEMBLES:
            index[(s, ens)] = list(range(len(rows), len(rows) + len(TIERS)))
            for tier, (size, n_steps) in zip(TIERS, expert_plan(ens)):
                rows.append(3 * j + sizes.index(size)), steps.append(n_steps), tiers.append(tier)
    experts = select(seed_small, rows)
    g_exp = [gen(s, 3, i) for s in seeds for i in range(len(rows) // len(seeds))]
    g_den = [gen(s, 4, 0) for s in seeds]
    rng = {s: np.random.default_rng([int(s), 11]) for s in seeds}
    dense = seed_dense
    for it in range(len(dom.plan)):
        data = {s: {t: windows(sample_domain(dom, dom.plan[it][t], n_train_seqs, length, rng[s]), 3) for t in TIERS}
                for s in seeds}
        per_row = [data[s][t] for s in seeds for t in tiers[: len(rows) // len(seeds)]]
        experts = train_experts(experts, per_row, steps, g_exp, schedule_steps=schedule_steps, warmup=warmup,
                                lr=domain_lr, min_lr=domain_lr / 2, batch_size=batch_size)
        pooled = [tuple(torch.cat([data[s][t][k] for t in TIERS]) for k in (0, 1)) for s in seeds]
        dense = train_experts(dense, pooled, [STEPS["medium"]] * len(seeds), g_den, schedule_steps=schedule_steps,
                              warmup=warmup, lr=domain_lr, min_lr=domain_lr / 2, batch_size=batch_size)
    return {"experts": experts, "dense": dense, "index": index, "seeds": list(seeds)}


def evaluate_ensembles(dom: ToyDomains, trained: dict, *, n_test_seqs: int = 32, n_dev_seqs: int = 32,
                       test_length: int = 256):
    """Per seed × domain × ensemble × rule perplexity (pandas DataFrame, long form), plus the dense model, the
    best single expert of each ensemble and the domain's optimum exp(H). Test and dev sequences are fresh
    samples keyed by the seed; the cached prior is fitted on the dev sequences (the repo reuses the evaluation
    loader for it)."""
    import pandas as pd
    out = []
    for j, s in enumerate(trained["seeds"]):
        rng = np.random.default_rng([int(s), 12])
        for name in dom.names:
            test = sample_domain(dom, name, n_test_seqs, test_length, rng)
            dev = sample_domain(dom, name, n_dev_seqs, test_length, rng)
            base = dict(seed=s, domain=name, held_out=name in dom.held_out, optimum=math.exp(dom.entropy[name]))
            dense = token_log_probs(trained["dense"], [j], test)[0]
            out.append({**base, "ensemble": "dense", "rule": "single", "ppl": perplexity(dense)})
            for ens in ENSEMBLES:
                rows = trained["index"][(s, ens)]
                lp, lp_dev = token_log_probs(trained["experts"], rows, test), token_log_probs(trained["experts"], rows, dev)
                prior = cached_log_prior(lp_dev)
                for rule in RULES:
                    ppl = perplexity(ensemble_log_probs(lp, rule, prior))
                    out.append({**base, "ensemble": ens, "rule": rule, "ppl": ppl})
                out.append({**base, "ensemble": ens, "rule": "best expert",
                            "ppl": min(perplexity(lp[e]) for e in range(len(rows)))})
    return pd.DataFrame(out)
