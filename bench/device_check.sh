#!/usr/bin/env bash
# The one command a session runs when the device tool lends it a GPU (issue 29): from the repo
# root, `bash bench/device_check.sh [device_check.py options]`; `--dry-run` on any host.
#
# The device image has jax (0.11.2, CUDA 13 plugin), flax, orbax, torch, transformers, peft and
# tokenizers, not the rest of what the project and diffusers need: fetch those wheels here first
# (`bash bench/device_check.sh --fetch-wheels`) and carry bench/results/tmp/wheels. They are
# installed into a side folder, the project runs from the tree (PYTHONPATH), and results land in
# $OUT (the device tool's folder that comes back) or bench/results/tmp/device_check.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/results/tmp/wheels
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  # No dependencies pulled: the device image has the rest (numpy, safetensors, huggingface_hub).
  "$PY" -m pip download -q --no-deps -d "$WHEELS" diffusers imageio-ffmpeg click tqdm pillow \
    sentencepiece
  du -sh "$WHEELS"
  exit 0
fi
SIDE=$(mktemp -d)
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-deps --target "$SIDE" "$WHEELS"/*.whl
fi
export PYTHONPATH="$PWD:$SIDE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1 || true
exec "$PY" bench/device_check.py --out "${OUT:-bench/results/tmp/device_check}" "$@"
