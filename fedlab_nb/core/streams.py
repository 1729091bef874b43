"""Random-stream ids: every draw in a run comes from `rng(seed, stream_id, round, client...)`.

One table, so no two purposes share an id (a shared id would make, say, the attack noise equal the
batch order). A method that needs its own stream registers it here by name at import time."""
from __future__ import annotations

STREAMS: dict[str, int] = {}


def register_stream(name: str, stream_id: int) -> int:
    """Reserve `stream_id` for `name` (idempotent for the same pair); a clash raises ValueError."""
    for other, sid in STREAMS.items():
        if sid == stream_id and other != name:
            raise ValueError(f"random stream id {stream_id} is already used by {other!r}; pick a free id for {name!r}")
    if STREAMS.get(name, stream_id) != stream_id:
        raise ValueError(f"random stream {name!r} is already registered with id {STREAMS[name]}")
    STREAMS[name] = int(stream_id)
    return int(stream_id)


SAMPLE = register_stream("sample", 1)          # which clients take part in a round
BATCHES = register_stream("batches", 2)        # each client's mini-batch order
STRAGGLE = register_stream("straggle", 3)      # which clients straggle, and how much work they do
ATTACK = register_stream("attack", 4)          # randomness of Byzantine messages
GAS_SPLIT = register_stream("gas_split", 5)    # GAS's random coordinate split
TRANSFORM = register_stream("transform", 6)    # randomness of uplink transforms (DP noise, QSGD ...)
DOWNLINK = register_stream("downlink", 7)      # randomness of downlink (server → client) compression
POISON = register_stream("poison", 8)          # which rows a data-poisoning client alters in a round
