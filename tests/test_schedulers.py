"""Samplers vs diffusers' UniPCMultistepScheduler (as WanPipeline configures it) and
FlowMatchEulerDiscreteScheduler, driven by the same fake model; and one compiled step for all."""

import jax
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from wan.configs import SchedulerConfig
from wan.schedulers import init_state, make_tables, step

SHAPE = (2, 3, 4, 4, 8)  # (B, T, H, W, C)
_rng = np.random.default_rng(0)
PATTERN = _rng.standard_normal(SHAPE).astype(np.float32)
INIT = _rng.standard_normal(SHAPE).astype(np.float32)
STEP = jax.jit(step)


def fake_velocity(sample: np.ndarray, t: float) -> np.ndarray:
    """A deterministic stand-in for the transformer: depends on the sample and the timestep."""
    return (sample - 0.8 * np.tanh(sample * (1 + t / 1000)) + 0.3 * PATTERN).astype(np.float32)


def reference(cfg: SchedulerConfig, num_steps: int):
    if cfg.kind == "unipc":
        ref = UniPCMultistepScheduler(
            num_train_timesteps=cfg.num_train_timesteps, prediction_type="flow_prediction",
            use_flow_sigmas=True, flow_shift=cfg.flow_shift, solver_order=cfg.solver_order,
            solver_type="bh2", predict_x0=True, lower_order_final=True,
        )  # fmt: skip
    else:
        ref = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=cfg.num_train_timesteps, shift=cfg.flow_shift
        )
    ref.set_timesteps(num_steps)
    ref.set_begin_index(0)  # as WanPipeline
    return ref


@pytest.mark.parametrize("kind", ["unipc", "euler"])
@pytest.mark.parametrize("shift", [3.0, 5.0, 12.0])
@pytest.mark.parametrize("num_steps", [1, 4, 10, 50])
def test_tables_match_diffusers_schedule(kind, shift, num_steps):
    cfg = SchedulerConfig(kind=kind, flow_shift=shift)
    ref = reference(cfg, num_steps)
    tables = make_tables(cfg, num_steps)
    np.testing.assert_array_equal(tables.timesteps, ref.timesteps.numpy().astype(np.float32))
    np.testing.assert_array_equal(tables.sigmas, ref.sigmas.numpy())
    assert tables.sigmas[-1] == 0


def run_both(cfg: SchedulerConfig, num_steps: int) -> list[float]:
    """Max abs difference of the samples after every step."""
    ref, tables = reference(cfg, num_steps), make_tables(cfg, num_steps)
    theirs, ours, state = torch.from_numpy(INIT.copy()), INIT.copy(), init_state(cfg, SHAPE)
    errors = []
    for i, t in enumerate(ref.timesteps):
        assert float(t) == tables.timesteps[i]
        v = torch.from_numpy(fake_velocity(theirs.numpy(), float(t)))
        theirs = ref.step(v, t, theirs, return_dict=False)[0]
        v = fake_velocity(np.asarray(ours), float(tables.timesteps[i]))
        ours, state = STEP(tables.row(i), state, v, ours)
        errors.append(float(np.abs(theirs.numpy() - np.asarray(ours)).max()))
    return errors


@pytest.mark.parametrize(
    "shift,num_steps,order",
    [(3.0, 10, 2), (5.0, 10, 2), (12.0, 10, 2), (5.0, 4, 2), (5.0, 2, 2), (3.0, 50, 2),
     (5.0, 10, 1), (5.0, 10, 3)],
)  # fmt: skip
def test_unipc_matches_diffusers(shift, num_steps, order):
    errors = run_both(SchedulerConfig("unipc", flow_shift=shift, solver_order=order), num_steps)
    assert np.all(np.array(errors) <= 1e-5), errors  # NaN fails too


@pytest.mark.parametrize("shift,num_steps", [(3.0, 10), (5.0, 10), (12.0, 10), (5.0, 4)])
def test_euler_matches_diffusers(shift, num_steps):
    errors = run_both(SchedulerConfig("euler", flow_shift=shift), num_steps)
    assert np.all(np.array(errors) <= 1e-5), errors  # NaN fails too


def test_one_compiled_step_serves_every_step_count_and_kind():
    # A fresh function: jit caches are shared by every jax.jit of the same function (STEP).
    jitted = jax.jit(lambda row, state, v, sample: step(row, state, v, sample))
    device = jax.devices()[0]
    finals = []
    for cfg, num_steps in [
        (SchedulerConfig("unipc", flow_shift=5.0), 10),
        (SchedulerConfig("unipc", flow_shift=5.0), 4),
        (SchedulerConfig("euler", flow_shift=5.0), 10),
    ]:
        tables = make_tables(cfg, num_steps)
        # Committed device arrays throughout, as the outputs are, so that one signature is used.
        sample = jax.device_put(INIT, device)
        state = jax.device_put(init_state(cfg, SHAPE), device)
        for i in range(num_steps):
            v = fake_velocity(np.asarray(sample), float(tables.timesteps[i]))
            sample, state = jitted(tables.row(i), state, v, sample)
        finals.append(np.asarray(sample))
    assert jitted._cache_size() == 1
    assert np.abs(finals[0] - finals[1]).max() > 1e-3  # the schedules really differed


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown sampler kind"):
        make_tables(SchedulerConfig(kind="ddim"), 10)
