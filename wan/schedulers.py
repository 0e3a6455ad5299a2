"""Flow-matching samplers as host-side tables plus one pure update.

diffusers' `UniPCMultistepScheduler` (flow sigmas, bh2, predict_x0, lower_order_final, as
WanPipeline configures it) and `FlowMatchEulerDiscreteScheduler` keep Python state and branch on
the step index. Here every per-step number is computed on the host (numpy, float64, then
float32) into `SamplerTables`, and `step` does the same multiply-adds at every step. The step
index only selects a table row, and the row is an input of the compiled program, so one
executable serves every step of every step count.

Both samplers are linear in the sample x and the data predictions x0 = x - sigma * v:

    corrected = keep * x + c_last * x_prev + c_x0 * x0_i + sum_k c_hist[k] * x0_{i-1-k}   (UniC)
    x_next    = p_sample * corrected + p_x0 * x0_i + sum_k p_hist[k] * x0_{i-1-k}         (UniP)

`keep` is 1 where there is no corrector (UniPC step 0, every Euler step). Euler is the order-1
predictor x_next = x + (sigma_next - sigma) * v written in the same form.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from wan.configs import SAMPLERS, SchedulerConfig

# diffusers pulls a first sigma of exactly 1 down by this, so that log(alpha) stays finite.
_UNIPC_SIGMA_MAX_EPS = 1e-6


class SamplerState(NamedTuple):
    """What a step carries to the next: the corrected sample and the last x0 predictions
    (x0_history[k] is x0 of step i-1-k). Euler carries the same arrays and ignores them."""

    last_sample: jax.Array
    x0_history: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplerTables:
    """Per-step inputs of `step`, row i for step i (num_steps rows; `sigmas` has one more)."""

    timesteps: np.ndarray  # (N,) what the transformer receives
    sigmas: np.ndarray  # (N + 1,) ending in 0
    keep: np.ndarray  # (N,) weight of the incoming sample in the corrected sample
    c_last: np.ndarray  # (N,) UniC: previous corrected sample
    c_x0: np.ndarray  # (N,) UniC: this step's x0
    c_hist: np.ndarray  # (N, order) UniC: earlier x0s
    p_sample: np.ndarray  # (N,) UniP: corrected sample
    p_x0: np.ndarray  # (N,) UniP: this step's x0
    p_hist: np.ndarray  # (N, order) UniP: earlier x0s

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def row(self, i: int) -> dict[str, np.ndarray]:
        """The scheduler inputs of step i (float32 numpy; same shapes for every i)."""
        return {
            "timestep": np.asarray(self.timesteps[i]),
            "sigma": np.asarray(self.sigmas[i]),
            "keep": np.asarray(self.keep[i]),
            "c_last": np.asarray(self.c_last[i]),
            "c_x0": np.asarray(self.c_x0[i]),
            "c_hist": self.c_hist[i],
            "p_sample": np.asarray(self.p_sample[i]),
            "p_x0": np.asarray(self.p_x0[i]),
            "p_hist": self.p_hist[i],
        }


def _shift(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """Flow-matching timestep shift (SD3): more steps at high noise for shift > 1."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _unipc_schedule(cfg: SchedulerConfig, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' UniPC `set_timesteps` with use_flow_sigmas: (timesteps, sigmas + final 0)."""
    n_train = cfg.num_train_timesteps
    sigmas = _shift(np.linspace(1, 1 / n_train, num_steps + 1)[:-1], cfg.flow_shift)
    if abs(sigmas[0] - 1) < _UNIPC_SIGMA_MAX_EPS:
        sigmas[0] -= _UNIPC_SIGMA_MAX_EPS
    timesteps = (sigmas * n_train).astype(np.int64)  # diffusers stores int64 timesteps
    return timesteps.astype(np.float32), np.append(sigmas, 0.0).astype(np.float32)


