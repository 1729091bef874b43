"""argparse types shared by the benchmark scripts: a bad value stops with a one-line message naming it."""
from __future__ import annotations

import argparse

BACKENDS = ("loop", "vmap", "fused")


def positive(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def backends(text: str) -> str:
    """Comma-separated backends of simulate."""
    unknown = [b for b in text.split(",") if b not in BACKENDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{','.join(unknown)!r} is not a backend; choose from {','.join(BACKENDS)}")
    return text
