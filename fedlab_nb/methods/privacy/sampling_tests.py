"""Is a DP rule's sampler random? Two exact tests on the clients it aggregates, round after round.

Under either sampling the accountant assumes — Poisson at rate q, or a uniform m = qK of the K clients — with
rounds drawn independently, one client's participation over the rounds is i.i.d. Bernoulli(q), and two clients
are in a round together with probability p₂ = q² (Poisson) or m(m−1)/(K(K−1)) (fixed). Each test's probability
under a fair sampler is exact whatever the other clients do, and a union bound over the clients, pairs and
checks keeps a fair sampler's refusal below 1e-9 per check (a subset of the sample dropped as stragglers or
non-finite only makes either test less likely to fire):

* too regular — a client whose count c(t) stays within w of q·t for every t ≤ n. A round-robin or a shuffled
  cycle keeps w < 2; a fair client's count wanders about √(n q (1 − q)). P(every |c(t) − q t| ≤ w) is a
  dynamic program over the counts the band allows at each t (`stays_within`), run twice per doubling of n.
* too even — every client in at least a of the n rounds, where a fair client is in Binomial(n, q): the counts
  are independent (Poisson) or negatively associated (a uniform m of K, Joag-Dev & Proschan 1983), so
  P(all ≥ a) ≤ P(Binomial(n, q) ≥ a)^K; a cycle through the clients gives every one its share within a round.
* kept for another round — a client in both rounds of more of the disjoint round pairs (1, 2), (3, 4), … (or
  (2, 3), (4, 5), …) than Binomial(pairs, q²) allows: a sample reused for a second round (a cached draw, a
  generator seeded by r // 2) counts as two compositions in the accountant but amplifies like one.
* rested after a round — one client, or all together, in both rounds of fewer disjoint round pairs (t, t + ℓ),
  ℓ = 1 … 8, than independent rounds give (whole draws only: a drop looks the same): a cool-down or clients taking
  turns draw a client at more than q in the rounds it can be drawn in.
* together too often — two clients in more rounds together than Binomial(n, p₂) allows (clients drawn in
  groups, which the amplification by sampling does not cover); counted over up to 512 clients (a fixed random
  subset when K is larger, so a pairing of every client is met by some pair in it).

No finite test catches every sampler built to evade it: the declaration (`sampling`, `sampling_rate`) is the
contract, and these tests are the net under it."""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.stats import binom

PAIR_CLIENTS = 512      # the pair counts are a PAIR_CLIENTS² table in the rule's state (1 MiB)
REFUSE_BELOW = 1e-9     # a fair sampler is refused at most once in 10⁹ checks
LAGS = 8                # a client rested 1 … LAGS rounds after it took part is looked for


def init_state(num_clients: int) -> dict:
    """The counts the tests keep: each client's largest |c(t) − q t| so far, and the pair table."""
    chosen = pair_clients(num_clients)
    return {"walk_dev": torch.zeros(num_clients, dtype=torch.float64), "pair_ids": chosen,
            "pairs": torch.zeros(len(chosen), len(chosen), dtype=torch.int32), "pair_rounds": 0,
            "repeats": torch.zeros(2, num_clients, dtype=torch.int64),   # in both rounds of a pair, per alignment
            "recent": torch.zeros(LAGS, num_clients, dtype=torch.bool),  # who was in each of the last rounds
            "lag_both": torch.zeros(LAGS, num_clients, dtype=torch.int64)}  # in both rounds of a lag-ℓ pair


def check_state(tests, num_clients: int) -> None:
    """Refuse a tests state of the wrong layout (an altered checkpoint) before any of it is indexed."""
    ids = tests.get("pair_ids") if isinstance(tests, dict) else None
    ok = (isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1
          and torch.equal(ids, pair_clients(num_clients))
          and _tensor_like(tests.get("walk_dev"), (num_clients,), torch.float64)
          and _tensor_like(tests.get("pairs"), (len(ids), len(ids)), torch.int32)
          and type(tests.get("pair_rounds")) is int and tests["pair_rounds"] >= 0
          and _tensor_like(tests.get("repeats"), (2, num_clients), torch.int64)
          and _tensor_like(tests.get("recent"), (LAGS, num_clients), torch.bool)
          and _tensor_like(tests.get("lag_both"), (LAGS, num_clients), torch.int64))
    if not ok:
        raise ValueError("the DP rule's sampling-test state (seen_tests) does not fit this run's clients: the "
                         "checkpoint was altered or written by another version; delete it or pass resume=False")


