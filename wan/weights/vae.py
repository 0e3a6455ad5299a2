"""Weight rules: diffusers `AutoencoderKLWan` state dict -> `wan.models.vae.WanVAE` (the decode half,
the VAE component of a model) and `wan.models.vae_encoder.WanVAEEncoder` (the encode half).

The module trees mirror diffusers' names, so the mapping is mechanical: `weight` -> `kernel`
(every weight is a conv; diffusers' per-frame Conv2d layers are (1, kh, kw) Conv3d here), the
RMS-norm gains (C, 1, 1[, 1]) -> (C,), and the Conv2d inside `resample` (index 1 of diffusers'
nn.Sequential, after the upsampling or padding) is the `resample` conv itself.
"""

from __future__ import annotations

import numpy as np

from wan.weights import Target, conv2d, conv3d

ENCODER_MODULES = ("encoder", "quant_conv")  # diffusers' encode half: not the VAE component's


def kernel(w: np.ndarray) -> np.ndarray:
    """torch Conv3d, or Conv2d applied per frame, -> flax (t, h, w, in, out)."""
    return conv3d(w) if w.ndim == 5 else conv2d(w)[None]


def gain(w: np.ndarray) -> np.ndarray:
    return w.reshape(-1)


def _target(name: str) -> Target:
    """One diffusers tensor's parameter (unknown names map to paths the model lacks, which the
    importer reports)."""
    *module, leaf = name.replace(".resample.1.", ".resample.").split(".")
    if leaf == "weight":
        return Target((*module, "kernel"), transform=kernel)
    if leaf == "gamma":
        return Target((*module, "gamma"), transform=gain)
    return Target((*module, leaf))


def _of_encoder(name: str) -> bool:
    return name.partition(".")[0] in ENCODER_MODULES


def rule(name: str) -> Target | None:
    """The decode half's parameter of one diffusers tensor; the encoder's tensors, which a
    diffusers folder holds too, have none here (skipped)."""
    return None if _of_encoder(name) else _target(name)


def encoder_rule(name: str) -> Target | None:
    """The encode half's parameter of one diffusers tensor; the decoder's have none here."""
    return _target(name) if _of_encoder(name) else None
