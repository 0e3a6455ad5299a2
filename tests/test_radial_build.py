"""`aot build --sparse-attention radial`: the option, the build that holds `radial_step` beside
the dense step (which keeps its program id), the runtime that runs the dense steps first and
reports them, step caching's sparse step, the FLOPs the manifest records, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from aot.building import store
from aot.building.plan import BuildError, kernel_flops, plan_build, self_attention
from aot.reports import report
from aot.targets import parse_target
from runtime.builds.artifact import read_manifest
from runtime.trust.json_checks import ArtifactError
from wan import sharding
from wan.configs import VideoShape
from wan.models.attention import TpuBlocks, call_blocks, flops, kernel_density
from wan.models.radial_mask import RadialSpec, density
from wan.presets import PRESETS, resolve_model
from wan.sparse_attention import SparseAttentionError, canonical, parse

TINY = PRESETS["tiny"]
LAYERS = TINY.transformer.num_layers
# 9 latent frames of 4 x 8 tokens: at 8-token blocks the mask keeps 77% of the blocks.
SHAPE = ["--res", "64x128", "--frames", "33", "--batch", "1"]
SETTINGS = {
    "dense": "none",
    "two_dense_steps": "radial:0.2:2:1:8",
    "all_layers_dense": f"radial:0.2:0:{LAYERS}:8",
    "no_dense_layer": "radial:0.2:0:0:8",
}
CACHED = "two_dense_steps_cached"  # two_dense_steps with --step-cache


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("radial")
    folders = {}
    for name, args in [
        *((name, ["--sparse-attention", value]) for name, value in SETTINGS.items()),
        (CACHED, ["--sparse-attention", SETTINGS["two_dense_steps"], "--step-cache"]),
    ]:
        if folders:  # the programs built so far, reused where their ids match (a radial build's
            # dense programs are the dense build's, id for id), not compiled again
            last = [*folders.values()][-1].parent
            shutil.copytree(last / store.STORE, out / name / store.STORE)
        result = run_cli(
            "aot", "build", "--model", "tiny", *SHAPE, "--target", "cpu-8", *args,
            "--out", str(out / name), "--json",
        )  # fmt: skip
        (built,) = json.loads(result.stdout)
        folders[name] = Path(built["folder"])
    return folders


def run(
    builds, tiny_weights, tmp_path, name: str, steps: int, *args: str
) -> tuple[np.ndarray, dict]:
    frames, report_path = tmp_path / f"{name}_{steps}.npy", tmp_path / f"{name}_{steps}.json"
    run_cli(
        "runtime", "run", "--artifacts", str(builds[name].parent),
        "--weights", str(tiny_weights), *SHAPE, "--prompt", "a fox in the snow",
        "--steps", str(steps), "--seed", "3", "--out", str(tmp_path / f"{name}_{steps}.mp4"),
        "--save-frames", str(frames), "--report", str(report_path), *args,
    )  # fmt: skip
    return np.load(frames).astype(np.float64), json.loads(report_path.read_text())


# The step count of the runs the tests compare across builds: 2 dense steps, then 4 through
# the mask, and MagCache's skips after steps 2 and 4 (each run made once, `runs`).
STEPS = 6


@pytest.fixture(scope="module")
def runs(builds, tiny_weights, tmp_path_factory):
    """`run` of a build at a step count, each made once in the module: the dense and the radial
    builds' runs are the references of more than one test."""
    made: dict[tuple, tuple[np.ndarray, dict]] = {}

    def frames_and_report(name: str, steps: int = STEPS) -> tuple[np.ndarray, dict]:
        if (name, steps) not in made:
            scratch = tmp_path_factory.mktemp("run")
            made[name, steps] = run(builds, tiny_weights, scratch, name, steps)
        return made[name, steps]

    return frames_and_report


def test_none_builds_todays_programs_and_radial_adds_its_step(builds):
    dense = read_manifest(builds["dense"])
    radial = read_manifest(builds["two_dense_steps"])
    assert "radial" not in builds["dense"].name
    assert builds["two_dense_steps"].name.endswith("_radial-0.2-2-1-8")
    assert list(radial.programs) == [
        "text_encode", "kv_cache", "denoise_step", "radial_step", "latents_handoff", "vae_decode"
    ]  # fmt: skip
    for name, entry in dense.programs.items():  # the dense step is today's, id for id
        assert radial.programs[name].program_id == entry.program_id
    assert radial.programs["radial_step"].program_id != dense.programs["denoise_step"].program_id
    assert dense.programs["denoise_step"].attention_density == 1.0
    # dot computes every entry (the mask is a select): XLA's FLOPs, density 1, counted as such
    step = radial.programs["radial_step"]
    assert step.attention_density == 1.0 and step.self_attention_flops == pytest.approx(
        step.self_attention_flops_dense
    )
    assert step.self_attention_flops_dense == dense.programs["denoise_step"].self_attention_flops


