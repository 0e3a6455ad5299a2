#!/usr/bin/env bash
# What only the development TPU machine needs before bench/chip*.py run there (source it from the
# repo root: `. bench/chip_setup.sh`). That machine has jax and libtpu but not the project's other
# packages, and no network: they come from its own package index (/opt/pypi/simple), and the
# wheels it lacks travel with the tree in .whl-tpu (carried; `bash bench/chip_setup.sh --fetch`
# here fetches them). The project runs from the tree (PYTHONPATH), the machine's jax first.
# A Cloud TPU VM needs none of this: `pip install -e .` there, then the bench/chip*.py commands.
set -euo pipefail
WHEELS=.whl-tpu
if [[ "${1:-}" == "--fetch" ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "zstandard>=0.22"
  exit 0
fi
SITE=${CHIP_SITE:-/tmp/site}
if [[ ! -d "$SITE/flax" ]]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target "$SITE" flax==0.12.8 orbax-checkpoint \
    transformers tokenizers sentencepiece safetensors tqdm pillow fastapi uvicorn \
    python-multipart cryptography imageio-ffmpeg click
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
      --no-compile --target "$SITE" "$WHEELS"/*.whl
  fi
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$SITE"
set +euo pipefail
