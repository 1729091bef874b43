"""Semi-supervised federated data: each client labels only a fraction of its training rows.

The "labels-at-clients" setting of semi-supervised FL (e.g. Jeong et al., "Federated Semi-Supervised Learning
with Inter-Client Consistency & Disjoint Learning", ICLR 2021; Cho, Joshi, Dimitriadis, "Local or Global:
Selective Knowledge Assimilation for Federated Learning with Limited Labels", ICCV 2023): no server labels, no
fully labelled client; every client holds a small labelled set and a larger unlabelled one.

- `labelled_masks(fed, fraction, seed)`: per client, which training rows keep their label — stratified by
  class inside the client (largest-remainder allocation of round(fraction · n_k) labels, at least one per
  client), the rows of each class drawn with a generator keyed by (seed, stream "fedlabel" = 62, client);
  FedLabel's per-round draws use the same stream with the longer key (seed, 62, round, client).
- `SemiSupervisedDataset` / `semi_supervised(fed, fraction, seed)`: a `FederatedDataset` whose
  `client_train` holds the labelled rows only (so any method run on it, e.g. FedAvg, is "FedAvg on the
  labelled data"), with the unlabelled inputs in `client_unlabelled[k] = (x_u, y_u)`. `y_u` is the hidden
  ground truth, kept for diagnostics (pseudo-label accuracy); a method must never train on it.
- `weak_augment` / `strong_augment`: FixMatch-style views (Sohn et al., NeurIPS 2020) written in torch for
  image rows of any `input_shape` (C, H, W): weak = a random shift of up to ±`max_shift` pixels (zero fill);
  strong = that shift, then Gaussian noise and one randomly erased rectangle (Zhong et al., AAAI 2020).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..core.streams import register_stream
from ..utils import rng
from .federated import FederatedDataset

SEMISUP_SPLIT = register_stream("fedlabel", 62)  # shared with methods/labels/fedlabel.py, keys of other length


def _check_fraction(fraction) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction (the labelled share of each client's rows) must be in (0, 1], e.g. 0.1, "
                         f"got {fraction!r}")
    return float(fraction)


def stratified_counts(class_counts: np.ndarray, fraction: float) -> np.ndarray:
    """How many rows of each class to label: round(fraction · n) labels in all (at least 1 when n > 0),
    shared out over the classes in proportion to their counts (largest remainder, ties to the lower class)."""
    class_counts = np.asarray(class_counts, dtype=np.int64)
    n = int(class_counts.sum())
    total = min(n, max(1, int(round(fraction * n)))) if n else 0
    quota = class_counts * (total / n) if n else np.zeros(len(class_counts))
    counts = np.floor(quota).astype(np.int64)
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    return np.minimum(counts, class_counts)


def labelled_masks(fed: FederatedDataset, fraction: float, seed: int = 0) -> list[np.ndarray]:
    """One boolean array per client, aligned with `fed.train_idx[k]`: True = the row keeps its label."""
    fraction = _check_fraction(fraction)
    y_all, masks = fed.dataset.y_train.numpy(), []
    for k, idx in enumerate(fed.train_idx):
        y, g = y_all[idx], rng(seed, SEMISUP_SPLIT, k)
        counts = stratified_counts(np.bincount(y, minlength=fed.num_classes), fraction)
        mask = np.zeros(len(idx), dtype=bool)
        for c in np.flatnonzero(counts):
            mask[g.choice(np.flatnonzero(y == c), counts[c], replace=False)] = True
        masks.append(mask)
    return masks


class SemiSupervisedDataset(FederatedDataset):
    """A federation whose clients keep labels only on `masks` (see the module docstring).

    `client_train[k]`: the labelled rows (x_l, y_l); `client_unlabelled[k]`: (x_u, y_u) with y_u hidden truth;
    `client_test`, `x_test`, `y_test` as in `fed`. `full` is the fully labelled federation it came from."""

    def __init__(self, fed: FederatedDataset, masks):
        if len(masks) != fed.num_clients:
            raise ValueError(f"masks must have one entry per client ({fed.num_clients}), got {len(masks)}")
        for k, (m, idx) in enumerate(zip(masks, fed.train_idx)):
            m = np.asarray(m)
            if m.dtype != bool or m.shape != (len(idx),):
                raise ValueError(f"masks[{k}] must be a boolean array of client {k}'s {len(idx)} training rows, "
                                 f"got dtype {m.dtype} and shape {m.shape}")
            if not m.any():
                raise ValueError(f"client {k} has no labelled row; raise the fraction or label at least one row")
        self.full, self.masks = fed, [np.asarray(m) for m in masks]
        self.dataset, self.partition, self.device = fed.dataset, fed.partition, fed.device
        self.train_idx = [idx[m] for idx, m in zip(fed.train_idx, self.masks)]
        self.unlabelled_idx = [idx[~m] for idx, m in zip(fed.train_idx, self.masks)]
        self.test_idx = fed.test_idx
        self._materialise()

    def _materialise(self):
        super()._materialise()
        self.client_unlabelled = [self._client_rows(k, idx) for k, idx in enumerate(self.unlabelled_idx)]

    @property
    def labelled_fraction(self) -> np.ndarray:
        """Per client, the share of its training rows that are labelled."""
        return np.array([m.mean() for m in self.masks])

    def __repr__(self) -> str:
        n_l, n_u = self.sizes.sum(), sum(len(i) for i in self.unlabelled_idx)
        return f"SemiSupervised({super().__repr__()}, labelled {n_l}, unlabelled {n_u})"


def semi_supervised(fed: FederatedDataset, fraction: float, seed: int = 0) -> SemiSupervisedDataset:
    """`fed` with each client's labels kept on a stratified `fraction` of its training rows (keyed by seed)."""
    return SemiSupervisedDataset(fed, labelled_masks(fed, fraction, seed))


