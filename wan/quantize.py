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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m wan.quantize", description=__doc__)
    parser.add_argument("--weights", required=True, type=Path)
    parser.add_argument("--quant", required=True, choices=list(quant.SCHEMES))
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        folder = quantize_checkpoint(args.weights, args.quant, args.out)
    except (InputError, OSError) as e:
        sys.exit(f"Error: {e}")
    print(f"wrote {folder} ({args.quant})")


if __name__ == "__main__":
    main()
