"""Sparse self-attention as a build chooses it (`aot build --sparse-attention`): the one place
its settings are defined and spelled. No jax: the runtime reads them to pick each step's program.

`radial` is Radial Attention's static mask (wan.models.radial_mask): the first `dense_steps`
steps of a generation and the first `dense_layers` blocks of every step stay dense, as in the
official Wan script; the other steps run `radial_step`, whose remaining blocks attend through
the mask of `block`-token blocks and temporal `decay`. A block left out is the kernel's own,
which the build resolves (`aot.building.plan.choose_radial`): the official 128 where the kernel's blocks
fit in it, 1024 on TPU, whose kernels compute a block kept whole unmasked and lose time on
partly kept ones.
"""

from __future__ import annotations

import dataclasses

from wan.errors import InputError

NONE = "none"
RADIAL = "radial"
# Official Wan 2.1 T2V 14B settings: mit-han-lab/radial-attention scripts/wan_t2v_inference.sh
# and radial_attn/models/wan/attention.py at 72788d4f0a6d202f1ec5f1c98a6e4c8b2e34fdbc.
WAN_DECAY = 0.2  # --decay_factor 0.2
WAN_DENSE_STEPS = 12  # --dense_timesteps 12: the first 12 of --num_inference_steps 50
WAN_DENSE_LAYERS = 1  # --dense_layers 1: transformer block 0 stays dense
WAN_BLOCK = 128  # block_size=128
FLAG_HELP = (
    "none, or radial[:<decay>[:<dense_steps>[:<dense_layers>[:<block>]]]]: Radial Attention's "
    f"static mask in the video self-attention (defaults: decay {WAN_DECAY}, the first "
    f"{WAN_DENSE_STEPS} steps and {WAN_DENSE_LAYERS} block dense, as the official Wan script; "
    f"blocks of the kernel's: {WAN_BLOCK} tokens as the official one, 1024 on TPU). A "
    "build then also holds radial_step, run after the dense steps."
)


class SparseAttentionError(InputError):
    """A --sparse-attention value that cannot be built; the message says what to give."""


@dataclasses.dataclass(frozen=True)
class Radial:
    """Radial Attention's build-time settings."""

    decay: float = WAN_DECAY
    dense_steps: int = WAN_DENSE_STEPS
    dense_layers: int = WAN_DENSE_LAYERS
    block: int | None = None  # None: the kernel's, resolved by the build

    def __post_init__(self) -> None:
        if not (0 < self.decay <= 1e6) or min(self.dense_steps, self.dense_layers) < 0:
            raise SparseAttentionError(f"{self.text()}: {_WANTED}")
        if self.block is not None and (
            not (8 <= self.block <= 1 << 16) or self.block & (self.block - 1)
        ):
            raise SparseAttentionError(f"{self.text()}: the block must be a power of two >= 8")

    def text(self) -> str:
        """The canonical spelling (every setting given), as the manifest records it."""
        block = "" if self.block is None else f":{self.block}"
        return f"{RADIAL}:{self.decay:g}:{self.dense_steps}:{self.dense_layers}{block}"

    def dense_step(self, step: int) -> bool:
        """Whether generation step `step` (from 0) runs dense."""
        return step < self.dense_steps


_WANTED = (
    "give --sparse-attention none or radial[:<decay>[:<dense_steps>[:<dense_layers>[:<block>]]]] "
    "(decay > 0, step and layer counts >= 0)"
)
DEFAULT_RADIAL = Radial()


def parse(text: str) -> Radial | None:
    """--sparse-attention's text -> its settings (None: dense attention)."""
    if text == NONE:
        return None
    kind, *fields = text.split(":")
    if kind != RADIAL or len(fields) > 4:
        raise SparseAttentionError(f"--sparse-attention {text[:60]!r}: {_WANTED}")
    types = (float, int, int, int)
    try:
        values = [convert(field) for convert, field in zip(types, fields, strict=False)]
    except ValueError:
        raise SparseAttentionError(f"--sparse-attention {text[:60]!r}: {_WANTED}") from None
    return Radial(*values)


def canonical(text: str) -> str:
    """The manifest's spelling of a --sparse-attention value (checked)."""
    settings = parse(text)
    return NONE if settings is None else settings.text()
