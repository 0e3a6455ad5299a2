"""Radial attention's lower bounds at a real shape, from a dense build's FLOPs: the mask's
density for each kernel block (wan.models.radial_mask), the self-attention FLOPs a block-sparse
kernel then computes per step, and the step and run lower bounds they give, dense, radial,
radial with 8-bit attention and with 8-bit Linear layers too. A projection of the mask on a
dense build, not a build with the mask: its figures are what `aot build --sparse-attention`
must reach, counted the same way.

    python bench/radial_attention.py --targets tpu-v6e-8 tpu7x-8

The dense build's FLOPs per device (HLO, splash kernels, the 8-bit dots of a w8a8 build) are
rows of bench/memory_table.py's results (`--flops-from`, `--quant-from`), each naming its
command. Per step: self-attention 4 * B' * S^2 * H * D per layer (B' = videos x 2 with CFG),
of which the first `--dense-layers` stay dense; cross-attention (text keys) stays dense. The
run: the first `--dense-steps` of `--steps` dense, the rest radial. 8-bit attention: Q K^T at
the 8-bit rate, P V at it where the 8-bit format is fp8 (tpu7x), else at bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from record import save

from aot.targets import parse_target
from wan.configs import VideoShape
from wan.models.attention import SPLASH_LANES, balanced_block, flops
from wan.models.radial_mask import RadialSpec, density
from wan.presets import resolve_model
from wan.sparse_attention import WAN_DENSE_LAYERS, WAN_DENSE_STEPS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def dense_row(path: Path, model: str, target: str, res: str, frames: int, quant: str) -> dict:
    """The splash build's row of a memory_table results file."""
    for row in json.loads(path.read_text())["rows"]:
        if (row["model"], row["target"], row["res"], row["frames"], row["batch"]) == (
            model, target, res, frames, 1,
        ) and row["attention"].startswith("splash") and row.get("quant", "none") == quant:  # fmt: skip
            return row
    raise SystemExit(f"{path}: no splash row of {model} {target} {res} f{frames} B=1 {quant}")


def splash_blocks(attention: str, tokens: int) -> tuple[int, int]:
    """The query and key blocks a splash build runs at `tokens` (balanced as it balances)."""
    q, kv, _ = (int(n) for n in attention.split(":")[1:])
    return balanced_block(tokens, q, SPLASH_LANES), balanced_block(tokens, kv, SPLASH_LANES)


def bounds(args: argparse.Namespace, target: str) -> dict:
    config = resolve_model(args.model)
    width, height = (int(n) for n in args.res.split("x"))
    shape = VideoShape(width, height, args.frames, 1)
    _, frames, rows, cols, _ = shape.latent_shape(config)
    grid = config.transformer.patch_grid((frames, rows, cols))
    spec = RadialSpec(frames=grid[0], tokens_per_frame=grid[1] * grid[2])
    t = config.transformer
    row = dense_row(args.flops_from, args.model, target, args.res, args.frames, "none")
    devices = math.prod(row["mesh"].values())
    per_layer = flops((shape.step_batch, spec.tokens, t.num_attention_heads, t.attention_head_dim),
                      spec.tokens) / devices / 1e12  # fmt: skip
    self_dense = per_layer * t.num_layers
    step = row["programs"]["denoise_step"]
    hlo, kernels = step["tflops"], step["kernel_tflops"]
    cross = kernels - self_dense  # the text keys' attention, which stays dense
    if not 0 <= cross < 0.05 * kernels:
        raise SystemExit(
            f"the build's kernel FLOPs {kernels} do not hold self-attention's {self_dense}"
        )
    chip = parse_target(target).chip
    quant_scheme = args.quant or f"w8a8-{chip.eight_bit}"
    quant = dense_row(args.quant_from, args.model, target, args.res, args.frames, quant_scheme)
    eight_bit_linear = quant["programs"]["denoise_step"]["eight_bit_tflops"]
    bf16, eight = chip.peak_bf16 / 1e12, chip.peak_8bit / 1e12
    pv_rate = eight if chip.eight_bit == "fp8" else bf16

    def seconds(self_tflops: float, attention_8bit: bool, linear_8bit: bool) -> float:
        attention = cross + self_tflops
        t_attention = (attention / 2 / eight + attention / 2 / pv_rate) if attention_8bit else (
            attention / bf16)  # fmt: skip
        t_linear = (hlo - eight_bit_linear) / bf16 + eight_bit_linear / eight if linear_8bit else (
            hlo / bf16)  # fmt: skip
        return t_attention + t_linear

    blocks = {"splash": splash_blocks(row["attention"], spec.tokens)}
    for b in args.blocks:
        q, kv = (int(n) for n in b.split(":"))
        blocks[b] = (q, kv)
    dense_layers = args.dense_layers / t.num_layers
    variants = {"dense": (False, False), "radial": (False, False),
                "radial+8-bit attention": (True, False),
                "radial+8-bit attention+8-bit Linear": (True, True)}  # fmt: skip
    per_block = {}
    for name, (q, kv) in blocks.items():
        d = density(spec, q, kv)
        sparse = self_dense * (dense_layers + (1 - dense_layers) * d)
        steps = {}
        for variant, (att8, lin8) in variants.items():
            radial = seconds(self_dense if variant == "dense" else sparse, att8, lin8)
            dense = seconds(self_dense, att8, lin8)
            run = args.dense_steps * dense + (args.steps - args.dense_steps) * radial
            steps[variant] = {"step_s": round(radial, 4),
                              "run_s": round(args.steps * dense if variant == "dense" else run, 2)}  # fmt: skip
        per_block[name] = {"q_block": q, "kv_block": kv, "density": round(d, 4),
                           "self_attention_tflops_sparse_step": round(sparse, 1), "bounds": steps}  # fmt: skip
    return {"target": target, "tokens": spec.tokens, "latent_frames": spec.frames,
            "tokens_per_frame": spec.tokens_per_frame, "hlo_tflops": hlo,
            "self_attention_tflops_dense": round(self_dense, 1), "cross_attention_tflops": round(cross, 1),
            "eight_bit_linear_tflops": eight_bit_linear, "quant": quant_scheme,
            "splash": row["attention"],
            "context_parallel": row["context_parallel"], "blocks": per_block,
            "flops_command": row["command"], "quant_command": quant["command"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wan2.1-t2v-14b")
    parser.add_argument("--res", default="720x1280", help="WxH, as the dense rows name it")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--targets", nargs="+", default=["tpu-v6e-8", "tpu7x-8"])
    parser.add_argument("--blocks", nargs="*", default=["128:128", "512:512"],
                        help="query:key kernel blocks besides the build's splash blocks")  # fmt: skip
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dense-steps", type=int, default=WAN_DENSE_STEPS)
    parser.add_argument("--dense-layers", type=int, default=WAN_DENSE_LAYERS)
    parser.add_argument("--quant", default=None, help="the 8-bit Linear scheme (default: the "
                        "target's, w8a8-fp8 on tpu7x, else w8a8-int8)")  # fmt: skip
    parser.add_argument("--flops-from", type=Path, default=RESULTS / "attention_720p.json")
    parser.add_argument("--quant-from", type=Path, default=RESULTS / "memory_quant.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "radial_attention.json")
    args = parser.parse_args()
    rows = [bounds(args, target) for target in args.targets]
    save(args.out, {"command": "python bench/radial_attention.py " + " ".join(sys.argv[1:]),
                    "model": args.model, "res": args.res, "frames": args.frames,
                    "steps": args.steps, "dense_steps": args.dense_steps,
                    "dense_layers": args.dense_layers, "targets": rows})  # fmt: skip
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
