"""Which weights stay on the devices (wan.residency): the arithmetic of the resident peak, the
plan a build makes under its budget, what the manifest records and `aot check` holds to the
budget, and the runtime placing a transient component for its program and deleting it after.

On the development TPU v5e the 1.3B 480p build's predicted 13.57 GiB met the device's reported
peak of 13.53 GiB (docs/benchmarks.md, "On a TPU v5e chip"); a CPU reports no memory, so here
the per-device bytes the runtime actually holds are summed from its arrays' shards."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import TINY_SHAPE, run_cli, with_its_store

from runtime.builds.artifact import program_memory, read_manifest
from runtime.generation.pipeline import Pipeline
from runtime.generation.request import RequestError
from wan import interface
from wan.configs import ModelConfig
from wan.residency import (
    RESIDENT,
    TRANSIENT,
    ProgramMemory,
    movable,
    parse_override,
    plan,
    resident_peak,
)

T2V = interface.PIPELINES["t2v"]
MEMORY = {  # per device, made up: the text encoder's program is the largest
    "text_encode": ProgramMemory(peak=110, code=1),
    "kv_cache": ProgramMemory(peak=25, code=1),
    "denoise_step": ProgramMemory(peak=50, code=2),
    "latents_handoff": ProgramMemory(peak=1, code=0),
    "vae_decode": ProgramMemory(peak=60, code=3),
}
WEIGHTS = {"text_encoder": 100, "transformer": 20, "vae": 5}


def test_the_resident_peak_is_a_programs_peak_and_the_weights_it_does_not_take():
    code = 7
    every = resident_peak(T2V, MEMORY, WEIGHTS, {})  # all resident
    # The decode: its 60 (its 5 of VAE among them) and the encoder's 100 and the transformer's 20.
    assert every == (60 + 100 + 20 + code, "vae_decode")
    freed = resident_peak(T2V, MEMORY, WEIGHTS, {"text_encoder": TRANSIENT})
    assert freed == (110 + 20 + 5 + code, "text_encode")  # the encoder only in its own program
    both = resident_peak(T2V, MEMORY, WEIGHTS, {"text_encoder": TRANSIENT, "vae": TRANSIENT})
    assert both == (110 + 20 + code, "text_encode")


def test_two_experts_each_step_keeps_the_other():
    weights = {**WEIGHTS, "transformer_2": 20}
    peak, at = resident_peak(T2V, MEMORY, weights, {"text_encoder": TRANSIENT})
    # The step (50, one expert's 20 in it) with the other expert, the VAE: 75 < the encode's.
    assert (peak, at) == (110 + 20 + 20 + 5 + 7, "text_encode")
    heavy = {**MEMORY, "denoise_step": ProgramMemory(peak=200, code=2)}
    assert resident_peak(T2V, heavy, weights, {"text_encoder": TRANSIENT}) == (
        200 + 20 + 5 + 7,
        "denoise_step",
    )


def test_the_plan_frees_what_lowers_the_peak_most_and_only_what_the_budget_needs():
    assert plan(T2V, MEMORY, WEIGHTS, None) == dict.fromkeys(WEIGHTS, RESIDENT)
    assert plan(T2V, MEMORY, WEIGHTS, 10_000) == dict.fromkeys(WEIGHTS, RESIDENT)
    assert plan(T2V, MEMORY, WEIGHTS, 150) == {
        "text_encoder": TRANSIENT, "transformer": RESIDENT, "vae": RESIDENT
    }  # fmt: skip
    # Under every plan's peak: everything movable that lowers it transient, the transformer
    # too (placed for its request's kv_cache and steps), but not one of two experts, nor a
    # continuous build's.
    assert plan(T2V, MEMORY, WEIGHTS, 10) == dict.fromkeys(WEIGHTS, TRANSIENT)
    experts = {**WEIGHTS, "transformer_2": 20}
    assert plan(T2V, MEMORY, experts, 10) == {
        "text_encoder": TRANSIENT, "transformer": RESIDENT, "transformer_2": RESIDENT,
        "vae": TRANSIENT,
    }  # fmt: skip
    assert movable(T2V, experts) == ("text_encoder", "vae")
    continuous = [*T2V, *interface.CONTINUOUS_PROGRAMS["denoise_step"]]
    assert movable(continuous, WEIGHTS) == ("text_encoder", "vae")
    assert movable(T2V, WEIGHTS) == ("text_encoder", "vae", "transformer")
    # A component whose program is the peak gains nothing transient: of the others, the one
    # that lowers it most is chosen (the transformer's 20 over the VAE's 5), then no more.
    encoder_bound = {**MEMORY, "text_encode": ProgramMemory(peak=300, code=1)}
    assert plan(T2V, encoder_bound, WEIGHTS, 320) == {
        "text_encoder": RESIDENT, "transformer": TRANSIENT, "vae": RESIDENT
    }  # fmt: skip


@pytest.mark.parametrize(
    "text, says",
    [("text_encoder", "COMPONENT=PLACEMENT"), ("text_encoder=away", "resident, transient"),
     ("transformer_2=transient", "cannot be transient"), ("=transient", "nothing cannot")],
)  # fmt: skip
def test_placement_overrides_are_checked(text, says):
    with pytest.raises(ValueError, match=says) as refused:
        parse_override(text)
    assert "\n" not in str(refused.value)
    assert parse_override("vae=transient") == ("vae", TRANSIENT)


def _shard_bytes(tree, device) -> int:
    """Bytes of `tree`'s arrays held on `device`."""
    return sum(
        s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards
        if s.device == device
    )  # fmt: skip