def _euler_schedule(cfg: SchedulerConfig, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' FlowMatchEulerDiscreteScheduler `set_timesteps`: (timesteps, sigmas + final 0).

    diffusers spans the range of its already shifted float32 training sigmas and then shifts
    again, so the last sigma is shifted twice; kept for parity."""
    n_train = cfg.num_train_timesteps
    train = np.linspace(1, n_train, n_train, dtype=np.float32)[::-1] / np.float32(n_train)
    train = _shift(train, cfg.flow_shift)  # float32, as diffusers' __init__
    span = np.linspace(float(train[0]) * n_train, float(train[-1]) * n_train, num_steps)
    sigmas = _shift(span / n_train, cfg.flow_shift).astype(np.float32)
    return sigmas * np.float32(n_train), np.append(sigmas, np.float32(0))


def _uni_bh2(
    lam: np.ndarray, alpha: np.ndarray, sigma: np.ndarray, t: int, s: list[int], corrector: bool
) -> tuple[float, float, np.ndarray]:
    """UniPC B(h)=expm1 update (data prediction) from sigma index s[0] to t as coefficients.

    Returns (c_x, c_m0, w) with x_t = c_x * x_s0 + c_m0 * m0 + sum_k w[k] * m_k, where m_k is the
    x0 prediction at s[k] (k >= 1) and, for the corrector (UniC), a last point: the x0 at t.
    Mirrors diffusers' multistep_uni_p_bh_update / multistep_uni_c_bh_update."""
    order = len(s)
    h = lam[t] - lam[s[0]]
    rks = np.append((lam[s[1:]] - lam[s[0]]) / h, 1.0)
    hh = -h
    h_phi_1 = b_h = np.expm1(hh)  # bh2: B(h) = h * phi_1(h)
    h_phi_k = h_phi_1 / hh - 1
    factorial = 1
    b = []
    for i in range(1, order + 1):
        b.append(h_phi_k * factorial / b_h)
        factorial *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    r = np.stack([rks ** (i - 1) for i in range(1, order + 1)])
    b = np.array(b)
    if corrector:
        rhos = np.array([0.5]) if order == 1 else np.linalg.solve(r, b)
    else:
        rks = rks[:-1]
        if order == 1:
            rhos = np.zeros(0)
        elif order == 2:
            rhos = np.array([0.5])
        else:
            rhos = np.linalg.solve(r[:-1, :-1], b[:-1])
    # D_k = (m_k - m0) / r_k enters as -alpha_t * B(h) * rho_k * D_k.
    w = -alpha[t] * b_h * rhos / rks
    return sigma[t] / sigma[s[0]], -alpha[t] * h_phi_1 - w.sum(), w


def make_tables(cfg: SchedulerConfig, num_steps: int) -> SamplerTables:
    """All per-step inputs of `step` for `num_steps` steps of the sampler `cfg.kind`."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    order = cfg.solver_order
    n = num_steps
    keep, c_last, c_x0, p_sample, p_x0 = (np.zeros(n) for _ in range(5))
    c_hist, p_hist = np.zeros((n, order)), np.zeros((n, order))
    if cfg.kind == "euler":
        timesteps, sigmas = _euler_schedule(cfg, n)
        keep[:] = 1
        p_sample[:] = sigmas[1:].astype(np.float64) / sigmas[:-1]
        p_x0[:] = 1 - p_sample
    elif cfg.kind == "unipc":
        timesteps, sigmas = _unipc_schedule(cfg, n)
        sig = sigmas.astype(np.float64)  # coefficients from the float32 schedule, like diffusers
        alpha = 1 - sig
        with np.errstate(divide="ignore"):
            lam = np.log(alpha) - np.log(sig)  # +inf at the final sigma 0
        # Multistep warm-up and lower_order_final.
        orders = [min(order, n - i, i + 1) for i in range(n)]
        for i in range(n):
            if i == 0:
                keep[i] = 1
            else:
                # UniC refines the sample that step i-1's predictor produced, with its order.
                prev = [i - 1 - k for k in range(orders[i - 1])]
                c_last[i], c_hist[i, 0], w = _uni_bh2(lam, alpha, sig, i, prev, corrector=True)
                c_hist[i, 1 : len(w)], c_x0[i] = w[:-1], w[-1]
            here = [i - k for k in range(orders[i])]
            p_sample[i], p_x0[i], w = _uni_bh2(lam, alpha, sig, i + 1, here, corrector=False)
            p_hist[i, : len(w)] = w
    else:
        raise ValueError(
            f"unknown sampler kind {cfg.kind!r}: expected one of {', '.join(SAMPLERS)}"
        )
    tables = dict(
        timesteps=timesteps, sigmas=sigmas, keep=keep, c_last=c_last, c_x0=c_x0, c_hist=c_hist,
        p_sample=p_sample, p_x0=p_x0, p_hist=p_hist,
    )  # fmt: skip
    return SamplerTables(**{k: np.asarray(v, np.float32) for k, v in tables.items()})


def init_state(
    cfg: SchedulerConfig, latents_shape: tuple[int, ...], dtype: np.dtype = np.float32
) -> SamplerState:
    """The state before step 0, as host arrays (no device op, so no compile). Its shapes depend
    on `cfg.solver_order` only, the same for both kinds."""
    return SamplerState(
        last_sample=np.zeros(latents_shape, dtype),
        x0_history=np.zeros((cfg.solver_order, *latents_shape), dtype),
    )


def step(
    row: dict[str, jax.Array], state: SamplerState, model_output: jax.Array, sample: jax.Array
) -> tuple[jax.Array, SamplerState]:
    """One sampler step: (flow velocity prediction, sample at step i) -> sample at step i+1.

    Pure multiply-adds with the coefficients of `row` (`SamplerTables.row(i)`), no branch on
    the step index; the history length comes from the shapes."""
    hist = state.x0_history
    x0 = sample - row["sigma"] * model_output.astype(sample.dtype)

    def with_history(acc: jax.Array, weights: jax.Array) -> jax.Array:
        # An explicit sum, not a dot: a dot may run at reduced precision on accelerators.
        for k in range(hist.shape[0]):
            acc = acc + weights[k] * hist[k]
        return acc

    corrected = with_history(
        row["keep"] * sample + row["c_last"] * state.last_sample + row["c_x0"] * x0, row["c_hist"]
    )
    new_sample = with_history(row["p_sample"] * corrected + row["p_x0"] * x0, row["p_hist"])
    new_hist = jnp.concatenate([x0[None], hist[:-1]])
    return new_sample, SamplerState(last_sample=corrected, x0_history=new_hist)
