"""Test setup: 8 CPU host devices (sharding tests), fp32 matmuls at full precision."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

BIN = Path(sys.executable).parent
TINY_SHAPE = ["--res", "192x320", "--frames", "9", "--batch", "1"]


def run_cli(
    tool: str, *args: str, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run `aot`/`runtime` as a user would: a fresh process, its own device setup."""
    result = subprocess.run(
        [str(BIN / tool), *args], capture_output=True, text=True, env=env, timeout=900
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{tool} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A folder shared by all xdist workers of this run (builds are locked and skipped)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-") else root
    (root / "shared").mkdir(exist_ok=True)
    return root / "shared"


@pytest.fixture(scope="session")
def tiny_build(shared_dir) -> Path:
    """`aot build` of the tiny model, portrait 192x320, 9 frames, batch 1, for cpu-8."""
    out = shared_dir / "artifacts"
    run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8", "--out", str(out))
    (folder,) = [p for p in out.iterdir() if p.name.startswith("tiny_192x320_f9_b1_")]
    return folder


@pytest.fixture(scope="session")
def tiny_weights(shared_dir) -> Path:
    """Random tiny weights in the project's checkpoint format (written once per run)."""
    import fcntl

    from wan.presets import PRESETS
    from wan.random_weights import write_random_checkpoint

    folder = shared_dir / "tiny-weights"
    with (shared_dir / "weights.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.exists():
            write_random_checkpoint(PRESETS["tiny"], folder, seed=0)
    return folder
