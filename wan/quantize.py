"""`python -m wan.quantize --weights W --quant MODE --out DIR`: a checkpoint (format 2) whose
transformers hold their blocks' Linear kernels in 8 bits with their scales (wan.quant), which a
`--quant MODE` build loads at disk speed, with no quantizing at load. The other components are
copied as they are. A quantized checkpoint serves the builds of its 8-bit dtype (int8: the int8
modes, fp8: the fp8 ones); a build without --quant refuses it in one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wan import checkpoint, interface, programs, quant, weights
from wan.configs import ModelConfig
from wan.errors import InputError


def quantize_checkpoint(source: str | Path, mode: str, out: str | Path) -> Path:
    """Write the checkpoint of `source` (a diffusers folder or a checkpoint) with its
    transformers' kernels quantized for `mode`; one component at a time on the host."""
    if quant.scheme(mode) is None:
        raise InputError(f"--quant {mode}: use one of {', '.join(quant.SCHEMES)}")
    source = Path(source)
    _check_apart(source, Path(out))
    config = ModelConfig.from_folder(source)
    components = {}
    # Only the kinds that take `quant` (the transformer's) are made in 8 bits.
    options = programs.ProgramOptions(build={"quant": mode})
    for component in interface.components(config.num_experts):
        module = programs.abstract_module(config, component, options)
        flat = weights.flatten(programs.split_abstract(module)[1])
        host, pending = checkpoint.read_host(source, component, flat)
        for kernel, precision in pending.items():
            host[kernel], host[(*kernel[:-1], "scale")] = checkpoint.quantized(
                host[kernel], None, flat[kernel].dtype, precision
            )
        components[component] = weights.unflatten(host)
    tokenizer = source / "tokenizer"
    return checkpoint.save_checkpoint(out, config, components, tokenizer)


def _check_apart(source: Path, out: Path) -> None:
    """`out` is not `source`, inside it or around it: the checkpoint is published by replacing
    `out` whole, so the full-precision weights would be replaced with it (or written into)."""
    weights, target = source.resolve(), out.resolve()
    if weights.is_relative_to(target) or target.is_relative_to(weights):
        relation = (
            "is"
            if weights == target
            else "is inside"
            if target.is_relative_to(weights)
            else "holds"
        )
        raise InputError(
            f"--out {out} {relation} --weights {source}: write the 8-bit checkpoint to a folder "
            "of its own"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m wan.quantize", description=__doc__)
    parser.add_argument("--weights", required=True, type=Path)
    parser.add_argument("--quant", required=True, choices=list(quant.SCHEMES))
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        folder = quantize_checkpoint(args.weights, args.quant, args.out)
    except (InputError, OSError) as e:  # one line, exit 2, as the aot and runtime commands
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {folder} ({args.quant})")


if __name__ == "__main__":
    main()