def _tensor_like(value, shape: tuple, dtype) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == shape and value.dtype == dtype


def pair_clients(num_clients: int) -> torch.Tensor:
    """The clients whose pairs are counted: all of them, or a subset fixed by K (the same after a resume)."""
    if num_clients <= PAIR_CLIENTS:
        return torch.arange(num_clients)
    chosen = np.random.default_rng(num_clients).choice(num_clients, PAIR_CLIENTS, replace=False)
    return torch.as_tensor(np.sort(chosen))


def observe(state: dict, ids: torch.Tensor, counts: torch.Tensor, rounds: int, q: float) -> None:
    """Add one round: `ids` the round's clients (distinct; the whole draw when the engine passes it), `counts`
    every client's rounds so far."""
    state["walk_dev"] = torch.maximum(state["walk_dev"], (counts.double() - q * rounds).abs())
    chosen = state["pair_ids"]
    at = torch.searchsorted(chosen, ids).clamp(max=len(chosen) - 1)
    at = at[chosen[at] == ids]
    state["pairs"][at[:, None], at[None, :]] += 1
    state["pair_rounds"] += 1
    now = torch.zeros(len(counts), dtype=torch.bool)
    now[ids] = True
    if rounds >= 2:  # rounds (rounds − 1, rounds) are a pair of alignment rounds % 2
        state["repeats"] = state["repeats"].clone()
        state["repeats"][rounds % 2] += (now & state["recent"][0]).long()
    state["lag_both"] = state["lag_both"].clone()
    for lag in range(1, LAGS + 1):  # blocks of 2ℓ rounds pair each of their first ℓ rounds with the one ℓ later
        if (rounds - 1) % (2 * lag) >= lag:
            state["lag_both"][lag - 1] += (now & state["recent"][lag - 1]).long()
    state["recent"] = torch.cat([now[None], state["recent"][:-1]])


def refusal(state: dict, counts: torch.Tensor, rounds: int, q: float, p2: float) -> str | None:
    """Why the sampler is not random (a sentence), or None; p2: two clients' chance of a round together."""
    if q >= 1:
        return None
    return (_too_even(counts, rounds, q) or _too_regular(state["walk_dev"], rounds, q)
            or _kept_for_another_round(state["repeats"], rounds, q) or _too_often_together(state, p2))


def refusal_of_draws(state: dict, rounds: int, num_clients: int, q: float, p2: float, sizes=None) -> str | None:
    """The tests that need the sampler's whole draws (no straggler or dropped update left out): two clients
    together too rarely, and, under Poisson sampling (`sizes`: the smallest and largest draw), draws whose
    sizes stay too narrow (never more than one client, never an empty round)."""
    if q >= 1:
        return None
    return (_too_rarely_together(state, p2) or _rested_after_a_round(state, rounds, num_clients, q, sizes is not None)
            or (sizes and _sizes_too_narrow(*sizes, rounds, num_clients, q)))