def test_the_manifest_records_each_components_bytes_per_device(tiny_build, tiny_weights):
    """weight_bytes is what a device holds of each component once placed, and the recorded
    resident peak is the arithmetic over the recorded programs."""
    manifest = read_manifest(tiny_build)
    assert manifest.placement == dict.fromkeys(manifest.weight_bytes, RESIDENT)  # cpu: no budget
    assert (manifest.resident_peak_bytes, manifest.resident_peak_program) == (
        manifest.resident_peak()
    )
    config = ModelConfig.from_folder(tiny_weights)
    pipe = Pipeline.from_build(tiny_build, manifest, tiny_weights, config)
    device = jax.devices()[manifest.device_ids[0]]
    for component, recorded in manifest.weight_bytes.items():
        assert _shard_bytes(pipe.params[component], device) == recorded, component


def test_transient_weights_live_for_their_programs_only(tiny_build, tiny_weights):
    """A transient encoder is placed beside the others at load (prefetch: the first program
    takes it) and deleted once the prompt is encoded; a transient transformer is not placed at
    load (beside the encoder it would outgrow the predicted peak: 13.53 GiB against 12.14 on the
    v5e at 1280x720), lives from the kv_cache to the last step and is gone before the decode. Both are placed again for the next generation, and the frames are
    those of resident weights."""
    manifest = read_manifest(tiny_build)
    config = ModelConfig.from_folder(tiny_weights)
    placement = {"text_encoder": TRANSIENT, "transformer": TRANSIENT}
    transient = Pipeline.from_build(
        tiny_build, manifest, tiny_weights, config, placement=placement, prefetch=True
    )
    first = transient.params["text_encoder"]
    assert "transformer" not in transient.params
    live_during_steps = []

    def on_step(done: int, total: int) -> None:
        live_during_steps.append(tuple(c in transient.params for c in placement))

    frames, report = transient.generate("a red cat", steps=2, seed=3, on_step=on_step)
    assert live_during_steps == [(False, True), (False, True)]
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(first))
    assert not set(placement) & set(transient.params)
    assert report.memory.placement == {**manifest.placement, **placement}
    assert (
        report.memory.predicted_peak_bytes
        == manifest.resident_peak({**manifest.placement, **placement})[0]
    )
    again, _ = transient.generate("a red cat", steps=2, seed=3)
    resident = Pipeline.from_build(tiny_build, manifest, tiny_weights, config)
    want, _ = resident.generate("a red cat", steps=2, seed=3)
    np.testing.assert_array_equal(frames, want)
    np.testing.assert_array_equal(again, want)
    with pytest.raises(RequestError, match="has no transformer_2") as refused:
        Pipeline.from_build(
            tiny_build, manifest, tiny_weights, config, placement={"transformer_2": TRANSIENT}
        )
    assert "\n" not in str(refused.value)