# --- augmentations --------------------------------------------------------------------------------------
def _images(x: torch.Tensor, input_shape) -> torch.Tensor:
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3 or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be (channels, height, width) of an image, got {input_shape!r}")
    if x.dim() < 1 or math.prod(x.shape[1:]) != math.prod(shape):
        raise ValueError(f"x must hold rows of {math.prod(shape)} values (input_shape {shape}), got shape "
                         f"{tuple(x.shape)}")
    return x.reshape(len(x), *shape)


def _check_generator(generator):
    if not isinstance(generator, torch.Generator):
        raise ValueError("generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)) so that "
                         f"the augmentation is reproducible, got {type(generator).__name__}")


def random_shift(x: torch.Tensor, input_shape, generator: torch.Generator, max_shift: int = 1) -> torch.Tensor:
    """Each row shifted by its own (dy, dx), uniform in {−max_shift … max_shift}², pixels shifted in from
    outside are 0. Same shape as `x`."""
    _check_generator(generator)
    if isinstance(max_shift, bool) or not isinstance(max_shift, int) or max_shift < 0:
        raise ValueError(f"max_shift must be an integer >= 0 (pixels), got {max_shift!r}")
    img = _images(x, input_shape)
    n, c, h, w = img.shape
    if max_shift == 0 or n == 0:
        return x.clone()
    d = torch.randint(-max_shift, max_shift + 1, (n, 2), generator=generator).to(x.device)
    p = max_shift
    padded = torch.nn.functional.pad(img, (p, p, p, p))
    rows = (torch.arange(h, device=x.device)[None, :] + p - d[:, :1])  # [n, h]: the source row of each pixel
    cols = (torch.arange(w, device=x.device)[None, :] + p - d[:, 1:])  # [n, w]
    out = padded[torch.arange(n, device=x.device)[:, None, None, None], torch.arange(c, device=x.device)[None, :, None, None],
                 rows[:, None, :, None], cols[:, None, None, :]]
    return out.reshape(x.shape)


def random_erase(x: torch.Tensor, input_shape, generator: torch.Generator, scale=(0.1, 0.3),
                 value: float = 0.0) -> torch.Tensor:
    """Each row with one axis-aligned rectangle (all channels) set to `value`; the rectangle covers a share
    of the image uniform in `scale`, with a random aspect (side ratio in [1/2, 2]) and a uniform position."""
    _check_generator(generator)
    lo, hi = scale
    if not 0 < lo <= hi <= 1:
        raise ValueError(f"scale must be (low, high) with 0 < low <= high <= 1 (share of the image), got {scale!r}")
    img = _images(x, input_shape)
    n, c, h, w = img.shape
    area = (lo + (hi - lo) * torch.rand(n, generator=generator)) * h * w
    aspect = torch.exp((torch.rand(n, generator=generator) * 2 - 1) * math.log(2))
    eh = torch.sqrt(area * aspect).round().clamp(1, h).long()
    ew = torch.sqrt(area / aspect).round().clamp(1, w).long()
    top = (torch.rand(n, generator=generator) * (h - eh + 1)).long()
    left = (torch.rand(n, generator=generator) * (w - ew + 1)).long()
    r, q = torch.arange(h)[None, :], torch.arange(w)[None, :]
    inside_r = (r >= top[:, None]) & (r < (top + eh)[:, None])
    inside_c = (q >= left[:, None]) & (q < (left + ew)[:, None])
    box = (inside_r[:, :, None] & inside_c[:, None, :]).to(x.device)[:, None]  # [n, 1, h, w]
    return torch.where(box, torch.as_tensor(value, dtype=x.dtype, device=x.device), img).reshape(x.shape)


def weak_augment(x: torch.Tensor, input_shape, generator: torch.Generator, max_shift: int = 1) -> torch.Tensor:
    """The weak view: a random shift of up to ±`max_shift` pixels per row (FixMatch's weak augmentation
    without the flip, which would change a digit's class)."""
    return random_shift(x, input_shape, generator, max_shift)


def strong_augment(x: torch.Tensor, input_shape, generator: torch.Generator, max_shift: int = 1,
                   noise_std: float = 0.1, erase_scale=(0.1, 0.3), clip=(0.0, 1.0)) -> torch.Tensor:
    """The strong view: a random shift, Gaussian pixel noise of sd `noise_std` (then clipped to `clip`, None
    = no clipping) and one random erasing per row. A stand-in for RandAugment + Cutout at toy scale."""
    if isinstance(noise_std, bool) or not isinstance(noise_std, (int, float)) or noise_std < 0:
        raise ValueError(f"noise_std must be a number >= 0, got {noise_std!r}")
    out = random_shift(x, input_shape, generator, max_shift)
    if noise_std > 0:
        noise = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(out.device)
        out = out + noise_std * noise
        if clip is not None:
            out = out.clamp(*clip)
    return random_erase(out, input_shape, generator, erase_scale)
