"""Small shared helpers: device choice and seeded random streams."""
from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable, Mapping

import numpy as np
import torch


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`"auto"` picks CUDA, then MPS, then CPU; anything else is passed to `torch.device`."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a device; use 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for CUDA, but torch sees no GPU; use device='cpu' or 'auto'")
    return dev


def check_loss(loss) -> None:
    """`simulate(loss=...)`: None or a torch.nn.functional-style loss `(outputs, y, reduction='mean')` (the engine
    evaluates with reduction='sum' and the vmap backend trains with reduction='none')."""
    if loss is None:
        return
    if isinstance(loss, torch.nn.Module) or not callable(loss):
        raise TypeError(f"loss must be a torch.nn.functional-style function (outputs, y, reduction='mean'), e.g. "
                        f"torch.nn.functional.mse_loss, got {type(loss).__name__}")
    try:
        params = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):  # a builtin without a readable signature: taken as given
        return
    if not any(p.name == "reduction" or p.kind is p.VAR_KEYWORD for p in params):
        raise TypeError("loss has no reduction= argument; the engine calls it with reduction='sum' (evaluation) and "
                        "'none' (vmap): write it as def my_loss(outputs, y, reduction='mean') returning the mean, sum "
                        "or per-row values")


def rng(*keys: int) -> np.random.Generator:
    """A numpy generator keyed by integers, e.g. rng(seed, round, client): the same keys give the same stream
    on every backend and after a resume, so no generator state has to be checkpointed."""
    keys = [int(k) for k in keys]
    if all(0 <= k < 2**32 for k in keys):  # one uint32 word per key: the same entropy as the list, 2.4x faster
        keys = np.array(keys, dtype=np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(keys)))


def check_number(name: str, value, low: float = -math.inf, high: float = math.inf, fix: str = "", *,
                 closed_low: bool = False) -> float:
    """A finite real number (Python's or numpy's) with low < value < high (low <= value with closed_low): text,
    None, a bool, NaN or inf is refused with a ValueError naming `name` (and the fix), never coerced."""
    number = _as_float(value)  # the bounds hold for the float the caller computes with (1/10**400 is 0.0)
    fits = number is not None and math.isfinite(number) and (low <= number if closed_low else low < number)
    if not (fits and number < high):
        bounds = " and ".join(b for b in (f"{'>=' if closed_low else '>'} {low:g}" if low > -math.inf else "",
                                          f"< {high:g}" if high < math.inf else "") if b)
        raise ValueError(f"{name} must be a finite number{' ' + bounds if bounds else ''}, got "
                         f"{type(value).__name__} {value!r:.40}" + (f"; {fix}" if fix else ""))
    return number


def _as_float(value) -> float | None:
    """value as a float, None when it is not a real number (text, None, a bool); inf past float64 (10**400)."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        return None
    try:
        return float(value)
    except OverflowError:  # a Python int or Fraction past float64
        return math.inf


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


MAX_RELEASED_VALUES = 10 ** 8   # 800 MB of float64 noise: the most one call of a private release draws


def check_draws(draws, values_per_draw: int) -> int:
    """`draws` independent releases of `values_per_draw` noised values each: a whole number >= 1 whose
    [draws, values] array fits in memory (2**40 would be a bare MemoryError deep in numpy)."""
    draws = check_positive_int("draws (independent releases)", draws)
    if draws * max(int(values_per_draw), 1) > MAX_RELEASED_VALUES:  # no values yet: draws alone are bounded
        raise ValueError(f"draws = {draws} releases of {values_per_draw} values are {draws * int(values_per_draw):,} "
                         f"values, over the {MAX_RELEASED_VALUES:,} one call draws; draw fewer (or call it again)")
    return draws


MAX_SEED = 2 ** 63  # numpy's SeedSequence and torch.manual_seed take it; a larger one overflows deep inside


def check_seed(value, name: str = "seed") -> int:
    """A seed: an integer in [0, 2^63), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < MAX_SEED:
        raise ValueError(f"{name} must be an integer >= 0 (and < 2^63), got {type(value).__name__} {value!r}; e.g. {name}=0")
    return int(value)


def check_seeds(seeds, name: str = "seeds") -> list[int]:
    """A list of seeds (each as `check_seed`): a string ('12' would be seeds 1 and 2), a float (1.9) or a bool
    is refused, never truncated."""
    if isinstance(seeds, (str, bytes, Mapping)) or not isinstance(seeds, Iterable):
        raise ValueError(f"{name} must be a list of integer seeds, e.g. range(5), got {seeds!r:.60}")
    seeds = list(seeds)
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < MAX_SEED]
    if bad:
        raise ValueError(f"{name} must be whole numbers >= 0 (ints), got {bad[:3]!r:.60}; e.g. {name}=range(5)")
    return [int(s) for s in seeds]


def loglog_slope(x, y) -> float:
    """Least-squares slope of log y against log x (float64): the measured rate of a power law."""
    lx = torch.log(torch.as_tensor(x, dtype=torch.float64))
    ly = torch.log(torch.as_tensor(y, dtype=torch.float64))
    lx = lx - lx.mean()
    return float((lx * (ly - ly.mean())).sum() / (lx * lx).sum())
