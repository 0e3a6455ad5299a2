"""The TPU generation table against libtpu: every generation's single-host VM has the devices
the table says, in the layout the real VMs run, and every per-device figure is the chip's
divided by the devices a chip. Topology queries only, nothing compiles."""

from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import deviceless_tpu_devices

from aot import targets

GiB = 1 << 30


@pytest.fixture
def deviceless(monkeypatch):
    """`targets.devices` for one generation at a time, as prepare_environment sets it up."""
    pytest.importorskip("libtpu", reason="needs the tpu extra")
    return lambda target: deviceless_tpu_devices(monkeypatch, target)


@pytest.mark.parametrize("generation", sorted(targets.GENERATIONS))
def test_each_generations_vm_has_the_tables_devices(generation, deviceless):
    chip = targets.GENERATIONS[generation]
    target = targets.parse_target(chip.alias)
    devices = deviceless(target)
    chips = {tuple(d.coords) for d in devices}
    assert len(chips) == math.prod(chip.host_bounds)
    assert len(devices) == len(chips) * chip.devices_per_chip
    assert targets.devices_per_chip(devices) == chip.devices_per_chip
    # Each device of a chip is one of its TensorCores.
    assert {d.core_on_chip for d in devices} == set(range(chip.devices_per_chip))
    assert {d.process_index for d in devices} == {0}  # one host, one process
    per_chip = chip.devices_per_chip
    assert target.hbm_bytes == chip.hbm_bytes_per_chip // per_chip
    assert targets.peak_flops(target, devices[0].device_kind) == chip.peak_bf16_per_chip / per_chip
    assert chip.peak_8bit == chip.peak_8bit_per_chip / per_chip
    assert targets.TPU_HBM[generation] == target.hbm_bytes


@pytest.mark.parametrize(
    ("alias", "devices", "hbm_gib", "peak_tflops", "kind"),
    [
        ("tpu7x-8", 8, 96, 1153.5, "TPU7x"),  # 2 TensorCores a chip: half a chip each
        ("tpu-v4-8", 4, 32, 275, "TPU v4"),  # megacore: a whole chip each
        ("tpu-v5p-8", 4, 95, 459, "TPU v5"),
        ("tpu-v5e-8", 8, 16, 197, "TPU v5 lite"),
        ("tpu-v6e-8", 8, 32, 918, "TPU v6 lite"),
    ],
)
def test_per_device_figures(alias, devices, hbm_gib, peak_tflops, kind, deviceless):
    target = targets.parse_target(alias)
    found = deviceless(target)
    assert (len(found), found[0].device_kind) == (devices, kind)
    assert target.hbm_bytes == hbm_gib * GiB
    assert targets.peak_flops(target, kind) == peak_tflops * 1e12


def test_v4_needs_its_chip_config(deviceless):
    """Without megacore libtpu gives a v4-8 eight half-chip devices, which its VM does not
    have: the table's chip config is what makes the 4."""
    from jax.experimental import topologies

    deviceless(targets.parse_target("tpu-v4-8"))  # sets the environment, loads libtpu
    default = topologies.get_topology_desc(
        platform="tpu", topology_name="v4:2x2x1", chips_per_host_bounds=(2, 2, 1)
    ).devices
    assert targets.devices_per_chip(default) == 2


def test_a_layout_unlike_the_table_is_refused(deviceless, monkeypatch):
    """Per-device figures divide by the table's devices a chip: a libtpu that lays the chips
    out otherwise is refused, not built with wrong budgets."""
    tpu7x = targets.GENERATIONS["tpu7x"]
    monkeypatch.setitem(
        targets.GENERATIONS, "tpu7x", dataclasses.replace(tpu7x, devices_per_chip=1)
    )
    with pytest.raises(targets.TargetError, match=r"2 device\(s\) a chip, .* says 1"):
        deviceless(targets.parse_target("tpu7x-8"))


def test_8bit_rates():
    """Every generation has an 8-bit rate at least its bf16 one (v4: equal, no faster path)."""
    for chip in targets.GENERATIONS.values():
        assert chip.peak_8bit_per_chip >= chip.peak_bf16_per_chip, chip.name
    assert targets.GENERATIONS["v4"].peak_8bit_per_chip == 275e12
    assert targets.GENERATIONS["tpu7x"].peak_8bit == 2307e12


def test_aliases_and_host_bounds_come_from_the_table():
    assert targets.TPU_ALIASES == {
        "tpu-v4-8": "v4:2x2x1",
        "tpu-v5e-8": "v5e:2x4",
        "tpu-v5p-8": "v5p:2x2x1",
        "tpu-v6e-8": "v6e:2x4",
        "tpu7x-8": "tpu7x:2x2x1",
    }
    assert targets.parse_target("tpu-v6e:4x4").chips_per_host == (2, 4, 1)
    assert targets.parse_target("tpu-tpu7x:4x4x4").chips_per_host == (2, 2, 1)


def test_help_describes_the_table():
    assert targets.describe_hosts() == (
        "v4/v5p/tpu7x 4 chips, v5e/v6e 8 chips; devices a chip: v4/v5e/v5p/v6e 1, tpu7x 2"
    )
