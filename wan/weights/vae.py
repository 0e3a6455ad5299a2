"""Weight rule: diffusers `AutoencoderKLWan` state dict -> `wan.vae.WanVAE`.

The module tree mirrors diffusers' names, so the mapping is mechanical: `weight` -> `kernel`
(every weight is a conv; diffusers' per-frame Conv2d layers are (1, kh, kw) Conv3d here), the
RMS-norm gains (C, 1, 1[, 1]) -> (C,), and the Conv2d inside `resample` (index 1 of diffusers'
nn.Sequential, after the upsampling or padding) is the `resample` conv itself.
"""

from __future__ import annotations

import numpy as np

from wan.weights import Target, conv2d, conv3d


def kernel(w: np.ndarray) -> np.ndarray:
    """torch Conv3d, or Conv2d applied per frame, -> flax (t, h, w, in, out)."""
    return conv3d(w) if w.ndim == 5 else conv2d(w)[None]


def gain(w: np.ndarray) -> np.ndarray:
    return w.reshape(-1)


def rule(name: str) -> Target:
    """Map one diffusers tensor name to its parameter (unknown names map to paths the model
    lacks, which the importer reports)."""
    *module, leaf = name.replace(".resample.1.", ".resample.").split(".")
    if leaf == "weight":
        return Target((*module, "kernel"), transform=kernel)
    if leaf == "gamma":
        return Target((*module, "gamma"), transform=gain)
    return Target((*module, leaf))
