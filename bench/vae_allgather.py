"""All-gathered bytes per latent frame of the VAE decode, from the optimized HLO of a build.

The reference against which the gathered bytes are read (`upsampler_input_bytes`, printed
alone by `--reference`): a decoder that all-gathers each upsampler's input whole before its
nearest-neighbour resize receives, per device and latent frame, the bytes of all those inputs
(at 720p for the Wan 2.1 VAE in bf16: 553 MB; in float32 1.106 GB, the "~1.1 GB" quoted here
before, without a measurement behind it). Ours must stay <= 10% of it. The decode runs the first
latent frame alone and every later one through one scan body, so the figure per latent frame
is the larger of the first chunk's bytes and one scan trip's (the steady state of a long
video; the first chunk skips temporal upsampling). Gathered bytes are the all-gathers plus the
collective-permutes of XLA TPU's windowed einsums (`windowed_dot_general_body_ag` loops: an
all-gather done as a ring of permutes); conv halo exchanges are permutes too, but not gathers.

    .venv/bin/python bench/vae_allgather.py --target tpu-v6e-8 --res 1280x720 --res 720x1280

`--per-activation` compiles the alternative instead: every activation picks its own
axis (width where vae_spatial divides it, else height), which flips axis between pyramid
levels of a portrait video; the all-to-all count shows the flips.

    .venv/bin/python bench/vae_allgather.py --target tpu-v6e-8 --res 720x1280 --per-activation

    .venv/bin/python bench/vae_allgather.py --reference   # no compile

Each real-size compile takes 6-10 minutes and ~5.7 GB of memory on a 2-core host.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aot import hlo, targets  # noqa: E402
from aot.hlo import vae_gathers


def upsampler_input_bytes(config: Any, width: int, height: int) -> int:
    """Bytes of every upsampler's input in the decode of one latent frame (steady state: after
    each temporal upsampler the frames double), in the decode's dtype: what a decoder that
    gathers each upsampler's input whole receives per device. Upsampler i takes the output of
    up block i (`wan.models.vae.Decoder`: out_dim channels), at the latent size times 2**i."""
    import jax.numpy as jnp

    vae = config.vae
    mult = vae.dim_mult
    dims = [vae.base_dim * m for m in (mult[-1], *mult[::-1])]
    temporal = vae.temperal_downsample[::-1]
    h, w = height // vae.spatial_factor, width // vae.spatial_factor
    frames, elements = 1, 0
    for i in range(len(mult) - 1):  # every up block but the last ends in an upsampler
        frames *= 2 if temporal[i] else 1
        elements += dims[i + 1] * frames * (h << i) * (w << i)
    return elements * jnp.dtype(config.dtype).itemsize


def per_activation_constrain(vae_spatial: int) -> Callable[[Any, Any], Any]:
    """The alternative to choosing the axis once: each VAE activation picks its axis from its
    own shape (width where vae_spatial divides it, else height). A stand-in for `constrain`
    inside wan.models.vae, to show the all-to-alls that choosing once avoids."""
    from wan import sharding

    def constrain_per_activation(x: Any, logical: Any) -> Any:
        h, w = x.shape[2:4]  # VAE activations are (B, T, H, W, ...)
        with sharding.axis_rules(sharding.choose_vae_layout(h, w, vae_spatial).rules()):
            return sharding.constrain(x, logical)

    return constrain_per_activation


def compile_decode(
    preset: str, target: Any, width: int, height: int, latent_frames: int, vae_spatial: int
) -> tuple[Any, Any, tuple[int, int]]:
    """(compiled vae_decode, its VaeLayout, vae mesh) for one video of `preset`, as `aot build
    --vae-spatial` compiles it."""
    from aot import targets
    from aot.building import lower
    from aot.building import plan as planner
    from wan.configs import VideoShape
    from wan.presets import PRESETS

    shape = VideoShape(width, height, 4 * (latent_frames - 1) + 1, batch=1)
    devices = targets.devices(target)
    plan = planner.plan_build(
        preset, PRESETS[preset], shape, target, len(devices), vae_spatial=vae_spatial
    )
    (lowered,) = lower.lower_plan(plan, only={"vae_decode"})
    layout = plan.sharding_plan
    return lowered.compile(), layout.vae_layout, layout.vae_mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="wan2.1-t2v-14b")
    parser.add_argument("--target", default="tpu-v6e-8")
    parser.add_argument("--res", action="append", help="WxH, repeatable (default both 720p)")
    parser.add_argument("--latent-frames", type=int, default=3)
    parser.add_argument("--vae-spatial", type=int, default=8)
    parser.add_argument("--save-hlo", type=Path, help="folder for the optimized HLO texts")
    parser.add_argument(
        "--per-activation", action="store_true", help="each activation picks its own axis"
    )
    parser.add_argument(
        "--reference", action="store_true", help="print the reference bytes only (no compile)"
    )
    args = parser.parse_args()
    from wan.presets import PRESETS

    if args.reference:
        for res in args.res or ["1280x720", "720x1280"]:
            width, height = (int(v) for v in res.split("x"))
            ref = upsampler_input_bytes(PRESETS[args.preset], width, height)
            print(f"{res} {args.preset}: upsampler inputs per latent frame {ref / 1e6:.1f} MB")
        return
    target = targets.parse_target(args.target)
    targets.prepare_environment(target)
    choice = "per-activation" if args.per_activation else "once"
    if args.per_activation:
        from wan.models import vae

        vae.constrain = per_activation_constrain(args.vae_spatial)
    for res in args.res or ["1280x720", "720x1280"]:
        width, height = (int(v) for v in res.split("x"))
        start = time.perf_counter()
        compiled, layout, vae_mesh = compile_decode(
            args.preset, target, width, height, args.latent_frames, args.vae_spatial
        )
        seconds = time.perf_counter() - start
        text = compiled.as_text()
        reference = upsampler_input_bytes(PRESETS[args.preset], width, height)
        if args.save_hlo:
            args.save_hlo.mkdir(parents=True, exist_ok=True)
            (args.save_hlo / f"vae_decode_{res}_{args.target}.hlo.txt").write_text(text)
        g = vae_gathers.gathers(hlo.parse(text))
        print(
            f"{res} {args.target} vae mesh {vae_mesh} axis chosen {choice} ({layout.axis}) "
            f"latent_frames={args.latent_frames} compile={seconds:.0f}s: gathered first chunk "
            f"{g.first / 1e6:.1f} MB, per scan trip {g.per_trip / 1e6:.1f} MB x {g.trips}; "
            f"per latent frame {g.per_latent_frame / 1e6:.1f} MB = "
            f"{100 * g.per_latent_frame / reference:.1f}% of the upsampler inputs' "
            f"{reference / 1e6:.1f} MB; "
            f"all-to-all {g.all_to_all}",
            flush=True,
        )
        for name, n in g.top:
            print(f"    {n / 1e6:10.1f} MB  {name}", flush=True)


if __name__ == "__main__":
    main()