def test_the_dense_steps_run_first_then_the_mask(runs):
    dense2, dense_report = runs("dense", 2)
    radial2, radial_report = runs("two_dense_steps", 2)
    # Within its dense steps a radial build runs the dense build's executable: bit for bit.
    np.testing.assert_array_equal(radial2, dense2)
    assert radial_report["sparse_attention"] == {
        "settings": "radial:0.2:2:1:8", "dense_steps": [0, 1]
    }  # fmt: skip
    assert dense_report["sparse_attention"] is None
    dense_all, _ = runs("dense")
    radial_all, report_all = runs("two_dense_steps")
    assert report_all["sparse_attention"]["dense_steps"] == [0, 1]
    assert report_all["compile_count"] == 0
    assert np.abs(radial_all - dense_all).mean() > 0.2  # steps 2 to 5 attended through the mask


def test_dense_layers_skip_the_mask(runs):
    dense, _ = runs("dense")
    all_dense, _ = runs("all_layers_dense")
    no_dense, _ = runs("no_dense_layer")
    # Every layer dense: radial_step is the dense step (another loop: rounding apart).
    assert np.abs(all_dense - dense).max() <= 1.0
    # (0 apart on this host; the mask in every layer moves the frames by about 1 level in 255)
    assert np.abs(no_dense - dense).mean() > max(10 * np.abs(all_dense - dense).mean(), 0.2)


def test_step_caching_runs_its_sparse_step_after_the_dense_steps(
    builds, runs, tiny_weights, tmp_path
):
    """--step-cache with radial: cache_step for the dense steps, radial_cache_step (radial_step
    that keeps its residuals) after them, MagCache's skips anywhere."""
    programs = read_manifest(builds[CACHED]).programs
    assert list(programs) == [
        "text_encode", "kv_cache", "cache_step", "radial_cache_step", "cached_step",
        "latents_handoff", "vae_decode",
    ]  # fmt: skip
    radial, _ = runs("two_dense_steps")
    # Every block computed: the radial build's frames, bit for bit.
    uncached, report = runs(CACHED)
    np.testing.assert_array_equal(uncached, radial)
    assert report["sparse_attention"]["dense_steps"] == [0, 1]
    ratios = tmp_path / "ratios.json"
    ratios.write_text(json.dumps([1.0] * STEPS))
    magcache = ["--cache", "magcache", "--mag-ratios", str(ratios), "--cache-max-skip", "1",
                "--cache-retention", "0.34"]  # fmt: skip
    cached, report = run(builds, tiny_weights, tmp_path, CACHED, STEPS, *magcache)
    # Steps 0 and 1 kept, then a skip after each computed step: step 3's residual is sparse.
    assert report["cache"]["skipped_steps"] == [2, 4]
    assert report["cache"]["block_steps_run"] == 4 * LAYERS
    assert report["sparse_attention"]["dense_steps"] == [0, 1]
    assert report["compile_count"] == 0
    assert np.abs(cached - radial).mean() > 0.2  # the skips act


def test_inspect_says_what_runs_sparse(builds):
    text = report.inspect_text(read_manifest(builds["two_dense_steps"]))
    assert "sparse     radial:0.2:2:1:8: the first 2 steps dense" in text
    assert "computes 1.0000 of its blocks" in text


def splash_plan(
    radial: str, mesh=None, context_parallel=None, attention="splash:128:128:128", batch=1
):
    return plan_build(
        "tiny", TINY, VideoShape(192, 320, 33, batch), parse_target("tpu-v6e-8"), 8,
        mesh=mesh or sharding.MeshShape(data=2, tensor=4), attention=attention,
        context_parallel=context_parallel, sparse_attention=canonical(radial),
    )  # fmt: skip


def test_a_splash_radial_step_counts_the_blocks_its_mask_keeps():
    plan = splash_plan("radial:0.2:12:1:128")
    grid = TINY.transformer.patch_grid(plan.shape.latent_shape(TINY)[1:4])
    spec = RadialSpec(grid[0], grid[1] * grid[2])
    kept = density(spec, 128)
    assert 0 < kept < 0.8  # 9 frames of 240 tokens: the mask drops blocks
    counted = self_attention(plan, radial=True)
    tc = TINY.transformer
    # data=2 splits the CFG rows; tensor=4 cannot split 2 heads: each device holds a video's.
    per_layer = flops((2, spec.tokens, tc.num_attention_heads, tc.attention_head_dim), spec.tokens)
    dense = per_layer / 2 * tc.num_layers
    assert counted.density == kept and counted.dense_flops == dense
    assert counted.flops == pytest.approx(dense * (1 + (tc.num_layers - 1) * kept) / tc.num_layers)
    saved = kernel_flops(plan) - kernel_flops(plan, radial=True)
    assert saved == pytest.approx(counted.dense_flops - counted.flops)
    assert self_attention(plan, radial=False).flops == dense  # the dense step: every block


