"""Benchmarks the docs quote still run: every `bench/` script that docs/ names, each run as its
own process on the tiny model (or a tiny image-to-video folder where it needs one), its smallest
shape, one repeat, deviceless TPU targets where it compiles for one, and its results into a
scratch folder. The real presets are what docs/benchmarks.md records; the code path is the same,
so a change that breaks a benchmark fails here, not the next time someone measures. Each test
checks what the script wrote (its keys and rows), not only its exit status. The session's tiny
weights and builds (conftest) are passed in where a script takes them, so that they are not
written or compiled again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL, TINY_SHAPE, run_cli, save_tiny_i2v_pipeline, with_its_store

ROOT = Path(__file__).resolve().parents[1]
# The smallest video of the tiny model: a 2x2 latent (one token after the 2x2 patch), one frame.
MIN = ["--res", "16x16", "--frames", "1"]
TPU = "tpu-v6e-8"


def bench(script: str, *args: str | Path) -> subprocess.CompletedProcess:
    """`python bench/<script> args` from the repository root, as the docs run it; it must exit 0."""
    result = subprocess.run(
        [sys.executable, f"bench/{script}", *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"{script}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def rows(path: Path) -> list[dict]:
    """A results file of bench/record.py: its rows, each naming the command that made it."""
    found = json.loads(path.read_text())["rows"]
    assert all(row["command"].strip() for row in found)
    return found


@pytest.fixture
def tpu() -> None:
    pytest.importorskip("libtpu", reason="needs the tpu extra (deviceless TPU compiles)")


@pytest.fixture(scope="module")
def tiny_i2v(tmp_path_factory) -> Path:
    """A tiny Wan 2.2 I2V-A14B-kind diffusers folder: a model with an image encode (vae_encode)."""
    folder = tmp_path_factory.mktemp("bench") / "tiny-i2v"
    save_tiny_i2v_pipeline(folder, clip=False)
    return folder


@pytest.fixture(scope="session")
def serve_builds(shared_dir, small_builds) -> list[Path]:
    """The builds bench/serve_load.py makes at conftest's SMALL shape: batch 1 and 2
    (small_builds) and the continuous batch 2, built as tests/test_continuous.py builds it (the
    same command into the same folder: one run compiles it once)."""
    out = shared_dir / "continuous-artifacts"
    run_cli("aot", "build", "--model", "tiny", *SMALL, "--batch", "2", "--continuous",
            "--target", "cpu-8", "--out", str(out))  # fmt: skip
    return [p for f in (small_builds, out) for p in f.iterdir() if not p.name.startswith(".")]


@pytest.fixture(scope="module")
def min_build(tmp_path_factory) -> Path:
    """`aot build` of the tiny model at MIN, batch 1, for cpu-8, compiled once for the module:
    the scripts that build it (cold start, quant, step cache) are given a copy with its store
    (`with_its_store`), where their `aot build` finds it up to date and reuses its programs."""
    out = tmp_path_factory.mktemp("min-build")
    run_cli("aot", "build", "--model", "tiny", *MIN, "--batch", "1", "--target", "cpu-8",
            "--out", str(out))  # fmt: skip
    (folder,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    return folder


@pytest.fixture(scope="module")
def weights_work(tmp_path_factory) -> tuple[Path, Path]:
    """bench/weights_load.py once, from a fresh --work folder (its results file beside it):
    it writes its own sources there, which bench/lora_merge.py then loads (the scripts share
    --work, as the docs run them)."""
    root = tmp_path_factory.mktemp("weights-load")
    out = root / "weights_load.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "weights_load.py"), "--model", "tiny",
         "--repeats", "1", "--work", str(root / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "work", out


def test_weights_load_runs_from_a_fresh_folder(weights_work):
    """bench/weights_load.py writes its own sources (a checkpoint and a diffusers folder, with
    the transformer's config.json the loader requires) and loads each."""
    _, out = weights_work
    sources = {
        row for entry in [json.loads(out.read_text())] for row in json.dumps(entry).split('"')
    }
    assert {"checkpoint", "diffusers", "checkpoint-orbax"} <= sources


def test_lora_merge(tmp_path, weights_work):
    """On the sources bench/weights_load.py wrote (the --work they share: not written again)."""
    out = tmp_path / "lora_merge.json"
    work, _ = weights_work
    bench("lora_merge.py", "--model", "tiny", "--rank", "4", "--repeats", "1",
          "--work", work, "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert row["lora_rank"] == 4 and row["transformer_parameters"] > 0
    assert set(row["sources"]) == {"checkpoint", "diffusers"}
    for source in row["sources"].values():
        assert len(source["seconds_with"]) == len(source["seconds_without"]) == 1
        assert source["with"]["runs"] == 1 and len(source["host_load"]) == 1


def test_build_jobs(tmp_path):
    out = tmp_path / "build_jobs.json"
    bench("build_jobs.py", "--jobs", "1", "--repeats", "1", "--out", out, "--",
          "--model", "tiny", *MIN, "--batch", "1", "--target", "cpu-8")  # fmt: skip
    (row,) = rows(out)
    [run] = row["runs"]["1"]
    assert run["compiled"] > 0 and run["reused"] == 0
    assert row["ratio_to_jobs_1"] == {"1": 1.0}
    assert row["wall_seconds"]["1"]["runs"] == 1 and run["host_load"] >= 0


def test_attention_8bit(tmp_path, tiny_weights, attention_quant_builds):
    """The pipelines at the session's 8-bit attention builds (their shape: up to date, not
    compiled again)."""
    out = tmp_path / "attention_8bit.json"
    artifacts = attention_quant_builds["none"].parent.parent
    bench("attention_8bit.py", "--steps", "1", "--tokens", "256", "--frames", "17",
          "--weights", tiny_weights, "--artifacts", artifacts, "--out", out)  # fmt: skip
    (row,) = rows(out)
    accuracy = row["accuracy_against_bf16"]
    assert len(accuracy) == 12 and all(len(heads) == 2 for heads in accuracy.values())
    psnr = row["pipeline_psnr_db_against_full_precision"]
    assert set(psnr) == {"int8", "fp8", "another seed"} and psnr["int8"] > psnr["another seed"]


def test_build_wall(tmp_path):
    out = tmp_path / "build_wall.json"
    bench("build_wall.py", "--rounds", "1", "--variant", "plain=", "--variant",
          "small vmem=--vae-vmem 2", "--out", out, "--", "--model", "tiny", *MIN,
          "--batch", "1", "--target", TPU)  # fmt: skip
    (row,) = rows(out)
    for name in ("plain", "small vmem"):
        (run,) = row["runs"][name]
        assert run["wall_seconds"] > 0 and run["peak_rss_gib"] > 0 and run["host_load"] >= 0
        assert run["compile_seconds"]["vae_decode"] > 0
        assert row["summary"][name]["wall_seconds"]["runs"] == 1
    assert row["wall_ratio_to_plain"]["plain"] == 1.0


def test_cold_start(tmp_path, tiny_weights, min_build):
    """A (runtime run), B (plain jax.jit: bench/jit_run.py) and C (B with a warm cache); A's
    build is the module's (up to date: not compiled again)."""
    with_its_store(min_build, tmp_path / "artifacts")
    out = tmp_path / "cold_start.json"
    bench("cold_start.py", "--model", "tiny", *MIN, "--steps", "1", "--repeats", "1",
          "--weights", tiny_weights, "--artifacts", tmp_path / "artifacts",
          "--out", out)  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["median"]) == {"A_runtime", "B_jit", "C_jit_cache"}
    assert all(run["first_step"] > 0 for run in result["median"].values())
    assert set(result["ratio_first_step"]) == set(result["ratio_total"]) == {"A/B", "A/C"}
    assert result["floor"]["first_step"] > 0 and result["aot_build_compile_seconds"] > 0
    assert set(result["spread"]) == set(result["median"]) and len(result["host_load"]) == 1
    assert result["spread"]["A_runtime"]["first_step"]["runs"] == 1


def test_cold_start_trees(tmp_path, tiny_weights, min_build):
    """This tree as both --before and --after (built once: the module's build, up to date)."""
    with_its_store(min_build, tmp_path / "artifacts" / "before")
    out = tmp_path / "cold_start_trees.json"
    bench("cold_start_trees.py", "--before", ROOT, "--after", ROOT, "--repeats", "1",
          "--steps", "1", *MIN, "--weights", tiny_weights, "--artifacts", tmp_path / "artifacts",
          "--save", out)  # fmt: skip
    result = json.loads(out.read_text())
    phases = {"first_step", "deserialize", "total"}
    assert set(result["seconds"]) == {"before", "after"} and len(result["host_load"]) == 1
    assert all(set(m) == phases for m in result["seconds"].values())
    assert set(result["ratio_after_over_before"]) == phases


def test_serve_limits(tmp_path, tiny_weights, small_builds):
    """This tree as both --before and --after (built once: the session's identical batch-1
    build, up to date): the bodies over the bound are refused (a 413, or the connection closed
    under the body), and the half heads were sent."""
    (batch_1,) = [p for p in small_builds.iterdir() if p.name.startswith("tiny_64x96_f5_b1_")]
    with_its_store(batch_1, tmp_path / "artifacts" / "before")
    out = tmp_path / "serve_limits.json"
    bench("serve_limits.py", "--before", ROOT, "--after", ROOT, "--heads", "8", "--wait", "0.5",
          "--rounds", "1", "--weights", tiny_weights, "--artifacts", tmp_path / "artifacts",
          "--save", out)  # fmt: skip
    (row,) = rows(out)
    for tree in ("before", "after"):
        for body in ("declared_body", "chunked_body"):
            assert "" not in row[tree][body]["answers"] and "202" not in row[tree][body]["answers"]
            assert row[tree][body]["seconds"]["runs"] == 1
            assert row[tree][body]["rss_mib_growth"]["runs"] == 1
        assert row[tree]["half_sent_heads"]["sent"] == 8 and len(row[tree]["host_load"]) == 1
        (run,) = row["runs"][tree]
        assert "rss_mib_before" in run["declared_body"] and "host_load" in run


def test_serve_load(tmp_path, tiny_weights, serve_builds):
    """One request at one rate to the three servers, and one `runtime run`; the builds are the
    session's (up to date: not compiled again)."""
    artifacts = tmp_path / "artifacts"
    for build in serve_builds:
        with_its_store(build, artifacts)
    out = tmp_path / "serve_load.json"
    bench("serve_load.py", "--model", "tiny", *SMALL, "--steps", "1", "--n", "1", "--batch", "2",
          "--rates", "1", "--rounds", "1", "--batch-window", "0", "--weights", tiny_weights,
          "--artifacts", artifacts, "--out", out)  # fmt: skip
    (row,) = rows(out)
    servers = {"serve_b1", "serve_b2_window", "serve_b2_continuous"}
    assert set(row["builds"]) == servers
    assert set(row["medians"]["1"]) == servers
    assert all(m["compile_count"] == 0 for m in row["medians"]["1"].values())
    assert all(f["host_load"]["runs"] == 1 for f in row["spread"]["1"].values())
    assert row["runtime_run_x1"]["all_videos_s"] > 0
    table = bench("serve_load.py", "--markdown", "--out", out).stdout.splitlines()
    assert len(table) == 2 + 3 and table[2].startswith("| 1/s | batch-1 | ")
    assert "not recorded" not in "".join(table)


def test_serve_load_fleet(tmp_path, tiny_weights, serve_builds):
    """--replicas: one and two replicas of the batch build on a scratch PostgreSQL store, each
    job claimed once; the store's overhead per job measured for both databases."""
    artifacts = tmp_path / "artifacts"
    for build in serve_builds:
        with_its_store(build, artifacts)
    out = tmp_path / "serve_fleet.json"
    bench("serve_load.py", "--model", "tiny", *SMALL, "--steps", "1", "--n", "2", "--batch", "2",
          "--replicas", "1", "2", "--rate", "1", "--rounds", "1", "--batch-window", "0",
          "--store-jobs", "3", "--weights", tiny_weights, "--artifacts", artifacts, "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert set(row["medians"]) == {"1", "2"}
    assert set(row["spread"]) == {"1", "2"} and row["spread"]["1"]["host_load"]["runs"] == 1
    for figures in row["medians"].values():
        assert figures["claims_per_job_max"] == 1 and figures["compile_count"] == 0
        assert figures["videos_per_minute"] > 0
    assert set(row["store_overhead"]) == {"sqlite_ms_per_job", "postgresql_ms_per_job"}
    table = bench("serve_load.py", "--markdown", "--replicas", "1", "--out", out).stdout
    assert table.splitlines()[3].startswith("| 2 | ") and "not recorded" not in table


def test_radial_attention(tmp_path, tpu):
    """Deviceless tiny radial builds (memory_table), full precision and with int8 attention:
    the mask keeps fewer blocks than the dense step computes, radial_step's bound is under the
    dense step's, and int8 attention lowers it again."""
    builds = tmp_path / "radial_builds.json"
    bench("memory_table.py", "--models", "tiny", "--targets", TPU, "--batches", "2",
          "--res", "192x320", "--frames", "17", "--attentions", "splash:128:128:128",
          "--sparse-attentions", "radial:0.2:12:1:128", "--attention-quants", "none", "int8",
          "--programs", "denoise_step", "radial_step", "--out", builds)  # fmt: skip
    out = tmp_path / "radial_attention.json"
    bench("radial_attention.py", "--model", "tiny", "--targets", TPU, "--frames", "17",
          "--batch", "2", "--builds", builds, "--out", out)  # fmt: skip
    ((found,),) = [[row["builds"]] for row in rows(out)]
    plain, int8 = sorted(found, key=lambda r: r["levers"])
    assert plain["levers"] == "radial" and int8["levers"] == "radial + int8 attention"
    assert 0 < plain["attention_density"] < 1
    assert plain["self_attention_tflops"] < plain["self_attention_tflops_dense"]
    assert plain["radial_step_s"] < plain["dense_step_s"] == plain["today_step_s"]
    assert int8["radial_step_s"] < plain["radial_step_s"] and int8["run_s"] < plain["run_s"]


def test_quant(tmp_path, tiny_weights, min_build):
    """The full-precision build is the module's (up to date); the w8a8-int8 build compiles
    only what its 8-bit Linear layers change."""
    with_its_store(min_build, tmp_path / "artifacts")
    out = tmp_path / "quant.json"
    bench("quant.py", "--model", "tiny", *MIN, "--rounds", "1", "--weights", tiny_weights,
          "--artifacts", tmp_path / "artifacts", "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert set(row["median"]) == {"A", "B", "C"}
    assert 0 < row["checkpoint_bytes"]["int8"] < row["checkpoint_bytes"]["full"]


def test_step_cache_measured(tmp_path, tiny_weights, min_build):
    """The --step-cache build beside the module's plain one: it compiles only the two step
    programs, and reuses the others."""
    with_its_store(min_build, tmp_path / "artifacts")
    out = tmp_path / "step_cache.json"
    bench("step_cache.py", "--part", "measured", "--model", "tiny", *MIN, "--steps", "4",
          "--repeats", "1", "--weights", tiny_weights, "--artifacts", tmp_path / "artifacts",
          "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert row["model"] == "tiny" and len(row["calibrated_ratios"]) == 4
    assert len(row["denoise_seconds_uncached"]) == len(row["denoise_seconds_magcache"]) == 1
    assert row["magcache"]["runs"] == row["speedup_per_round"]["runs"] == len(row["host_load"]) == 1


def test_step_cache_deviceless(tmp_path, tpu):
    out = tmp_path / "step_cache.json"
    bench("step_cache.py", "--part", "deviceless", "--model", "tiny", *MIN, "--steps", "10",
          "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert row["target"] == TPU and row["skipped_steps_shipped_ratios"]
    assert set(row["peak_memory_per_device_gib"]) == {"cache_step", "cached_step"}


def test_memory_table(tmp_path, tpu):
    """Every program of a deviceless build, then the table docs/benchmarks.md shows."""
    out = tmp_path / "memory_table.json"
    bench("memory_table.py", "--models", "tiny", "--targets", TPU, "--batches", "1", *MIN,
          "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert "error" not in row, row
    assert set(row["programs"]) == {"text_encode", "kv_cache", "denoise_step", "vae_decode"}
    table = bench("memory_table.py", "--markdown", "--out", out).stdout
    assert f"| tiny | {TPU} (32) | 1 |" in table


def test_i2v_builds(tmp_path, tpu):
    """One `aot build` and `aot check` (the script's path is the same for text to video)."""
    out = tmp_path / "i2v_builds.json"
    bench("i2v_builds.py", "--model", "tiny", "--res", "16x16", "--frames", "1", "--batches", "1",
          "--targets", TPU, "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert "error" not in row, row
    assert row["aot_check"] == "pass" and "denoise_step" in row["programs"]
    table = bench("i2v_builds.py", "--markdown", "--out", out).stdout
    assert f"| tiny | 16x16 | 1 | {TPU} |" in table


def test_program_ids(tmp_path, tpu):
    out = tmp_path / "program_ids.json"
    bench("program_ids.py", "--model", "tiny", *MIN, "--batch", "1", "--target", TPU,
          "--label", "this", "--save", out)  # fmt: skip
    (row,) = rows(out)
    assert row["label"] == "this"
    assert {"text_encode", "denoise_step", "vae_decode"} <= set(row["program_ids"])
    assert all(len(pid) == 64 for pid in row["program_ids"].values())


def test_program_reuse(tmp_path, tpu):
    """Two resolutions: the second reuses the first's text encoder."""
    out = tmp_path / "program_reuse.json"
    bench("program_reuse.py", "--model", "tiny", "--res", "16x16", "--res", "32x16",
          "--frames", "1", "--batch", "1", "--target", TPU, "--out", out)  # fmt: skip
    result = json.loads(out.read_text())
    counts = result["per_model"]["tiny"]
    assert counts["compiled"]["denoise_step"] == 2
    assert counts["reused"]["text_encode"] == 1
    assert len(result["program_ids"]["tiny"]) == sum(
        n for kind in counts.values() for n in kind.values()
    )


def test_vae_allgather(tmp_path, tpu):
    """Two latent frames (the first chunk and a scan trip), and the reference alone."""
    hlo = tmp_path / "hlo"
    printed = bench("vae_allgather.py", "--preset", "tiny", "--target", TPU, "--res", "16x16",
                    "--latent-frames", "2", "--save-hlo", hlo).stdout  # fmt: skip
    assert "per latent frame" in printed and "of the upsampler inputs'" in printed
    assert (hlo / f"vae_decode_16x16_{TPU}.hlo.txt").stat().st_size > 0
    reference = bench("vae_allgather.py", "--preset", "tiny", "--reference").stdout
    assert reference.count("upsampler inputs per latent frame") == 2


def test_vae_compile(tmp_path, tpu):
    out = tmp_path / "vae_compile.json"
    bench("vae_compile.py", "--preset", "tiny", "--target", TPU, "--res", "16x16",
          "--latent-frames", "1", "--vae-vmem", "4", "--repeats", "1", "--out", out)  # fmt: skip
    result = json.loads(out.read_text())
    measured = result["median"]["16x16"]["this tree, --vae-vmem 4"]
    assert measured["compiler_options"] == {"xla_tpu_scoped_vmem_limit_kib": 4096}
    assert measured["compile_seconds"] > 0 and measured["distinct_convolutions"] > 0
    spread = result["compile_seconds"]["16x16"]["this tree, --vae-vmem 4"]
    assert spread["runs"] == 1 and len(spread["host_load"]) == 1


def test_vae_encode_vmem(tmp_path, tpu, tiny_i2v):
    out = tmp_path / "vae_encode_vmem.json"
    bench("vae_encode_vmem.py", "--model", tiny_i2v, *MIN, "--batch", "1", "--target", TPU,
          "--vmem", "4", "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert "error" not in row, row
    assert row["vmem_mib"] == 4 and row["peak_gib"] >= 0


def test_vae_mesh(tmp_path, tpu):
    """The non-default variant: one video per device, batch 8."""
    out = tmp_path / "vae_mesh.json"
    bench("vae_mesh.py", "--target", TPU, "--model", "tiny", *MIN, "--batches", "8",
          "--meshes", "N,1", "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert row["vae_mesh"] == [8, 1] and row["batch"] == 8 and row["compile_seconds"] > 0


def test_chip(tmp_path, tiny_build, tiny_weights):
    """The device loop, on the devices of this host: each variant's runs, s/step over every
    step, the phases, the prediction beside what the device reports, the table from the file."""
    res, frames = TINY_SHAPE[1], TINY_SHAPE[3]
    bench("chip.py", "--artifacts", tiny_build.parent, "--weights", tiny_weights, "--res", res,
          "--frames", frames, "--steps", "2", "--runs", "2", "--variant", f"plain={tiny_build.name}",
          "--variant", f"freed={tiny_build.name} --placement text_encoder=transient",
          "--out", tmp_path)  # fmt: skip
    plain, freed = json.loads((tmp_path / "chip.json").read_text())["rows"]
    assert plain["seconds_per_step"]["runs"] == 4 and plain["compile_count"] == 0
    assert set(plain["phases"]) >= {"imports", "devices", "deserialize", "weights", "denoise"}
    assert plain["placement"]["text_encoder"] == "resident"
    assert freed["placement"]["text_encoder"] == "transient"
    assert freed["predicted_peak_gib"] <= plain["predicted_peak_gib"]
    assert plain["device_peak_gib"] is None  # a CPU reports no memory
    table = bench("chip.py", "--markdown", tmp_path / "chip.json").stdout
    assert "| plain | " in table and "| freed | " in table


def test_chip_decode(tmp_path, tiny_build, tiny_weights):
    """The decode alone on this host's devices: each decode after the first timed, the build's
    compiler options and FLOPs beside them, the table from the file (a CPU trace has no device
    plane to sum, and a CPU build no peak to bound it by)."""
    bench("chip_decode.py", "--artifacts", tiny_build.parent, "--weights", tiny_weights,
          "--runs", "2", "--variant", f"plain={tiny_build.name}", "--out", tmp_path)  # fmt: skip
    (row,) = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert row["decode_s"]["runs"] == 2 and row["first_call_s"] > 0 and row["tflop"] >= 0
    assert row["compiler_options"] == {} and row["lower_bound_s"] is None
    assert row["ms_by_kind"] is None
    table = bench("chip_decode.py", "--markdown", tmp_path / "decode.json").stdout
    assert "| plain | default | " in table


def test_chip_decode_forms(tmp_path):
    """The decode written as the model writes it, as it was written before sitting 10, and with
    the Pallas norm (interpret mode here): each compiled and timed, the frames alike (a CPU trace
    has no device plane to sum), the table from the file."""
    bench("chip_decode_forms.py", "--model", "tiny", *MIN, "--runs", "1",
          "--forms", "written", "fp32_apply_norm", "pallas_norm", "--out", tmp_path)  # fmt: skip
    found = json.loads((tmp_path / "decode_forms.json").read_text())["rows"]
    assert [r["form"] for r in found] == ["written", "fp32_apply_norm", "pallas_norm"]
    assert all(r["decode_s"]["runs"] == 1 and r["compile_s"] > 0 for r in found)
    means = [r["frames_mean"] for r in found]
    assert max(means) - min(means) < 0.5 and means[0] > 0  # frames in 0-255
    table = bench("chip_decode_forms.py", "--markdown", tmp_path / "decode_forms.json").stdout
    assert "| pallas_norm | " in table


def test_mp4_write(tmp_path):
    """The write phase by what the frames hold: noise costs the encoder more bytes than a
    moving gradient, both written and timed."""
    out = tmp_path / "mp4.json"
    bench("mp4_write.py", "--res", "64x32", "--frames", "5", "--repeats", "1", "--out", out)
    (row,) = rows(out)
    assert row["noise"]["seconds"]["runs"] == 1 and row["gradient"]["seconds"]["runs"] == 1
    assert row["noise"]["bytes"] > 2 * row["gradient"]["bytes"] > 0


def test_chip_profile(tmp_path, tiny_build, tiny_weights):
    """The profile's run on this host: its trace written, the step timed, the phases and the
    memory outcome recorded (a CPU trace has no device plane to sum)."""
    bench("chip_profile.py", "--artifacts", tiny_build.parent, "--build", tiny_build.name,
          "--weights", tiny_weights, "--res", TINY_SHAPE[1], "--frames", TINY_SHAPE[3],
          "--name", "tiny", "--out", tmp_path)  # fmt: skip
    summary = json.loads((tmp_path / "profile_tiny.json").read_text())
    assert summary["traced_steps"] == 2 and summary["wall_ms_per_step"] > 0
    assert summary["plane"] is None and summary["memory"]["placement"]["transformer"] == "resident"


def test_chip_profile_counts_control_flow_once():
    """A trace's op names as the TPU writes them: the loop and the step cache's conditional
    enclose ops that are counted themselves, so they are not summed again."""
    sys.path.insert(0, str(ROOT / "bench"))
    import chip_profile

    enclosing = ["%while.3 = (s32[]) while((s32[]) %t), body=%b", "%cond.8 = (bf16[2]{0}) "
                 "conditional(s32[] %i, bf16[2]{0} %x), branch_computations={%a, %c}"]  # fmt: skip
    counted = ["%fusion.307 = bf16[2]{0} fusion(bf16[2]{0} %x), kind=kLoop, calls=%f",
               "%copy.12 = bf16[2,4]{0,1} copy(bf16[2,4]{1,0} %y)"]  # fmt: skip
    assert all(chip_profile.CONTAINERS.search(name) for name in enclosing)
    assert not any(chip_profile.CONTAINERS.search(name) for name in counted)
    assert [chip_profile.kind_of(name) for name in counted] == ["norm/elementwise", "layout copy"]


def test_chip_transfer(tmp_path, tiny_weights):
    """Placing a component as the runtime does and the copies beside it, on this host's devices:
    every measurement timed, the component's bytes counted."""
    out = tmp_path / "transfer.json"
    bench("chip_transfer.py", "--weights", tiny_weights, "--component", "transformer",
          "--repeat", "1", "--out", out)  # fmt: skip
    (row,) = rows(out)
    assert row["bytes"] > 0 and row["tensors"] > 1 and row["devices_s"] >= 0
    assert set(row["seconds"]) >= {"load_component", "put from the map, 1 thread"}
    assert all(len(times) == 1 for times in row["seconds"].values())


def test_chip_attention_variants():
    """The kernel variants the chip times (TPU only: here they are made, not run), the dense
    default first and the Radial densities the build's arithmetic gives."""
    sys.path.insert(0, str(ROOT / "bench"))
    import chip_attention

    from wan.models.radial_mask import RadialSpec, density

    made = chip_attention.variants()
    assert next(iter(made)) == "dense 2048/1024/512"
    spec = RadialSpec(chip_attention.FRAMES, chip_attention.TOKENS_PER_FRAME, block=1024)
    assert made["radial1024 1024/1024/1024"][1] == density(spec, 1024, 1024)
    assert made["radial1024 1024/1024/512"][1] == density(spec, 1024, 1024)  # keys 512 a step
    assert made["dense 2048/1024/512 segment ids"][0] is chip_attention.with_segment_ids
