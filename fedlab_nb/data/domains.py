"""Offline domain variants of an image data set (rows of flat pixels in [0, 1]): rotations, additive noise and
inversion. They build the shifted and unseen domains of the merging, ensembling and domain-generalisation
notebooks from MNIST-5k or digits, with no download (rotations by `scipy.ndimage.rotate`)."""
from __future__ import annotations

import numpy as np
import torch
from scipy import ndimage


def _images(x: torch.Tensor, input_shape) -> np.ndarray:
    h, w = input_shape[-2:]
    if x.ndim != 2 or x.shape[1] != int(np.prod(input_shape)):
        raise ValueError(f"x must be [n, {int(np.prod(input_shape))}] flat images of shape {tuple(input_shape)}, "
                         f"got {tuple(x.shape)}")
    return x.detach().cpu().numpy().reshape(len(x), h, w)


def rotate(x: torch.Tensor, input_shape, degrees: float) -> torch.Tensor:
    """Each image rotated by `degrees` (counter-clockwise, same size, bilinear, zero fill), clipped to [0, 1]."""
    imgs = ndimage.rotate(_images(x, input_shape), degrees, axes=(2, 1), reshape=False, order=1, mode="constant")
    return torch.from_numpy(np.clip(imgs, 0, 1).reshape(len(x), -1)).to(x.dtype)


def add_noise(x: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """x + N(0, std²) per pixel, clipped to [0, 1] (the noise comes from `generator`)."""
    if not std >= 0:
        raise ValueError(f"std must be >= 0, got {std}")
    return (x + std * torch.randn(x.shape, generator=generator, dtype=x.dtype)).clamp(0, 1)


def invert(x: torch.Tensor) -> torch.Tensor:
    """1 − x: white digits become black on white."""
    return 1 - x