def test_a_sparse_build_s_radial_calls_run_within_the_radial_block():
    """auto on TPU: a sparse build keeps the generation's flash blocks for its dense calls (its
    dense steps and layers), and its Radial calls run the kernel within the Radial block, 1024
    by default (at 2048-3072 every block holds a kept entry), so that every block is kept whole
    or skipped; elsewhere the official 128."""
    model = resolve_model("wan2.1-t2v-14b")

    def auto(radial: str) -> str:
        return plan_build(
            "wan2.1-t2v-14b", model, VideoShape(1280, 720, 81, 1), parse_target("tpu-v6e-8"), 8,
            sparse_attention=canonical(radial),
        ).attention  # fmt: skip

    assert auto("radial") == auto("none") == "flash:3072:2048:512"
    spec = RadialSpec(21, 45 * 80, block=1024)
    # flash: query blocks of two mask blocks, whose halves visit a key block alone
    assert call_blocks("flash:3072:2048:512", spec.block) == TpuBlocks(2048, 1024, 512)
    assert call_blocks("splash:3072:2048:512", spec.block) == TpuBlocks(1024, 1024, 512)
    assert call_blocks("flash:3072:2048:512", None) == TpuBlocks(3072, 2048, 512)
    assert kernel_density("flash:3072:2048:512", spec) == density(spec, 1024)
    assert kernel_density("splash:3072:2048:512", spec) == density(spec, 1024)
    assert call_blocks("flash:512:512:256", spec.block) == TpuBlocks(512, 512, 256)
    tpu = plan_build(
        "wan2.1-t2v-14b", model, VideoShape(1280, 720, 81, 1), parse_target("tpu-v6e-8"), 8,
        sparse_attention=canonical("radial"),
    )  # fmt: skip
    assert tpu.key.option("sparse_attention") == "radial:0.2:12:1:1024"
    cpu = plan_build("tiny", TINY, VideoShape(192, 320, 33, 1), parse_target("cpu-8"), 8,
                     sparse_attention=canonical("radial"))  # fmt: skip
    assert cpu.key.option("sparse_attention") == "radial:0.2:12:1:128"


@pytest.mark.parametrize("kernel", ["flash", "splash"])
def test_a_radial_block_under_the_tpu_kernel_blocks_is_refused(kernel):
    """On v5e, 128-token Radial blocks in 512-token splash blocks ran at 0.67x the dense
    call's speed (bench/chip_attention.py): a partly kept block costs more than the mask
    saves."""
    with pytest.raises(BuildError, match="blocks under 1024 are slower"):
        splash_plan("radial:0.2:12:1:128", attention=f"{kernel}:512:512:512")
    with pytest.raises(BuildError, match="blocks under 1024 are slower"):
        splash_plan("radial:0.2:12:1:512", attention=f"{kernel}:2048:1024:256")
    assert splash_plan("radial:0.2:12:1:512", attention=f"{kernel}:512:512:512")


@pytest.mark.parametrize(
    "text, canonical_text",
    [
        ("none", "none"),
        ("radial", "radial:0.2:12:1"),
        ("radial:0.1", "radial:0.1:12:1"),
        ("radial:0.2:4:2:256", "radial:0.2:4:2:256"),
    ],
)
def test_the_flag_spellings(text, canonical_text):
    assert canonical(text) == canonical_text
    assert canonical(canonical_text) == canonical_text


@pytest.mark.parametrize(
    "text",
    ["radial:", "radial:x", "radial:0", "radial:nan", "radial:inf", "radial:0.2:-1", "radial:0.2:1:1:100",
     "radial:0.2:1:1:128:9", "sparse", "radial:0.2:1.5"],
)  # fmt: skip
def test_bad_settings_are_one_line(text):
    with pytest.raises(SparseAttentionError, match="--sparse-attention|block") as e:
        parse(text)
    assert "\n" not in str(e.value)


def test_refusals_name_what_to_change():
    with pytest.raises(BuildError, match="--continuous"):
        plan_build(
            "tiny", TINY, VideoShape(192, 320, 33, 1), parse_target("cpu-8"), 8,
            sparse_attention=canonical("radial"), continuous=True,
        )  # fmt: skip
    with pytest.raises(BuildError, match="dense layers"):
        splash_plan(f"radial:0.2:12:{LAYERS + 1}")
    with pytest.raises(BuildError, match="ulysses"):
        splash_plan("radial", sharding.MeshShape(context=8), context_parallel="gather")
    # 2 heads over 2 sequence shards: ulysses, accepted
    splash_plan("radial", sharding.MeshShape(data=4, context=2), batch=2)


def test_the_cli_refuses_in_one_line(tmp_path):
    for args, says in [
        (["--sparse-attention", "radial:fast"], "--sparse-attention 'radial:fast'"),
        (["--sparse-attention", "radial", "--continuous"], "--continuous"),
    ]:
        result = run_cli(
            "aot", "build", "--model", "tiny", *SHAPE, "--target", "cpu-8", *args,
            "--out", str(tmp_path), check=False,
        )  # fmt: skip
        assert result.returncode == 2 and says in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_hostile_recorded_setting_is_refused(builds, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(builds["two_dense_steps"], folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for bad in ("radial:nan:2:1:8", "radial", 7):
        manifest["key"]["sparse_attention"] = bad
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArtifactError, match="sparse_attention"):
            read_manifest(folder)
