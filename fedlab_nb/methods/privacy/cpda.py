"""CPDA — cluster-based private data aggregation: He, Liu, Nguyen, Nahrstedt, Abdelzaher, "PDA:
Privacy-Preserving Data Aggregation in Wireless Sensor Networks", IEEE INFOCOM 2007. Its weaknesses are the
subject of J. Sen, "Secure and Privacy-Preserving Data Aggregation Protocols for Wireless Sensor Networks",
CISP 2012 (arXiv; https://core.ac.uk/works/2391516), whose specific attack and fix are NOT implemented here
(their text was not available to us).

A cluster of m ≥ 3 nodes with public, distinct, non-zero seeds x_1..x_m (one per node) sums its readings d_i
without any node — the leader included — seeing another's reading. All arithmetic is in the prime field
Z_p, p = 2³¹ − 1 (exact; no floating-point Vandermonde):

    node i   draws r_i1..r_i,m−1, forms P_i(x) = d_i + r_i1 x + … + r_i,m−1 x^{m−1}
             and sends v_i^j = P_i(x_j) to every other member j (encrypted with their pairwise key)
    node j   assembles F_j = Σ_i v_i^j = D + R_1 x_j + … + R_{m−1} x_j^{m−1}   (D = Σ d_i, R_k = Σ_i r_ik)
             and sends F_j to the leader
    leader   solves the m×m Vandermonde system V (D, R_1, …)ᵀ = F for D, i.e. D = Σ_j λ_j F_j with λ = the
             first row of V⁻¹ (the Lagrange weights at 0).

For m = 3 this is the paper's worked example (v_i^j = d_i + r_i1 x_j + r_i2 x_j²). Readings may be vectors
(every coordinate shares independently), which is how the FL bridge masks model updates: `CPDARule` runs the
protocol among a round's clients on their quantised, weight-scaled updates and returns the decoded sum.

Message counts are taken from the message lists the functions below produce; `pairwise_masking_messages`
lists the messages of Bonawitz et al. (CCS 2017) secure aggregation, semi-honest variant, without dropouts
(AdvertiseKeys, ShareKeys, MaskedInputCollection, Unmasking), for the same m. WSN energy is not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...core.registry import register

P = 2**31 - 1                 # the Mersenne prime 2^31 − 1: a product of two residues fits in int64
FIELD_BYTES = 4               # one element of Z_p on the wire


# --- field helpers ---------------------------------------------------------------------------------
def _as_field(values) -> np.ndarray:
    a = np.asarray(values)
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"readings must be integers (quantise floats first with quantise()), got dtype {a.dtype}")
    return np.mod(a.astype(np.int64), P)


def encode(values) -> np.ndarray:
    """Signed integers → residues mod p (−1 ↦ p − 1)."""
    return _as_field(values)


def decode(residues) -> np.ndarray:
    """Residues mod p → signed integers in (−p/2, p/2]."""
    r = np.mod(np.asarray(residues, dtype=np.int64), P)
    return np.where(r > P // 2, r - P, r)


def quantise(x, frac_bits: int = 16) -> np.ndarray:
    """Fixed point: round(x · 2^frac_bits) as int64 (the sum must stay inside ±p/2 to decode)."""
    if not (isinstance(frac_bits, int) and 0 <= frac_bits <= 24):
        raise ValueError(f"frac_bits must be an int in [0, 24], got {frac_bits!r}")
    return np.rint(np.asarray(x, dtype=np.float64) * 2.0**frac_bits).astype(np.int64)


def dequantise(q, frac_bits: int = 16) -> np.ndarray:
    return np.asarray(q, dtype=np.float64) / 2.0**frac_bits


def inverse(a: int) -> int:
    a = int(a) % P
    if a == 0:
        raise ValueError("0 has no inverse mod p")
    return pow(a, P - 2, P)


def public_seeds(m: int, rng: np.random.Generator) -> np.ndarray:
    """m distinct non-zero field elements (the nodes' public seeds x_j)."""
    _check_cluster_size(m)
    while True:                                    # redraw on a (rare, ~m²/2p) collision
        s = rng.integers(1, P, size=m, dtype=np.int64)
        if len(set(s.tolist())) == m:
            return s


def _check_cluster_size(m: int) -> None:
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 3:
        raise ValueError(f"a CPDA cluster needs m >= 3 nodes (with two, each learns the other's reading "
                         f"from the sum), got m={m!r}")


def _check_seeds(seeds) -> np.ndarray:
    s = np.mod(np.asarray(seeds, dtype=np.int64), P)
    _check_cluster_size(len(s))
    if np.any(s == 0) or len(set(s.tolist())) != len(s):
        raise ValueError("seeds must be distinct and non-zero mod p (a repeated or zero seed makes the "
                         "Vandermonde system singular or reveals P_i(0) = d_i)")
    return s


def poly_eval(coeffs: np.ndarray, x: int) -> np.ndarray:
    """Σ_k coeffs[k] x^k mod p (Horner), coeffs [deg+1, ...] with coeffs[0] the constant term."""
    x = int(x) % P
    acc = np.zeros(coeffs.shape[1:], dtype=np.int64)
    for c in coeffs[::-1]:
        acc = (acc * x + c) % P
    return acc


def vandermonde(seeds) -> list[list[int]]:
    s = _check_seeds(seeds)
    return [[pow(int(x), k, P) for k in range(len(s))] for x in s]


def lagrange_weights_at_zero(seeds) -> np.ndarray:
    """λ = the first row of V⁻¹ (mod p), via sympy's exact modular inverse of the Vandermonde matrix."""
    from sympy import Matrix
    inv = Matrix(vandermonde(seeds)).inv_mod(P)
    return np.array([int(inv[0, j]) for j in range(inv.cols)], dtype=np.int64)


def combine(weights: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Σ_j weights_j · rows_j mod p without int64 overflow (reduce after every product)."""
    acc = np.zeros(rows.shape[1:], dtype=np.int64)
    for w, row in zip(weights, rows):
        acc = (acc + (int(w) * row) % P) % P
    return acc


# --- the protocol ----------------------------------------------------------------------------------
@dataclass
class Message:
    sender: object
    receiver: object
    kind: str
    payload_bytes: int
    encrypted: bool = False


@dataclass
class ClusterRun:
    """Everything one CPDA execution produced: readings, randomness, shares v[i, j], assembled F[j], the sum."""
    readings: np.ndarray          # [m, ...] residues
    coeffs: np.ndarray            # [m, m, ...]: coeffs[i, 0] = d_i, coeffs[i, k] = r_ik
    seeds: np.ndarray
    shares: np.ndarray            # [m (from), m (to), ...]
    assembled: np.ndarray         # [m, ...]
    total: np.ndarray             # [...] the leader's D
    leader: int = 0
    messages: list = field(default_factory=list)


def random_coefficients(readings: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[m, m, ...]: each node's polynomial, constant term = its reading, m − 1 uniform coefficients."""
    d = _as_field(readings)
    m = len(d)
    r = rng.integers(0, P, size=(m, m - 1) + d.shape[1:], dtype=np.int64)
    return np.concatenate([d[:, None], r], axis=1)


def run_cluster(readings, rng: np.random.Generator | None = None, seeds=None, leader: int = 0,
                coeffs: np.ndarray | None = None) -> ClusterRun:
    """One CPDA aggregation round in a cluster (readings [m] or [m, L] integers; `coeffs` replays given
    randomness instead of drawing it)."""
    d = _as_field(readings)
    m = len(d)
    _check_cluster_size(m)
    if rng is None and (seeds is None or coeffs is None):
        raise ValueError("pass rng (or both seeds and coeffs to replay a run)")
    seeds = _check_seeds(public_seeds(m, rng) if seeds is None else seeds)
    if len(seeds) != m:
        raise ValueError(f"need one seed per node: {m} readings, {len(seeds)} seeds")
    if not 0 <= leader < m:
        raise ValueError(f"leader must be a node index in [0, {m}), got {leader}")
    coeffs = random_coefficients(d, rng) if coeffs is None else np.mod(coeffs, P)
    if not np.array_equal(coeffs[:, 0], d):
        raise ValueError("coeffs[:, 0] must be the readings (the polynomials' constant terms)")
    shares = np.stack([np.stack([poly_eval(coeffs[i], x) for x in seeds]) for i in range(m)])
    assembled = np.stack([combine(np.ones(m, dtype=np.int64), shares[:, j]) for j in range(m)])
    total = combine(lagrange_weights_at_zero(seeds), assembled)
    msgs = cpda_messages(m, int(np.prod(d.shape[1:], dtype=np.int64)), leader)
    return ClusterRun(d, coeffs, seeds, shares, assembled, total, leader, msgs)


@register("cpda", claims="cpda", kind="module")
def cpda_sum(readings, rng: np.random.Generator, leader: int = 0) -> np.ndarray:
    """The cluster sum Σ_i d_i (signed) as the leader recovers it from the assembled values alone."""
    return decode(run_cluster(readings, rng, leader=leader).total)


def leader_view(run: ClusterRun) -> dict:
    """What an honest-but-curious leader L sees: its own polynomial, the shares v_i^L sent to it, and every F_j."""
    L = run.leader
    return {"own_coeffs": run.coeffs[L], "received": np.delete(run.shares[:, L], L, axis=0),
            "assembled": run.assembled}


def equivalent_randomness(run: ClusterRun, new_readings) -> np.ndarray:
    """Coefficients that give the leader exactly the same view for other readings with the same sum (the
    leader's own fixed): P'_i(x) = P_i(x) + δ_i (1 − x / x_L), so P'_i(x_L) = P_i(x_L) and
    F'_j = F_j + (1 − x_j/x_L) Σ_i δ_i = F_j. A bijection on the randomness, so the view's distribution is the
    same too."""
    new = _as_field(new_readings)
    L = run.leader
    delta = np.mod(new - run.readings, P)
    if np.any(combine(np.ones(len(delta), dtype=np.int64), delta) != 0):
        raise ValueError("new_readings must have the same sum (mod p) as the run's readings")
    if np.any(delta[L] != 0):
        raise ValueError("the leader's own reading must stay the same (it knows it)")
    coeffs = run.coeffs.copy()
    coeffs[:, 0] = new
    coeffs[:, 1] = np.mod(coeffs[:, 1] - (delta * inverse(run.seeds[L])) % P, P)
    return coeffs


def colluders_recover(run: ClusterRun, target: int) -> np.ndarray:
    """The m − 1 nodes other than `target` (the leader among them) learn d_target = D − Σ_{i≠target} d_i."""
    if target == run.leader:
        raise ValueError("the target must be a member other than the leader (the colluders include the leader)")
    others = np.delete(run.readings, target, axis=0)
    return decode(np.mod(run.total - combine(np.ones(len(others), dtype=np.int64), others), P))


def tamper(run: ClusterRun, member: int, shift) -> ClusterRun:
    """Member j adds c to its F_j before sending it; returns the run the leader then sees (D moves by λ_j c)."""
    if member == run.leader:
        raise ValueError("the tampering member must not be the leader")
    assembled = run.assembled.copy()
    assembled[member] = np.mod(assembled[member] + _as_field(shift), P)
    total = combine(lagrange_weights_at_zero(run.seeds), assembled)
    return ClusterRun(run.readings, run.coeffs, run.seeds, run.shares, assembled, total, run.leader, run.messages)


def shift_for_sum_change(seeds, member: int, e) -> np.ndarray:
    """The c that member j must add to F_j so that the leader's D moves by exactly e: c = e / λ_j."""
    lam = lagrange_weights_at_zero(seeds)
    return np.mod(_as_field(e) * inverse(lam[member]), P)


def lagrange_basis_coeffs(seeds, j: int) -> np.ndarray:
    """Coefficients (constant first) of ℓ_j(x) = Π_{l≠j} (x − x_l)/(x_j − x_l) mod p."""
    s = _check_seeds(seeds)
    poly = [1]
    denom = 1
    for l, xl in enumerate(s):
        if l == j:
            continue
        poly = [((poly[k - 1] if k else 0) - int(xl) * (poly[k] if k < len(poly) else 0)) % P
                for k in range(len(poly) + 1)]
        denom = denom * (int(s[j]) - int(xl)) % P
    inv = inverse(denom)
    return np.array([c * inv % P for c in poly], dtype=np.int64)


def honest_explanation_of_tamper(run: ClusterRun, member: int, c) -> ClusterRun:
    """An honest run (member j's reading raised by e = λ_j c, its polynomial plus c·ℓ_j) that gives the leader
    exactly the tampered view: no check at the leader can tell the two apart."""
    basis = lagrange_basis_coeffs(run.seeds, member)
    c = _as_field(c)
    extra = np.stack([(int(b) * c) % P for b in basis])               # c·ℓ_j, [m, ...]
    coeffs = run.coeffs.copy()
    coeffs[member] = np.mod(coeffs[member] + extra, P)
    return run_cluster(coeffs[:, 0], seeds=run.seeds, leader=run.leader, coeffs=coeffs)


# --- communication: CPDA vs pairwise-masking secure aggregation -------------------------------------
def cpda_messages(m: int, length: int = 1, leader: int = 0) -> list[Message]:
    """The messages `run_cluster` sends in one cluster: m(m − 1) encrypted shares (v_i^j from i to j) and
    m − 1 assembled values (F_j to the leader), each `length` field elements."""
    _check_cluster_size(m)
    msgs = [Message(i, j, "share", length * FIELD_BYTES, encrypted=True)
            for i in range(m) for j in range(m) if i != j]
    return msgs + [Message(j, leader, "assembled", length * FIELD_BYTES) for j in range(m) if j != leader]


def pairwise_masking_messages(m: int, length: int = 1, key_bytes: int = 32, share_bytes: int = 32,
                              id_bytes: int = 4, aead_bytes: int = 28) -> list[Message]:
    """Bonawitz et al. (CCS 2017), semi-honest, no dropouts, m users and a server:
    AdvertiseKeys (2 public keys up; all m key pairs down), ShareKeys (m − 1 encrypted pairs of Shamir shares
    up, forwarded down), MaskedInputCollection (the masked vector up; the survivor list down), Unmasking
    (m − 1 shares of the self-mask seeds b_v up). Sizes in bytes are parameters."""
    if m < 2:
        raise ValueError(f"pairwise masking needs m >= 2 users, got {m}")
    ct = 2 * id_bytes + 2 * share_bytes + aead_bytes                  # one ShareKeys ciphertext
    msgs = []
    for u in range(m):
        msgs.append(Message(u, "server", "advertise_keys", 2 * key_bytes))
        msgs.append(Message("server", u, "key_list", m * (id_bytes + 2 * key_bytes)))
        msgs.append(Message(u, "server", "share_keys", (m - 1) * ct, encrypted=True))
        msgs.append(Message("server", u, "forwarded_shares", (m - 1) * ct, encrypted=True))
        msgs.append(Message(u, "server", "masked_input", length * FIELD_BYTES))
        msgs.append(Message("server", u, "survivors", m * id_bytes))
        msgs.append(Message(u, "server", "unmask_shares", (m - 1) * (id_bytes + share_bytes)))
    return msgs


def traffic(messages: list[Message]) -> dict:
    return {"messages": len(messages), "bytes": int(sum(x.payload_bytes for x in messages))}


# --- the FL bridge -----------------------------------------------------------------------------------
@dataclass
class CPDARule:
    """A stateful `Method.rule`: the round's clients run CPDA (one cluster) on their quantised, weight-scaled
    updates q_k = round(2^f · w_k/Σw · Δ_k); the server decodes the sum and returns Σ_k q_k / 2^f. Records,
    per round, the largest |CPDA sum − plain integer sum| (0: exact) and the float error vs the weighted mean."""
    frac_bits: int = 16
    seed: int = 0

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {"round": 0, "int_diff": 0.0, "float_err": 0.0}

    def aggregate(self, state: dict, updates: torch.Tensor, weights: torch.Tensor | None):
        m = updates.shape[0]
        if m < 3:
            raise ValueError(f"CPDARule needs at least 3 clients per round (a CPDA cluster), got {m}")
        w = torch.ones(m, dtype=torch.float64) if weights is None else weights.detach().cpu().double()
        scaled = (w / w.sum())[:, None] * updates.detach().cpu().double()
        q = quantise(scaled.numpy(), self.frac_bits)
        if np.abs(q.sum(0)).max() >= P // 2:
            raise ValueError("the quantised sum overflows the field; lower frac_bits")
        run = run_cluster(q, np.random.default_rng([self.seed, state["round"]]))
        total = decode(run.total)
        agg = torch.as_tensor(dequantise(total, self.frac_bits), dtype=updates.dtype, device=updates.device)
        plain = (w / w.sum()).to(updates.dtype).to(updates.device) @ updates
        return agg, {"round": state["round"] + 1,
                     "int_diff": float(np.abs(total - q.sum(0)).max()),
                     "float_err": float((agg - plain).abs().max())}

    def metrics(self, state: dict) -> dict:
        return {"cpda_int_diff": state["int_diff"], "cpda_float_err": state["float_err"]}
