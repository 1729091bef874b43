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


def whole(text: str) -> int:
    """A whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def positive_list(text: str) -> str:
    """Comma-separated whole numbers >= 1 (e.g. hidden widths '64,32'), kept as the text the script splits."""
    for part in text.split(","):
        positive(part)
    return text


def device(text: str) -> str:
    """'cpu', or a CUDA device that torch sees here."""
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: torch sees no CUDA device here; use cpu or run on a GPU machine")
    return "cpu" if dev.type == "cpu" else str(dev)
