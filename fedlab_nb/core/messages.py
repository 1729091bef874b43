"""Messages: what clients put on the wire, as named tensors plus metadata, and the transforms on the way.

A round's messages travel as one `Messages` batch: each entry a tensor `[m, ...]` (row i = client i's),
`bytes` the measured wire size of each client's message. The default encoding is dense: the raw buffer of
every entry (`encode` writes exactly those bytes, so `bytes` is measured, not computed from a formula).
A compressing transform replaces entries by what the server decodes and sets `bytes` from its payload."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Messages:
    tensors: dict                       # name → [m, ...] tensor
    client_ids: np.ndarray              # [m]
    bytes: torch.Tensor | None = None   # [m] int64 wire size, None = dense (measured by `wire_bytes`)
    meta: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def select(self, keep: torch.Tensor) -> "Messages":
        """The messages of the rows where the bool mask `keep` [m] is true."""
        k = keep.cpu().numpy()
        return Messages({n: t[keep] for n, t in self.tensors.items()}, self.client_ids[k],
                        None if self.bytes is None else self.bytes[keep], dict(self.meta))

    def wire_bytes(self) -> torch.Tensor:
        """[m] bytes each client sends: the transforms' measured sizes, else the dense encoding's length."""
        if self.bytes is not None:
            return self.bytes
        m = len(self.client_ids)
        one = dense_bytes({n: t[0] for n, t in self.tensors.items()}) if m else 0  # = len(encode(row)), no copy
        return torch.full((m,), one, dtype=torch.int64)


def encode(tensors: dict) -> bytes:
    """The dense wire format of one message: each tensor's raw little-endian buffer, in name order."""
    return b"".join(np.ascontiguousarray(tensors[n].detach().cpu().numpy()).tobytes() for n in sorted(tensors))


def dense_bytes(tensors: dict) -> int:
    """Length of `encode(tensors)` without building it (numel × element size, summed)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Transform:
    """An uplink (client → server) or downlink step on a round's messages, e.g. clip, noise, compress, attack.

    `client_state(theta)`: defaults of per-client store entries it keeps (error-feedback residuals,
    worker momentum), `{}` if none. `__call__(msgs, cstate, ctx)` → (msgs, new cstate) on the batch of
    the round's clients; it sets `msgs.bytes` when it changes the encoding."""

    def client_state(self, theta: torch.Tensor) -> dict:
        return {}

    def __call__(self, msgs: Messages, cstate: dict, ctx) -> tuple[Messages, dict]:
        raise NotImplementedError


class DownlinkTransform:
    """A server → clients step on the broadcast model (downlink compression). The server keeps what the
    clients hold, θ̂, in its own (checkpointed) state; every sampled client receives the same payload.

    `init_state(theta, num_clients)`: that state (e.g. θ̂ = θ₀ and an error-feedback residual).
    `__call__(theta, state, generator) -> (θ̂, state, payload bytes per client)`: clients train from θ̂, the
    server still applies their updates to its own θ."""

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        return {}

    def __call__(self, theta: torch.Tensor, state: dict, generator: torch.Generator):
        raise NotImplementedError


@dataclass
class TransformContext:
    """What a transform may use: the round, its clients, the Byzantine mask of those clients, a generator,
    what the server broadcast this round (`down`: θ and e.g. an adaptive clip norm) and the run's
    `on_nonfinite` ("raise" or "drop": what to do with a client whose message is NaN or inf)."""
    round: int
    client_ids: np.ndarray
    byzantine: torch.Tensor       # bool [m]
    generator: torch.Generator
    theta: torch.Tensor
    down: dict = field(default_factory=dict)
    on_nonfinite: str = "raise"