def test_a_budget_decides_the_placement_and_check_holds_the_resident_peak(tiny_build, tmp_path):
    """Built with a budget under the all-resident peak, the build makes transient what the
    plan says (the tiny model's peak is its text encoder's program: the VAE is what frees
    memory there) and passes; checked against a budget under even that, `aot check` names the
    peak, where it is reached and what to change."""
    manifest = read_manifest(tiny_build)
    every = manifest.resident_peak()[0]
    memory, order = program_memory(manifest.programs), manifest.key.programs
    chosen = plan(order, memory, manifest.weight_bytes, every - 1)
    freed = resident_peak(order, memory, manifest.weight_bytes, chosen)[0]
    assert freed < every and TRANSIENT in chosen.values()
    out = tmp_path / "artifacts"
    with_its_store(tiny_build, out)  # its programs reused: only the manifest changes
    policy = tmp_path / "budget.toml"
    policy.write_text(f'[targets."*"]\nbudget_bytes = {every - 1}\n')
    run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8",
            "--policy", str(policy), "--out", str(out))  # fmt: skip
    rebuilt = read_manifest(out / tiny_build.name)
    assert rebuilt.placement == chosen and rebuilt.resident_peak_bytes == freed
    assert run_cli("aot", "check", "--policy", str(policy), str(out)).returncode == 0

    policy.write_text(f'[targets."*"]\nbudget_bytes = {freed - 1}\n')
    result = run_cli("aot", "check", "--policy", str(policy), "--json", str(out), check=False)
    assert result.returncode == 1
    (violation,) = json.loads(result.stdout)["violations"]
    assert violation["rule"] == "memory" and violation["actual"] == freed
    assert "resident peak" in violation["message"] and "--quant w8a8-int8" in violation["message"]
    # The plan moved the VAE (the tiny one outweighs the tiny transformer); what still lowers
    # the peak is named, not the encoder, whose program the peak is.
    assert chosen["vae"] == TRANSIENT and chosen["transformer"] == RESIDENT
    assert (
        "make transformer transient (`runtime run --placement transformer=transient`)"
        in (violation["message"])
    )
    build = json.loads(result.stdout)["builds"][0]
    assert build["resident_peak_bytes"] == freed and build["placement"] == chosen


def test_the_memory_violation_names_only_moves_that_lower_the_peak(tiny_build):
    """All resident over the budget: the tiny build's peak is its text encoder's program, so
    the hint names the VAE and the transformer (transient, they leave that peak) and not the
    encoder, which is in it."""
    from aot.reports.check import resident_violation

    manifest = read_manifest(tiny_build)
    every = dataclasses.replace(manifest, placement=dict.fromkeys(manifest.weight_bytes, RESIDENT))
    peak, at = every.resident_peak()
    assert at == "text_encode"
    message = resident_violation(tiny_build, every, peak - 1).message
    assert "make vae, transformer transient (`runtime run --placement vae=transient`)" in message
    assert "text_encoder transient" not in message


def test_runtime_run_takes_a_placement_and_reports_it(tiny_build, tiny_weights, tmp_path):
    report = tmp_path / "r.json"
    run_cli("runtime", "run", "--artifacts", str(tiny_build.parent), "--weights",
            str(tiny_weights), *TINY_SHAPE, "--prompt", "a cat", "--steps", "1", "--out",
            str(tmp_path / "v.mp4"), "--report", str(report), "--placement",
            "text_encoder=transient")  # fmt: skip
    memory = json.loads(report.read_text())["memory"]
    assert memory["placement"]["text_encoder"] == TRANSIENT
    assert memory["device_peak_bytes"] is None  # a CPU reports none
    refused = run_cli("runtime", "run", "--artifacts", str(tiny_build.parent), "--weights",
                      str(tiny_weights), *TINY_SHAPE, "--prompt", "a cat", "--out",
                      str(tmp_path / "w.mp4"), "--placement", "transformer_2=transient",
                      check=False)  # fmt: skip
    assert refused.returncode == 2 and "cannot be transient" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "w.mp4").exists()