def _lag_pairs(lag: int, n: int) -> int:
    """How many disjoint (t, t + ℓ) round pairs the first n rounds complete: ℓ per block of 2ℓ rounds."""
    return lag * (n // (2 * lag)) + max(0, n % (2 * lag) - lag)


def _rested_after_a_round(state: dict, n: int, K: int, q: float, poisson: bool) -> str | None:
    """Too few clients in both rounds of the disjoint round pairs (t, t + ℓ), ℓ = 1 … LAGS: a sampler that rests a
    client ℓ rounds after it takes part (a cool-down, clients taking turns) draws it at more than q in the rounds it
    can be drawn in. Per client, each pair holds it twice with probability p₁² (p₁ = q, or m/K for a fixed size m),
    independently: Binomial(P, p₁²), exact. Over all clients the count is Binomial(KP, q²) under Poisson sampling,
    and under a fixed size a sum of P hypergeometric overlaps, below the Chernoff bound of Binomial(Pm, m/K)
    (Hoeffding 1963, Theorem 4). Checked at n = 8, 12, 16, 24, … (`_checked`), with a union bound over the K + 1
    counts, the lags and those checks."""
    if not _checked(n):
        return None
    m = round(q * K)
    p1 = q if poisson else m / K
    checks = (K + 1) * LAGS * 2 * math.log2(n)  # ≤ 2 log₂ n checks so far
    for lag in range(1, LAGS + 1):
        pairs, both = _lag_pairs(lag, n), state["lag_both"][lag - 1]
        if pairs < 1 or not 0 < p1 < 1:
            continue
        client = int(both.argmin())
        fewest, total = int(both[client]), int(both.sum())
        trials, p = (K * pairs, q * q) if poisson else (pairs * m, m / K)
        every = 1.0 if total >= trials * p else float(binom.cdf(total, trials, p)) if poisson else \
            _chernoff_below(total, trials, p)
        one = float(binom.cdf(fewest, pairs, p1 * p1)) if fewest < pairs * p1 * p1 else 1.0
        if min(every, one) * checks >= REFUSE_BELOW:
            continue
        whose = (f"client {client} was in both rounds of only {fewest} of the {pairs} round pairs {lag} apart, where "
                 f"independent rounds give about {pairs * p1 * p1:.1f}" if one <= every else
                 f"the clients were in both rounds of a pair {lag} apart only {total} times over {pairs} pairs, where "
                 f"independent rounds give about {trials * p:.1f}")
        return (f"{whose}: the sampler rests a client {lag} round{'s' if lag > 1 else ''} after it takes part (a "
                "cool-down, clients taking turns), so it draws it at more than q when it can be drawn, and the "
                "reported ε, which counts independent rounds at rate q, would not hold")
    return None


def _chernoff_below(x: int, trials: int, p: float) -> float:
    """exp(−N·KL(x/N ‖ p)) ≥ P(Binomial(N, p) ≤ x) for x < Np, and for any sum the binomial dominates in convex
    order (a sum of independent hypergeometric overlaps)."""
    a = x / trials
    if a >= p:
        return 1.0
    return math.exp(-trials * ((a * math.log(a / p) if a > 0 else 0.0) + (1 - a) * math.log((1 - a) / (1 - p))))


def _too_rarely_together(state: dict, p2: float) -> str | None:
    found = _extreme_pair(state, p2, fewest=True)
    if found is None:
        return None
    a, b, together, n = found
    return (f"clients {a} and {b} were drawn together in {together} of {n} rounds where random sampling puts them "
            f"together in about {n * p2:.1f}: the sampler keeps them apart, so one client's absence reveals another's "
            "presence and the amplification by sampling the reported ε counts on does not hold")


def _extreme_pair(state: dict, p2: float, fewest: bool):
    """(client a, client b, rounds together, rounds) of the pair together most (or fewest) often, when a fair
    sampler gives a count that far out with probability below REFUSE_BELOW over all pairs and rounds; else None."""
    pairs, n = state["pairs"], state["pair_rounds"]
    if len(pairs) < 2 or not 0 < p2 < 1:
        return None
    off = ~torch.ones_like(pairs, dtype=torch.bool).triu(1)  # the pairs i < j only
    counts = pairs.long().masked_fill(off, 2**62 if fewest else -1)
    i, j = divmod(int(counts.argmin() if fewest else counts.argmax()), len(pairs))
    together = int(counts[i, j])
    if (together >= n * p2) if fewest else (together <= n * p2):
        return None
    tail = binom.cdf(together, n, p2) if fewest else binom.sf(together - 1, n, p2)
    if float(tail) * len(pairs) * (len(pairs) - 1) / 2 * n >= REFUSE_BELOW:
        return None
    return int(state["pair_ids"][i]), int(state["pair_ids"][j]), together, n


def _sizes_too_narrow(smallest: int, largest: int, n: int, K: int, q: float) -> str | None:
    """Poisson draws are Binomial(K, q) sizes: all n of them ≤ largest with probability F(largest)^n."""
    never_more = n * float(binom.logcdf(largest, K, q))
    never_fewer = n * float(binom.logsf(smallest - 1, K, q)) if smallest > 0 else 0.0
    log_p = min(never_more, never_fewer) + math.log(2 * n)
    if log_p >= math.log(REFUSE_BELOW):
        return None
    return (f"the sampler drew between {smallest} and {largest} clients in each of {n} rounds, a spread this "
            f"narrow Poisson sampling (K={K}, q={q:g}) gives with probability below {math.exp(log_p):.1e}: it caps "
            "or pads the draws (at most one client, a redraw of an empty round), which the accountant's Poisson "
            "amplification does not cover")


def _kept_for_another_round(repeats: torch.Tensor, n: int, q: float) -> str | None:
    flat = int(repeats.argmax())
    alignment, client = divmod(flat, repeats.shape[1])
    both, pairs = int(repeats[alignment, client]), (n - alignment) // 2  # alignment 0: (1, 2), (3, 4), …
    if pairs < 1 or both <= pairs * q * q:
        return None
    p = float(binom.sf(both - 1, pairs, q * q)) * repeats.numel() * n
    if p >= REFUSE_BELOW:
        return None
    first = 1 + alignment
    return (f"client {client} was in both rounds of {both} of the {pairs} round pairs ({first}, {first + 1}), "
            f"({first + 2}, {first + 3}), … where independent rounds give about {pairs * q * q:.1f}: the sampler "
            "keeps a sample for another round, so the rounds are not the independent draws the reported ε counts")


def _too_even(counts: torch.Tensor, n: int, q: float) -> str | None:
    least = int(counts.min())
    if least < 1:
        return None
    log_p = len(counts) * float(binom.logsf(least - 1, n, q)) + math.log(n)  # ≤ n checks so far
    if log_p >= math.log(REFUSE_BELOW):
        return None
    return (f"every one of the {len(counts)} clients was aggregated in at least {least} of {n} rounds (a client "
            f"sampled at random averages {n * q:.1f}), which random sampling gives with probability below "
            f"{math.exp(log_p):.1e}: the sampler cycles through the clients, which gets none of the amplification by "
            "sampling the reported ε counts on")


def _too_regular(walk_dev: torch.Tensor, n: int, q: float) -> str | None:
    if not _checked(n):
        return None
    client = int(walk_dev.argmin())
    w = float(walk_dev[client])
    if w >= 0.35 * math.sqrt(n * q * (1 - q)) + 1:  # a band this wide is kept with probability ≳ 1e-6
        return None
    p = stays_within(n, q, w) * len(walk_dev) * 2 * math.log2(n)  # ≤ 2 log₂ n checks so far
    if p >= REFUSE_BELOW:
        return None
    return (f"client {client}'s count stayed within {w:.2f} of q·t = {q:g}·t for all {n} rounds, which a client "
            f"sampled at random does with probability below {p:.1e}: the sampler follows a schedule (a round-robin "
            "or a cycle), which gets none of the amplification by sampling the reported ε counts on")


def _checked(n: int) -> bool:
    """Check the walk at n = 8, 12, 16, 24, 32, 48, … (2^k and 3·2^(k−1)): its dynamic program costs n steps."""
    odd = n >> (n & -n).bit_length() - 1  # n without its factors of two
    return n >= 8 and odd in (1, 3)


def _too_often_together(state: dict, p2: float) -> str | None:
    found = _extreme_pair(state, p2, fewest=False)
    if found is None:
        return None
    a, b, together, n = found
    return (f"clients {a} and {b} were aggregated together in {together} of {n} rounds where random sampling puts "
            f"them together in about {n * p2:.1f}: the sampler draws clients in groups, so one client's presence "
            "reveals another's and the amplification by sampling the reported ε counts on does not hold")


def stays_within(n: int, q: float, w: float) -> float:
    """P(|c(t) − q t| ≤ w for t = 1..n) for c(t) the number of successes in t Bernoulli(q) trials."""
    w = w + 1e-9  # the observed walk itself is inside the band
    low, p, log_mass = 0, np.ones(1), 0.0  # p[i] ∝ P(c(t) = low + i and inside so far)
    for t in range(1, n + 1):
        step = np.zeros(len(p) + 1)
        step[:-1] += p * (1 - q)
        step[1:] += p * q
        a = max(math.ceil(q * t - w), low) - low
        b = min(math.floor(q * t + w), low + len(p)) - low
        if a > b:
            return 0.0
        p, low = step[a:b + 1], low + a
        mass = p.sum()
        if mass <= 0:
            return 0.0
        log_mass, p = log_mass + math.log(mass), p / mass
    return math.exp(log_mass)
