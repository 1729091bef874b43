"""Secure aggregation — Bonawitz, Ivanov, Kreuter, Marcedone, McMahan, Patel, Ramage, Segal, Seth,
"Practical Secure Aggregation for Privacy-Preserving Machine Learning", ACM CCS 2017 (eprint 2017/281).

The honest-but-curious protocol of the paper's Figure 4, four rounds between n clients and a server that
learns only Σ_{u ∈ U3} x_u mod R (R = 2^k), even when clients drop out:

    0 AdvertiseKeys   u → S: c_u^PK ‖ s_u^PK (two X25519 key pairs); S → all: the roster U1 (≥ t users)
    1 ShareKeys       u: b_u (a PRG seed), Shamir t-of-|U1| shares of s_u^SK and b_u; share v's pair is
                      sent to S encrypted for v (AES-GCM, key = HKDF(X25519(c_u^SK, c_v^PK))); S forwards
    2 MaskedInput     u → S: y_u = x_u + PRG(b_u) + Σ_{v ∈ U2 \\ u} Δ_{u,v} PRG(s_{u,v}) mod R,
                      s_{u,v} = HKDF(X25519(s_u^SK, s_v^PK)), Δ_{u,v} = +1 if u > v else −1 (cancels in pairs),
                      then HMAC-SHA256(H(b_u), u ‖ y_u) (an addition to Figure 4, below)
    3 Unmasking       u → S: b-shares of the survivors U3 and s^SK-shares of the dropped U2 \\ U3; S rebuilds
                      b_v (v ∈ U3) and s_v^SK (v dropped), recomputes and removes those masks from Σ y_u

The active-adversary variant's signatures and ConsistencyCheck round are not implemented; each share ciphertext is
bound to the roster its sender saw (AES-GCM associated data: an addition to Figure 4), so clients sent different
rosters abort at Unmasking instead of producing a wrong sum. Likewise each masked input carries a MAC keyed by its
sender's fresh b_u (which the server rebuilds in Unmasking anyway), so a y_u replayed from another instance or sent
under another user's id aborts naming that user instead of being summed (32 bytes per user). Neither makes the sum
correct against a malicious client, which can send any y_u; they catch replays and misroutes. Every message is
real bytes (its `len` is the measured wire cost); clients hold every secret, `SecAggServer` holds public keys,
the ciphertexts it forwards, the masked inputs and the final sum (reconstructed seeds and keys live only
inside `SecAggServer.unmask`). Libraries: `cryptography` (X25519, HKDF-SHA256, AES-GCM, AES-CTR) and
pycryptodome's `Shamir` (GF(2^128), 16-byte secrets: 32-byte keys are shared as two blocks).

PRG: AES in counter mode keyed by the seed (AES-128 for the 16-byte b_u, AES-256 for the 32-byte s_{u,v}),
a standard cryptographic PRG, hardware-accelerated; numpy's PCG64/Philox are statistical generators, not
cryptographic ones, so they are used only to derive the *simulation's* private keys reproducibly
(`seed=`, stream 23); `seed=None` draws them from `os.urandom` as a deployment must.

Float updates enter as fixed point (`FixedPoint`): clip to [−c, c], q = round(x·scale) (step 1/scale), q mod
2^k; the sum decodes uniquely while Σ_u w_u·max|q| < 2^(k−1) (checked). The round pipeline plug-in
(`SecureAggregation` uplink transform + `SecureMean` rule, `with_secure_aggregation(method)`) makes any
FedAvg-family method send n_k·q(Δ_k) and n_k inside the secure sum, so the server's weighted mean
Σ n_k q(Δ_k) / Σ n_k needs no plaintext weight from any client.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import numbers
import os
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ...core.messages import Transform
from ...core.method import DataSizeWeighting, Method, ServerSGD, UniformWeighting, weighted_mean
from ...core.registry import register
from ...core.streams import register_stream
from ...utils import check_number, rng

SECAGG = register_stream("secure_aggregation", 23)   # the simulated clients' private keys, seeds and nonces
STAGES = ("advertise_keys", "share_keys", "masked_input", "unmasking")
KEY_BYTES, SEED_BYTES, NONCE_BYTES, BLOCK = 32, 16, 12, 16
COMMIT_BYTES = 32               # SHA-256 commitment to b_u, sent ahead of u's ShareKeys records
MAC_BYTES = 32                  # HMAC-SHA256 tag after u's masked input, keyed by b_u (see mac_masked)
_ID = struct.Struct("<I")       # a user id on the wire
B_SHARE, S_SHARE = 0, 1         # kinds of unmasking shares
_KIND = {B_SHARE: "b", S_SHARE: "s^SK"}


class SecAggAbort(ValueError):
    """The protocol aborts: fewer than t users reached a round (too many dropouts), or a party sent a
    malformed message (the error names the sender)."""


_FIX = "the protocol aborts (drop that client from the round or fix its software)"


def _abort(where: str, sender, what: str) -> SecAggAbort:
    return SecAggAbort(f"{where}: the message from {sender} {what}; {_FIX}")


def _records(where: str, sender, data, width: int) -> list:
    """(id, `width` bytes) records of a wire message, refusing non-bytes, a torn record or a repeated id."""
    if not isinstance(data, bytes):
        raise _abort(where, sender, f"is a {type(data).__name__}, not bytes")
    if len(data) % (_ID.size + width):
        raise _abort(where, sender, f"has {len(data)} bytes, not a multiple of the {_ID.size + width}-byte record")
    recs = list(_ids(data, width))
    ids = [v for v, _ in recs]
    if len(set(ids)) != len(ids):
        raise _abort(where, sender, f"names users {sorted({v for v in ids if ids.count(v) > 1})} more than once")
    return recs


# --- fixed point ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FixedPoint:
    """Floats ↔ Z_{2^bits}: clip to [−clip, clip], q = round(x·scale), q mod 2^bits (two's complement).
    A sum of n encoded values decodes exactly while n·max|q| < 2^(bits−1), max|q| = round(clip·scale)."""
    clip: float = 1.0
    scale: float = 2.0 ** 16
    bits: int = 32

    def __post_init__(self):
        if isinstance(self.bits, (bool, np.bool_)) or not (isinstance(self.bits, numbers.Integral) and 2 <= self.bits <= 64):
            raise ValueError(f"bits (k, sums are mod 2^k) must be an int in [2, 64], got {self.bits!r}")
        object.__setattr__(self, "bits", int(self.bits))  # frozen; a numpy integer would wrap in 2 ** (bits - 1)
        for name, value in (("clip", self.clip), ("scale", self.scale)):
            check_number(f"FixedPoint {name}", value, 0, fix="clip bounds |x|, scale is the quantisation's 1/step")
        if not float(self.clip) * float(self.scale) < 2.0 ** (self.bits - 1) or self.max_q >= 2 ** (self.bits - 1):
            # one value's q = round(clip·scale) must fit in k bits (a product just under 2^(k-1) rounds up to it)
            raise ValueError(f"bits={self.bits} is too small: one value's q = clip·scale = {self.clip:g}·{self.scale:g} "
                             f"reaches 2^{self.bits - 1}; lower clip or scale, or raise bits")
        if self.max_q < 1:  # every clipped value rounds to 0: the sum decodes to 0 and the model never moves
            raise ValueError(f"FixedPoint clip·scale = {self.clip}·{self.scale:g} < 0.5: every update rounds to 0; "
                             "raise clip (the largest |update entry| kept) or scale (2**16 by default)")

    @property
    def step(self) -> float:
        return 1.0 / self.scale

    @property
    def max_q(self) -> int:
        return int(round(self.clip * self.scale))

    def check_capacity(self, total_weight: int) -> None:
        """Raise unless a sum with total integer weight W cannot overflow: W·max|q| < 2^(bits−1)."""
        need = int(total_weight) * self.max_q
        if need >= 2 ** (self.bits - 1):
            raise ValueError(f"bits={self.bits} is too small: the sum can reach W·max|q| = {int(total_weight)}·"
                             f"{self.max_q} = {need} >= 2^{self.bits - 1}; use bits >= {need.bit_length() + 1}, or a "
                             f"smaller clip·scale ({self.clip}·{self.scale:g})")

    def quantize(self, x, weight: int = 1) -> np.ndarray:
        """weight·round(clip(x)·scale) mod 2^bits as uint64 (the weight stays an exact integer factor)."""
        q = np.rint(np.clip(np.asarray(x, dtype=np.float64), -self.clip, self.clip) * self.scale).astype(np.int64)
        return (q * np.int64(weight)).view(np.uint64) & modulus_mask(self.bits)

    def signed(self, z) -> np.ndarray:
        """Lift Z_{2^bits} to (−2^(bits−1), 2^(bits−1)) as int64."""
        z = np.asarray(z, dtype=np.uint64) & modulus_mask(self.bits)
        if self.bits == 64:
            return z.view(np.int64)
        z = z.astype(np.int64)
        return np.where(z >= 2 ** (self.bits - 1), z - 2 ** self.bits, z)

    def dequantize(self, z, total_weight: float = 1.0) -> np.ndarray:
        return self.signed(z).astype(np.float64) / (self.scale * total_weight)


def modulus_mask(bits: int) -> np.uint64:
    return np.uint64(2 ** bits - 1)


def wire_dtype(bits: int) -> np.dtype:
    """The narrowest little-endian unsigned integer that holds one element of Z_{2^bits} (byte-aligned)."""
    return np.dtype(next(f"<u{w}" for w in (1, 2, 4, 8) if bits <= 8 * w))


# --- primitives ----------------------------------------------------------------------------------------
def prg(seed: bytes, length: int, bits: int) -> np.ndarray:
    """`length` uniform elements of Z_{2^bits}: the AES-CTR keystream of key `seed` (zero IV; every seed
    keys one mask only), read as uint64 words and reduced mod 2^bits."""
    enc = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(enc.update(bytes(8 * length)), dtype="<u8") & modulus_mask(bits)


def agree(private: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    """KA.agree: X25519 shared secret, then HKDF-SHA256 to a 32-byte key bound to its purpose (`info`)."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def split_secret(secret: bytes, t: int, n: int) -> list[bytes]:
    """Shamir t-of-n shares of `secret` (a multiple of 16 bytes, one pycryptodome split per block); share i
    (0-based) belongs to the holder with Shamir index i + 1."""
    blocks = [Shamir.split(t, n, secret[j:j + BLOCK]) for j in range(0, len(secret), BLOCK)]
    return [b"".join(block[i][1] for block in blocks) for i in range(n)]


def combine_secret(shares: list[tuple[int, bytes]]) -> bytes:
    """The secret from (Shamir index, share) pairs, block by block (the caller passes exactly t shares)."""
    size = len(shares[0][1])
    return b"".join(Shamir.combine([(i, s[j:j + BLOCK]) for i, s in shares]) for j in range(0, size, BLOCK))


def _ids(data: bytes, width: int):
    """Iterate (user id, the `width` bytes after it) records of a wire message."""
    step = _ID.size + width
    for o in range(0, len(data), step):
        yield _ID.unpack_from(data, o)[0], data[o + _ID.size:o + step]


def _pair(u: int, v: int) -> bytes:
    return _ID.pack(u) + _ID.pack(v)


def commit_b(u: int, b: bytes) -> bytes:
    """H(u ‖ b_u): user u's commitment to its self-mask seed (128 random bits: hiding), sent in ShareKeys so the
    server can check the b_u it rebuilds in Unmasking even from exactly t shares (binding)."""
    return hashlib.sha256(b"secagg b_u " + _ID.pack(u) + b).digest()


def mac_masked(u: int, b: bytes, y: bytes) -> bytes:
    """HMAC-SHA256(H(b_u), u ‖ y_u): binds user u's masked input to u and to this instance (b_u is fresh in each).
    The server can check it only after Unmasking rebuilds b_u, i.e. after every y_u has arrived."""
    key = hashlib.sha256(b"secagg mac " + b).digest()
    return hmac.new(key, _ID.pack(u) + y, hashlib.sha256).digest()


# --- parties -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SecAggParams:
    """The public parameters every party knows: threshold t, vector length m, modulus R = 2^bits."""
    threshold: int
    length: int
    bits: int = 32

    def __post_init__(self):
        for name, low, high in (("threshold", 2, None), ("length", 0, None), ("bits", 2, 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low or high is not None and v > high:
                raise ValueError(f"SecAggParams: {name} must be an integer {'in [2, 64]' if high else f'>= {low}'}, got "
                                 f"{v!r}" + ("; t = 1 would let the server unmask one user alone" if name == "threshold"
                                             else ""))


def _check_uid(uid, who: str) -> int:
    """A user id on the wire: an integer in [0, 2^32)."""
    if isinstance(uid, bool) or not isinstance(uid, (int, np.integer)) or not 0 <= uid < 2 ** 32:
        raise ValueError(f"{who} must be an integer in [0, 2^32) (a user id on the wire), got {uid!r}")
    return int(uid)


class SecAggClient:
    """One user u. Holds every secret of u: both private keys, b_u, the shares it made and received."""

    def __init__(self, uid: int, x: np.ndarray, params: SecAggParams, random: np.random.Generator | None = None):
        self.uid, self.params, self.x = _check_uid(uid, "SecAggClient's uid"), params, _client_input(x, params)
        self._random = random          # None: os.urandom (a deployment); a Generator: a reproducible simulation
        self.seconds = 0.0             # CPU time spent in this client's rounds

    def _bytes(self, n: int) -> bytes:
        return os.urandom(n) if self._random is None else self._random.bytes(n)

    def _agree(self, private, v: int, which: int, info: bytes) -> bytes:
        """KA.agree with user v's public key `which` (0: c^PK, 1: s^PK); a key X25519 refuses aborts."""
        try:
            return agree(private, self._keys[v][which], info)
        except ValueError as e:
            raise _abort(f"client {self.uid}", f"user {v}", f"carries a public key X25519 refuses ({e})") from None

    def _after(self, stage: str, attr: str, asked: str) -> None:
        """An honest client answers a round only after its own previous one: else the server is out of order."""
        if not hasattr(self, attr):
            raise _abort(f"client {self.uid}", "the server", f"asks for {asked} before this client ran {stage}")

    def advertise_keys(self) -> bytes:
        """Round 0: two fresh X25519 key pairs; send c_u^PK ‖ s_u^PK."""
        self._c_sk = X25519PrivateKey.from_private_bytes(self._bytes(KEY_BYTES))
        self._s_sk = X25519PrivateKey.from_private_bytes(self._bytes(KEY_BYTES))
        return self._c_sk.public_key().public_bytes_raw() + self._s_sk.public_key().public_bytes_raw()

    def share_keys(self, roster: bytes) -> bytes:
        """Round 1: H(u ‖ b_u), then shares of s_u^SK and b_u for every user of U1, each encrypted for its holder."""
        recs = _records(f"client {self.uid}", "the server (the roster)", roster, 2 * KEY_BYTES)
        self._keys = {v: (k[:KEY_BYTES], k[KEY_BYTES:]) for v, k in recs}
        t, users = self.params.threshold, sorted(self._keys)
        if self.uid not in self._keys:
            raise _abort(f"client {self.uid}", "the server (the roster)", f"does not list this client {self.uid}")
        if len(users) < t:
            raise SecAggAbort(f"client {self.uid}: roster has {len(users)} users, fewer than threshold t={t}")
        if len({k for pair in self._keys.values() for k in pair}) != 2 * len(users):
            raise SecAggAbort(f"client {self.uid}: two users advertised the same public key")
        self._index = {v: i + 1 for i, v in enumerate(users)}         # Shamir index of each holder
        roster_seen = b"".join(_ID.pack(v) + c + s for v, (c, s) in sorted(self._keys.items()))
        self._roster_id = hashlib.sha256(roster_seen).digest()  # bound into every share ciphertext (see _open)
        self._b = self._bytes(SEED_BYTES)
        s_sk = self._s_sk.private_bytes_raw()
        s_shares, b_shares = split_secret(s_sk, t, len(users)), split_secret(self._b, t, len(users))
        self._own_b_share = b_shares[self._index[self.uid] - 1]
        out = [commit_b(self.uid, self._b)]
        for v in users:
            if v == self.uid:
                continue
            i, key = self._index[v] - 1, self._agree(self._c_sk, v, 0, b"secagg share " + _pair(self.uid, v))
            nonce = self._bytes(NONCE_BYTES)
            plain = _pair(self.uid, v) + s_shares[i] + b_shares[i]
            out.append(_ID.pack(v) + nonce + AESGCM(key).encrypt(nonce, plain, _pair(self.uid, v) + self._roster_id))
        return b"".join(out)

    def masked_input(self, inbox: bytes) -> bytes:
        """Round 2: y_u = x_u + PRG(b_u) + Σ_{v ∈ U2\\u} Δ_{u,v} PRG(s_{u,v}) mod R, as bytes."""
        self._after("share_keys", "_index", "MaskedInputCollection")
        self._inbox = dict(_records(f"client {self.uid}", "the server (the inbox)", inbox, NONCE_BYTES + _SHARE_CT))
        strangers = set(self._inbox) - (set(self._keys) - {self.uid})
        if strangers:
            raise _abort(f"client {self.uid}", "the server (the inbox)", f"holds shares from users {sorted(strangers)} "
                         "outside the roster (or from this client itself)")
        self._u2 = sorted({*self._inbox, self.uid})
        m, bits = self.params.length, self.params.bits
        if len(self._u2) < self.params.threshold:
            raise SecAggAbort(f"client {self.uid}: |U2| = {len(self._u2)} < threshold t={self.params.threshold}")
        y = self.x + prg(self._b, m, bits)
        for v in self._u2:
            if v != self.uid:
                mask = prg(self._agree(self._s_sk, v, 1, b"secagg mask"), m, bits)
                y = y + mask if self.uid > v else y - mask  # uint64 wraps mod 2^64, so mod 2^bits too
        y = (y & modulus_mask(bits)).astype(wire_dtype(bits)).tobytes()
        return y + mac_masked(self.uid, self._b, y)

    def unmask(self, survivors: bytes) -> bytes:
        """Round 3: for each v ∈ U2 decrypt e_{v,u}; send b_{v,u} if v survived (U3), s^SK_{v,u} if it dropped."""
        self._after("masked_input", "_u2", "Unmasking")
        u3 = {v for v, _ in _records(f"client {self.uid}", "the server (the survivors)", survivors, 0)}
        if len(u3) < self.params.threshold or not u3 <= set(self._u2):
            raise SecAggAbort(f"client {self.uid}: survivor list has {len(u3)} users (threshold "
                              f"t={self.params.threshold}) or names users outside U2")
        out = [_ID.pack(self.uid) + bytes([B_SHARE]) + self._own_b_share]
        for v in self._u2:
            if v == self.uid:
                continue
            s_share, b_share = self._open(v)
            out.append(_ID.pack(v) + (bytes([B_SHARE]) + b_share if v in u3 else bytes([S_SHARE]) + s_share))
        return b"".join(out)

    def _open(self, v: int) -> tuple[bytes, bytes]:
        """Decrypt v's shares for u and check they are addressed v → u."""
        blob = self._inbox[v]
        key = self._agree(self._c_sk, v, 0, b"secagg share " + _pair(v, self.uid))
        try:
            plain = AESGCM(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], _pair(v, self.uid) + self._roster_id)
        except InvalidTag:
            raise SecAggAbort(f"client {self.uid}: the shares from {v} failed authentication (altered, or {v} was "
                              "sent another roster than this client)") from None
        if plain[:8] != _pair(v, self.uid):
            raise SecAggAbort(f"client {self.uid}: shares from {v} are addressed to someone else")
        return plain[8:8 + KEY_BYTES], plain[8 + KEY_BYTES:]


_SHARE_CT = 8 + KEY_BYTES + SEED_BYTES + 16     # ids ‖ s^SK share ‖ b share, plus the GCM tag


def _client_input(x, params: SecAggParams) -> np.ndarray:
    """x as uint64, checked: a 1-D integer vector of `params.length` elements of Z_(2^bits)."""
    x = np.asarray(x)
    if x.shape != (params.length,) or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"x must be a 1-D integer vector of length m={params.length} (elements of Z_(2^bits); use "
                         f"FixedPoint.quantize for floats), got dtype {x.dtype}, shape {x.shape}")
    if (x < 0).any() or (params.bits < 64 and (x.astype(np.uint64) >> np.uint64(params.bits)).any()):
        raise ValueError(f"x must lie in [0, 2^{params.bits}); reduce it mod 2^{params.bits} first")
    return x.astype(np.uint64)


class SecAggServer:
    """The server: public keys, the ciphertexts it forwards, masked inputs, and the sum. No secret."""

    def __init__(self, params: SecAggParams, users=None):
        self.params = params
        self.users = range(2 ** 32) if users is None else frozenset(  # who may take part
            _check_uid(u, "SecAggServer's users") for u in users)
        self._new_instance()
        self.seconds = 0.0

    def _new_instance(self) -> None:
        self.public_keys: dict[int, bytes] = {}          # u → c_u^PK ‖ s_u^PK
        self.ciphertexts: dict[tuple[int, int], bytes] = {}   # (from u, to v) → nonce ‖ AES-GCM ciphertext
        self.masked: dict[int, np.ndarray] = {}          # u → y_u
        self.masked_macs: dict[int, bytes] = {}          # u → the MAC sent after y_u (checked in Unmasking)
        self.b_commitments: dict[int, bytes] = {}        # u → H(u ‖ b_u), from ShareKeys
        self.u1 = self.u2 = self.u3 = self.u5 = ()
        self.sum: np.ndarray | None = None

    def _require(self, stage: str, users) -> tuple:
        users = tuple(sorted(users))
        t = self.params.threshold
        if len(users) < t:
            raise SecAggAbort(f"{stage}: only {len(users)} users responded, fewer than the threshold t={t}; the "
                              f"protocol aborts (at most |U1| − t may drop out; lower t or lose fewer clients)")
        return users

    def _checked(self, stage: str, msgs, allowed, size: int | None = None) -> dict[int, bytes]:
        """msgs with int keys, each sender one of `allowed` (this round's users) and each message bytes
        (of `size` bytes when given); anything else aborts naming the sender."""
        if not isinstance(msgs, dict):
            raise SecAggAbort(f"{stage}: messages must be a dict {{user id: bytes}}, got {type(msgs).__name__}")
        out = {}
        for u, msg in msgs.items():
            if isinstance(u, bool) or not isinstance(u, (int, np.integer)) or int(u) not in allowed:
                raise _abort(stage, f"client {u!r}", f"comes from a user that is not in this round ({_round(allowed)})")
            if not isinstance(msg, bytes):
                raise _abort(stage, f"client {u}", f"is a {type(msg).__name__}, not bytes")
            if size is not None and len(msg) != size:
                raise _abort(stage, f"client {u}", f"has {len(msg)} bytes, expected {size}")
            out[int(u)] = msg
        return out

    def collect_keys(self, msgs: dict[int, bytes]) -> bytes:
        """Round 0 of a new instance: nothing of an earlier instance on this server (its users, ciphertexts, masked
        inputs, commitments, sum) is kept, so none of its messages is accepted in this one."""
        self._new_instance()
        msgs = self._checked("AdvertiseKeys", msgs, self.users, 2 * KEY_BYTES)
        self.u1 = self._require("AdvertiseKeys", msgs)
        owners = {}                                      # public key → users advertising it
        for u in self.u1:
            for key in (msgs[u][:KEY_BYTES], msgs[u][KEY_BYTES:]):
                owners.setdefault(key, []).append(u)
        for users in owners.values():
            if len(users) > 1:
                raise SecAggAbort(f"AdvertiseKeys: users {sorted(set(users))} advertised the same public key (a "
                                  f"copied key, or one user's two keys are equal); {_FIX}")
        self.public_keys = {u: msgs[u] for u in self.u1}
        return b"".join(_ID.pack(u) + self.public_keys[u] for u in self.u1)

    def collect_shares(self, msgs: dict[int, bytes]) -> dict[int, bytes]:
        """Store each e_{u,v}; return each v ∈ U2 its inbox {e_{u,v} : u ∈ U2 \\ v}."""
        msgs = self._checked("ShareKeys", msgs, set(self.u1))
        self.u2 = self._require("ShareKeys", msgs)
        self.ciphertexts = {(u, v): blob for u in self.u2 for v, blob in self._shares_of(u, msgs[u][COMMIT_BYTES:])}
        self.b_commitments = {u: msgs[u][:COMMIT_BYTES] for u in self.u2}
        return {v: b"".join(_ID.pack(u) + self.ciphertexts[u, v] for u in self.u2 if u != v) for v in self.u2}

    def _shares_of(self, u: int, msg: bytes) -> list:
        """u's (holder, ciphertext) records; `msg` is u's ShareKeys message after its COMMIT_BYTES commitment."""
        recs = _records("ShareKeys", f"client {u}", msg, NONCE_BYTES + _SHARE_CT)
        if sorted(v for v, _ in recs) != [v for v in self.u1 if v != u]:
            raise _abort("ShareKeys", f"client {u}", f"addresses shares to {sorted(v for v, _ in recs)}, not once to "
                         f"each other user of U1 {list(self.u1)}")
        return recs

    def collect_masked(self, msgs: dict[int, bytes]) -> bytes:
        dtype = wire_dtype(self.params.bits)
        size = self.params.length * dtype.itemsize + MAC_BYTES
        msgs = self._checked("MaskedInputCollection", msgs, set(self.u2), size)
        self.u3 = self._require("MaskedInputCollection", msgs)
        self.masked = {u: np.frombuffer(msgs[u][:-MAC_BYTES], dtype=dtype).astype(np.uint64) for u in self.u3}
        self.masked_macs = {u: msgs[u][-MAC_BYTES:] for u in self.u3}
        return b"".join(_ID.pack(u) for u in self.u3)

    def unmask(self, msgs: dict[int, bytes]) -> np.ndarray:
        """Σ_{u∈U3} y_u − Σ_{u∈U3} PRG(b_u) − Σ_{u∈U3, v∈U2\\U3} Δ_{u,v} PRG(s_{u,v}) = Σ_{u∈U3} x_u mod R."""
        msgs = self._checked("Unmasking", msgs, set(self.u3))
        self.u5 = self._require("Unmasking", msgs)
        t, m, bits = self.params.threshold, self.params.length, self.params.bits
        index = {u: i + 1 for i, u in enumerate(self.u1)}
        shares, sender = {}, {}                          # (v, kind) → [(index of holder, share)]; share → holder
        for u in self.u5:
            for v, kind, share in self._unmasking_shares(u, msgs[u]):
                if (v, kind, share) in sender:  # two holders' shares of one secret differ (but for 2^-128)
                    raise SecAggAbort(f"Unmasking: client {sender[v, kind, share]} and client {u} sent the same "
                                      f"share of user {v}'s {_KIND[kind]} (one replayed the other's message); {_FIX}")
                sender[v, kind, share] = u
                shares.setdefault((v, kind), []).append((index[u], share))
        holders = {i: u for u, i in index.items()}
        z, dtype = np.zeros(m, dtype=np.uint64), wire_dtype(bits)
        for u in self.u3:
            b = self._rebuild(shares, u, B_SHARE, t, holders)
            if not hmac.compare_digest(mac_masked(u, b, self.masked[u].astype(dtype).tobytes()), self.masked_macs[u]):
                raise _abort("Unmasking", f"client {u}", "(its masked input) does not carry its MAC under its own "
                             "b_u: it was replayed from another instance or sent under another user's id")
            z += self.masked[u] - prg(b, m, bits)
        for v in sorted(set(self.u2) - set(self.u3)):
            s_sk = X25519PrivateKey.from_private_bytes(self._rebuild(shares, v, S_SHARE, t, holders))
            for u in self.u3:
                mask = prg(agree(s_sk, self.public_keys[u][KEY_BYTES:], b"secagg mask"), m, bits)
                z = z - mask if u > v else z + mask    # remove u's Δ_{u,v} PRG(s_{u,v}) term
        self.sum = z & modulus_mask(bits)
        return self.sum

    def _unmasking_shares(self, u: int, data: bytes) -> list:
        """(v, kind, share) records of u's unmasking message: exactly one share for each v ∈ U2 (u itself
        included), a b-share if v ∈ U3 and an s^SK share if v dropped; anything else aborts naming u."""
        o, out = 0, []
        while o < len(data):
            if o + _ID.size + 1 > len(data):
                raise _abort("Unmasking", f"client {u}", f"ends in a torn record at byte {o}")
            v, kind = _ID.unpack_from(data, o)[0], data[o + _ID.size]
            want = B_SHARE if v in self.u3 else S_SHARE if v in self.u2 else None
            if kind != want:
                raise _abort("Unmasking", f"client {u}", f"holds a share of kind {kind} for user {v} (expected "
                             f"{'none: not in U2' if want is None else 'b' if want == B_SHARE else 's^SK'})")
            size = SEED_BYTES if kind == B_SHARE else KEY_BYTES
            if o + _ID.size + 1 + size > len(data):
                raise _abort("Unmasking", f"client {u}", f"ends in a torn record at byte {o}")
            out.append((v, kind, data[o + _ID.size + 1:o + _ID.size + 1 + size]))
            o += _ID.size + 1 + size
        if sorted(v for v, _, _ in out) != list(self.u2):
            raise _abort("Unmasking", f"client {u}", f"holds shares for {sorted(v for v, _, _ in out)}, not once "
                         f"for each user of U2 {list(self.u2)}")
        return out

    def _rebuild(self, shares: dict, v: int, kind: int, t: int, holders: dict) -> bytes:
        """User v's b (kind B_SHARE) or s^SK from the first t shares, checked: with a (t+1)-th share the other
        t-subset must give the same secret, a rebuilt b must match v's ShareKeys commitment H(v ‖ b_v) and a
        rebuilt s^SK must give v's advertised s^PK; else abort naming the clients whose shares were used (one of
        them sent a corrupted or replayed share)."""
        got = shares.get((v, kind), [])
        if len(got) < t:
            raise SecAggAbort(f"Unmasking: {len(got)} shares of user {v}'s {_KIND[kind]}, "
                              f"fewer than the threshold t={t}")
        secret = combine_secret(got[:t])
        bad = len(got) > t and combine_secret(got[1:t + 1]) != secret
        if not bad and kind == B_SHARE:
            bad = commit_b(v, secret) != self.b_commitments.get(v)
        if not bad and kind == S_SHARE:
            public = X25519PrivateKey.from_private_bytes(secret).public_key().public_bytes_raw()
            bad = public != self.public_keys[v][KEY_BYTES:]
        if bad:
            used = " and ".join(f"client {holders[i]}" for i, _ in got[:t + 1])
            raise SecAggAbort(f"Unmasking: user {v}'s {_KIND[kind]} rebuilt from the shares sent by {used} does not "
                              f"check (inconsistent shares, or not its {'advertised s^PK' if kind == S_SHARE else 'ShareKeys commitment H(b)'}): "
                              f"one of them sent a corrupted or replayed share; {_FIX}")
        return secret


# --- a whole run ---------------------------------------------------------------------------------------
@dataclass
class SecAggResult:
    """One protocol run: the sum over `included` (= U3), who responded at each round, measured bytes
    (`sent[u][stage]`, `received[u][stage]`: len of the real messages) and CPU seconds."""
    sum: np.ndarray
    included: tuple
    rounds: dict                 # stage → users that sent that round's message
    sent: dict
    received: dict
    client_seconds: dict
    server_seconds: float
    server: SecAggServer
    clients: dict = field(repr=False)

    def bytes_sent(self, users=None) -> np.ndarray:
        """Total bytes each user (default: those in U3) sent over all rounds."""
        users = self.included if users is None else users
        return np.array([sum(self.sent[u].values()) for u in users])

    def bytes_received(self, users=None) -> np.ndarray:
        users = self.included if users is None else users
        return np.array([sum(self.received[u].values()) for u in users])


def _round(allowed) -> str:
    return "ids must be in [0, 2^32)" if isinstance(allowed, range) else f"its users are {sorted(allowed)}"


def _timed(party, method: str, *args):
    t0 = time.process_time()
    out = getattr(party, method)(*args)
    party.seconds += time.process_time() - t0
    return out


def _check_run(inputs: np.ndarray, threshold, bits: int, ids) -> tuple:
    if inputs.ndim != 2 or not np.issubdtype(inputs.dtype, np.integer):
        raise ValueError(f"inputs must be a 2-D integer array [n clients, m] of elements of Z_(2^bits) "
                         f"(use FixedPoint.quantize for floats), got dtype {inputs.dtype}, shape {inputs.shape}")
    n = inputs.shape[0]
    if not (isinstance(bits, (int, np.integer)) and 2 <= bits <= 64):
        raise ValueError(f"bits (k, sums are mod 2^k) must be an int in [2, 64], got {bits!r}")
    if (inputs < 0).any() or (bits < 64 and (inputs.astype(np.uint64) >> np.uint64(bits)).any()):
        raise ValueError(f"inputs must lie in [0, 2^{bits}); reduce them mod 2^{bits} first")
    if not isinstance(threshold, (int, np.integer)) or not 2 <= threshold <= n:
        raise ValueError(f"threshold t must be an integer with 2 <= t <= n (n = {n} clients), got {threshold!r}; "
                         f"t = 1 would let the server unmask one user alone, t > n can never be met")
    if ids is not None and any(isinstance(u, bool) or not isinstance(u, (int, np.integer)) for u in ids):
        raise ValueError(f"ids must be {n} distinct integers in [0, 2^32), got {list(ids)!r}")
    ids = tuple(range(n)) if ids is None else tuple(int(u) for u in ids)
    if len(set(ids)) != n or min(ids) < 0 or max(ids) >= 2 ** 32:
        raise ValueError(f"ids must be {n} distinct integers in [0, 2^32), got {ids!r}")
    return ids


def _dropout_plan(dropouts, ids) -> dict:
    """stage → set of ids that stop before sending that round's message. A plain list means
    "masked_input" (after sharing keys, before the masked input: the paper's main dropout point)."""
    if dropouts is None:
        dropouts = {}
    elif not isinstance(dropouts, dict):
        dropouts = {"masked_input": dropouts}
    bad = set(dropouts) - set(STAGES)
    if bad:
        raise ValueError(f"dropouts keys must be stages {STAGES}, got {sorted(bad)}")
    if any(isinstance(u, bool) or not isinstance(u, (int, np.integer)) for s in STAGES for u in dropouts.get(s, ())):
        raise ValueError(f"dropouts must name users by their integer ids, got {dropouts!r}")
    plan = {s: {int(u) for u in dropouts.get(s, ())} for s in STAGES}
    unknown = set().union(*plan.values()) - set(ids)
    if unknown:
        raise ValueError(f"dropouts name users {sorted(unknown)} that are not in ids")
    return plan


def run_protocol(inputs, threshold: int, *, bits: int = 32, dropouts=None, ids=None, seed: int | None = 0
                 ) -> SecAggResult:
    """Run the four rounds for n clients with integer vectors `inputs` [n, m] (elements of Z_(2^bits)).

    `dropouts`: ids that drop after ShareKeys (before sending y_u), or {stage: ids} with stages
    "advertise_keys", "share_keys", "masked_input", "unmasking" (a user stops before sending that round's
    message). Fewer than `threshold` users at any round raises `SecAggAbort` naming t. `seed`: private keys,
    b_u and nonces from `rng(seed, 23, u)` (reproducible); None: from os.urandom."""
    inputs = np.asarray(inputs)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0 or None (os.urandom), got {seed!r}")
    ids = _check_run(inputs, threshold, bits, ids)
    plan = _dropout_plan(dropouts, ids)
    params = SecAggParams(int(threshold), inputs.shape[1], int(bits))
    clients = {u: SecAggClient(u, inputs[i], params, None if seed is None else rng(seed, SECAGG, u))
               for i, u in enumerate(ids)}
    server = SecAggServer(params, ids)
    sent = {u: dict.fromkeys(STAGES, 0) for u in ids}
    received = {u: dict.fromkeys(STAGES, 0) for u in ids}
    rounds, alive, downlink = {}, list(ids), None
    for stage, (client_step, server_step) in zip(STAGES, _STEPS):
        alive = [u for u in alive if u not in plan[stage]]
        msgs = {}
        for u in alive:
            msgs[u] = _timed(clients[u], client_step, *(() if downlink is None else (downlink[u],)))
            sent[u][stage] = len(msgs[u])
        rounds[stage] = tuple(alive)
        out = _timed(server, server_step, msgs)
        if stage == STAGES[-1]:
            break
        downlink = out if isinstance(out, dict) else {u: out for u in alive}   # per-user inboxes or a broadcast
        nxt = STAGES[STAGES.index(stage) + 1]
        for u in alive:
            received[u][nxt] = len(downlink[u])
    return SecAggResult(server.sum.copy(), server.u3, rounds, sent, received,
                        {u: c.seconds for u, c in clients.items()}, server.seconds, server, clients)


_STEPS = (("advertise_keys", "collect_keys"), ("share_keys", "collect_shares"), ("masked_input", "collect_masked"),
          ("unmask", "unmask"))    # (client method, server method) of each round


# --- does the server hold a secret? --------------------------------------------------------------------
def client_secrets(clients: dict) -> list[bytes]:
    """Every secret byte string the clients hold: inputs, private keys, b_u, pairwise mask seeds, plain shares."""
    out = []
    for c in clients.values():
        out.append(c.x.tobytes())
        if hasattr(c, "_c_sk"):
            out += [c._c_sk.private_bytes_raw(), c._s_sk.private_bytes_raw()]
        if not hasattr(c, "_b"):
            continue  # stopped before ShareKeys
        out += [c._b, c._own_b_share]
        for v, (_, s_pk) in c._keys.items():
            if v != c.uid:
                out.append(agree(c._s_sk, s_pk, b"secagg mask"))
        for v in getattr(c, "_inbox", {}):
            out += list(c._open(v))
    return out


def held_secrets(obj, secrets: list[bytes], path: str = "server", seen=None) -> list[str]:
    """Paths inside `obj` (attributes, dicts, sequences, arrays, recursively) that hold a private key object
    or bytes containing one of `secrets`; [] means the object holds none of them."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, X25519PrivateKey):
        return [path]
    if isinstance(obj, np.ndarray):
        obj = obj.tobytes()
    if isinstance(obj, (bytes, bytearray)):
        return [path] if any(s in obj for s in secrets) else []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in held_secrets(k, secrets, f"{path}[{k!r}]", seen)
                + held_secrets(v, secrets, f"{path}[{k!r}]", seen)]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [p for i, v in enumerate(obj) for p in held_secrets(v, secrets, f"{path}[{i}]", seen)]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return [p for k, v in vars(obj).items() for p in held_secrets(v, secrets, f"{path}.{k}", seen)]
    return []


# --- the round pipeline plug-in ------------------------------------------------------------------------
@dataclass
class SecureSum:
    """What the server learns in a round: Σ_{u∈U3} [w_u·q(Δ_u), w_u] mod 2^bits and the public encoding."""
    values: np.ndarray
    fixed_point: FixedPoint
    included: tuple


@dataclass
class SecureAggregation(Transform):
    """Uplink transform: the round's clients run the protocol on [w_k·q(Δ_k), w_k] (w_k = n_k from
    `client_sizes`, else 1); the server's messages become the masked y_k (int64 rows) and
    `msgs.meta["secagg"]` the unmasked `SecureSum`. `threshold`: an int t, or a fraction of the round's
    clients (t = max(2, ⌈frac·m⌉)). `dropout`: each client independently drops after ShareKeys with this
    probability (its row leaves the messages). `bytes` = each client's measured protocol upload. The
    latest run is kept as `.last` (a `SecAggResult`, for inspection)."""
    threshold: float | int = 2 / 3
    clip: float = 1.0
    scale: float = 2.0 ** 16
    bits: int = 32
    client_sizes: tuple | None = None
    dropout: float = 0.0
    on_abort: str = "raise"      # "skip": an aborted round (too few survivors) leaves θ where it is
    key: str = "delta"

    def __post_init__(self):
        FixedPoint(self.clip, self.scale, self.bits)  # validates
        if self.on_abort not in ("raise", "skip"):
            raise ValueError(f"on_abort must be 'raise' or 'skip', got {self.on_abort!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {type(self.dropout).__name__} {self.dropout!r}")
        t = self.threshold
        if isinstance(t, (float, np.floating)):
            if not 0 < t <= 1:
                raise ValueError(f"a fractional threshold must be in (0, 1], got {t!r}")
        elif isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 2:
            raise ValueError(f"threshold must be an integer t >= 2 (t = 1 would let the server unmask one user alone) or "
                             f"a fraction in (0, 1] of the round's clients, got {type(t).__name__} {t!r}; e.g. 2/3")
        if self.client_sizes is not None:
            self.client_sizes = tuple(_client_size(k, n) for k, n in enumerate(self.client_sizes))

    def _nothing_learned(self, msgs):
        """The round's messages when no sum is released (an aborted protocol, every update dropped): zeros in
        the masked layout (the update and its weight), no secure sum, so θ stays where it is."""
        m, d = len(msgs.client_ids), math.prod(msgs[self.key].shape[1:])
        msgs.tensors[self.key] = torch.zeros((m, d + 1), dtype=torch.int64)
        msgs.meta["secagg"] = None
        return msgs

    def _finite_clients(self, msgs, ctx):
        """The messages of the clients whose update is finite. Quantisation would turn NaN into 0 and clip inf, so
        a non-finite update is an error, or with on_nonfinite='drop' that client leaves the round before the
        protocol starts (as a client that drops out before sending its masked input)."""
        deltas = msgs[self.key].detach()
        bad = ~torch.isfinite(deltas.reshape(len(deltas), -1)).all(dim=1).cpu()
        if not bad.any():
            return msgs
        if ctx.on_nonfinite != "drop":
            raise ValueError(f"secure aggregation: client {int(msgs.client_ids[int(bad.nonzero()[0])])} sent a "
                             f"non-finite '{self.key}' (NaN or inf); fix its local training (a smaller lr, or clip "
                             "the update), or pass on_nonfinite='drop' to leave such clients out of the round")
        return msgs.select(~bad)

    def round_threshold(self, m: int) -> int:
        t = self.threshold if isinstance(self.threshold, (int, np.integer)) else math.ceil(self.threshold * m)
        return max(2, int(t))

    def __call__(self, msgs, cstate, ctx):
        finite = self._finite_clients(msgs, ctx)
        if len(finite.client_ids) == 0:  # every update non-finite and dropped: too few clients, as an abort
            if self.on_abort == "raise":
                raise SecAggAbort("secure aggregation: every client's update this round was non-finite and dropped "
                                  "(on_nonfinite='drop'), fewer than the threshold; the protocol aborts (pass "
                                  "on_abort='skip' to leave θ where it is)")
            return self._nothing_learned(msgs), {}
        msgs = finite
        ids = [int(k) for k in msgs.client_ids]
        deltas = msgs[self.key].detach().cpu().numpy()
        if self.client_sizes is not None and max(ids, default=-1) >= len(self.client_sizes):
            raise ValueError(f"secure aggregation: client_sizes has {len(self.client_sizes)} entries but client "
                             f"{max(ids)} takes part; pass one size per client of the federation (client_sizes="
                             "fed.sizes)")
        w = np.array([1 if self.client_sizes is None else self.client_sizes[k] for k in ids], dtype=np.int64)
        fp = FixedPoint(self.clip, self.scale, self.bits)
        fp.check_capacity(int(w.sum()))
        x = np.stack([np.append(fp.quantize(d, wk), np.uint64(wk)) for d, wk in zip(deltas, w)])
        instance = int(torch.randint(2 ** 62, (1,), generator=ctx.generator))
        drop = torch.rand(len(ids), generator=ctx.generator) < self.dropout
        t = self.round_threshold(len(ids))
        try:
            if len(ids) < t:  # too few clients to start: the protocol aborts (as when too many drop out)
                raise SecAggAbort(f"secure aggregation: the round has {len(ids)} client(s), fewer than the threshold "
                                  f"t={t}; the protocol aborts (sample at least {t} clients a round, lower threshold, "
                                  "or pass on_abort='skip' to leave θ where it is)")
            res = run_protocol(x, t, bits=self.bits, ids=ids, seed=instance,
                               dropouts=[k for k, d in zip(ids, drop.tolist()) if d])
        except SecAggAbort:
            if self.on_abort == "raise":
                raise
            return self._nothing_learned(msgs), {}
        self.last = res
        keep = torch.tensor([k in res.included for k in ids])
        out = msgs.select(keep)
        masked = np.stack([res.server.masked[k] for k in out.client_ids.tolist()])
        out.tensors[self.key] = torch.from_numpy(masked.view(np.int64).copy()).to(msgs[self.key].device)
        out.bytes = torch.tensor(res.bytes_sent([int(k) for k in out.client_ids]), dtype=torch.int64)
        out.meta["secagg"] = SecureSum(res.sum, fp, res.included)
        return out, {}


@dataclass
class SecureMean:
    """Rule: the weighted mean from the secure sum alone, Σ w_k q(Δ_k) / Σ w_k (ignores the plaintext
    weights and the masked rows; needs `SecureAggregation` as the method's last uplink transform)."""
    key: str = "secagg"
    uses_context = True

    def __call__(self, updates, weights=None, info=None):
        meta = {} if info is None or info.messages is None else info.messages.meta
        if self.key not in meta:
            raise ValueError("SecureMean needs the secure sum in msgs.meta['secagg']: add SecureAggregation as the "
                             "method's last uplink transform (with_secure_aggregation(method) does both)")
        s = meta[self.key]
        if s is None:  # the protocol aborted (on_abort="skip"): no update
            return torch.zeros(updates.shape[1] - 1, dtype=info.theta.dtype, device=info.theta.device)
        total = int(s.fixed_point.signed(s.values[-1:])[0])
        if total == 0:  # 0/0: every summed client holds no example
            raise ValueError(f"secure aggregation: the clients summed this round ({sorted(int(k) for k in s.included)}) "
                             "all have client_sizes 0, so their weighted mean is 0/0; give each client its number of "
                             "examples (client_sizes=fed.sizes), at least one of them > 0 in every round")
        mean = s.fixed_point.dequantize(s.values[:-1], total)
        return torch.as_tensor(mean, dtype=info.theta.dtype, device=info.theta.device)


def _client_size(k: int, n) -> int:
    """Client k's size n_k (its weight in the secure sum) as an int >= 0; a ValueError naming client_sizes and
    the client otherwise (a negative, fractional, NaN or non-number size)."""
    import numbers
    if hasattr(n, "item") and getattr(n, "ndim", getattr(n, "dim", lambda: 0)()) == 0:
        n = n.item()  # a 0-d tensor / numpy scalar (fed.sizes holds those)
    ok = not isinstance(n, bool) and (isinstance(n, numbers.Integral) or
                                      isinstance(n, numbers.Real) and math.isfinite(n) and float(n).is_integer())
    if not ok or n < 0:
        raise ValueError(f"secure aggregation: client_sizes[{k}] (client {k}) is {n!r}; each size must be a whole "
                         "number >= 0 (the client's number of examples: client_sizes=fed.sizes)")
    return int(n)


def with_secure_aggregation(method: Method, client_sizes=None, **secagg) -> Method:
    """`method` with its weighted mean computed under secure aggregation: a `SecureAggregation` uplink
    transform last and the `SecureMean` rule. Only linear aggregation can run on a secure sum: the rule
    must be `weighted_mean` with data-size (pass `client_sizes=fed.sizes`) or uniform weighting."""
    if method.rule is not weighted_mean or method.normalisation is not None:
        raise ValueError(f"method {method.name!r}: secure aggregation reveals only the sum, so the rule must be the "
                         "weighted mean without normalisation (robust rules need the individual updates)")
    if isinstance(method.weighting, UniformWeighting):
        client_sizes = None
    elif type(method.weighting) is DataSizeWeighting:
        if client_sizes is None:
            raise ValueError(f"method {method.name!r} weights clients by n_k: pass client_sizes=fed.sizes so each "
                             "client puts n_k·Δ_k and n_k inside the secure sum")
    else:
        raise ValueError(f"method {method.name!r}: weighting {type(method.weighting).__name__} is not supported "
                         "(data-size or uniform weights only)")
    transform = SecureAggregation(client_sizes=client_sizes, key=method.aggregate_key, **secagg)
    return dataclasses.replace(method, name=f"{method.name}+secagg", rule=SecureMean(),
                               uplink=(*method.uplink, transform))


@register("secure_aggregation", claims="secure_aggregation")
def secure_fedavg(client_sizes=None, *, threshold: float | int = 2 / 3, clip: float = 1.0, scale: float = 2.0 ** 16,
                  bits: int = 32, dropout: float = 0.0, on_abort: str = "raise", server_lr: float = 1.0) -> Method:
    """FedAvg whose server sees only the secure sum (Bonawitz et al. 2017). With `client_sizes=fed.sizes`
    the weights are n_k (plain FedAvg); without, every client weighs 1."""
    weighting = UniformWeighting() if client_sizes is None else DataSizeWeighting()
    base = Method("fedavg", weighting=weighting, rule=weighted_mean, server_opt=ServerSGD(lr=server_lr))
    return with_secure_aggregation(base, client_sizes, threshold=threshold, clip=clip, scale=scale, bits=bits,
                                   dropout=dropout, on_abort=on_abort)
