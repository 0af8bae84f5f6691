"""Samplers of Wan2.2-S2V (official: 40 UniPC steps, shift 3) and of LiveAvatar (4 Euler steps, shift 3).

Flow convention of Wan: x_sigma = (1 - sigma) * data + sigma * noise, the model predicts the flow
v = noise - data, and sigma runs from ~1 (noise) down to 0 (data). Guidance is the caller's business: the
sampler calls one `flow_fn(x, t)` per step and the caller folds CFG (u + g * (c - u)) into it.

UniPC is diffusers' `UniPCMultistepScheduler` (flow sigmas, order 2, bh2, predict_x0, lower_order_final), which
is the update the official `FlowUniPCMultistepScheduler` was copied from. Its own flow schedule is not the
official one (it spaces sigma from 1 to 1/1000; the official spaces it from 0.999 to 0, giving
999, 991, ..., 71 instead of 999, 991, ..., 74), so the official sigma grid is handed to it explicitly; with
that grid it reproduces the official timesteps, sigmas and samples bit for bit (tests/test_wan_sampler.py).
"""

from collections.abc import Callable

import numpy as np
import torch

# (x, t) -> flow prediction shaped like x. t is the official timestep: an int64 tensor of shape (1,).
FlowFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

NUM_TRAIN_TIMESTEPS = 1000


def _shift(sigma, shift: float):
    """Resolution shift of a flow sigma toward the noisy end: 3s / (1 + 2s) for shift 3."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def _unipc_base_sigmas(steps: int) -> np.ndarray:
    """The official unshifted grid, float64: linspace(sigma_max, sigma_min, steps + 1)[:-1]. The official
    scheduler reads sigma_max back from a float32 table (1 - 1/1000 -> 0.9990000128746033) and sigma_min is 0."""
    sigma_max = float(np.float32(1.0 - 1.0 / NUM_TRAIN_TIMESTEPS))
    return np.linspace(sigma_max, 0.0, steps + 1)[:-1]


def unipc_schedule(steps: int = 40, shift: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The official UniPC schedule: (timesteps int64 (steps,), sigmas float32 (steps + 1,) ending in 0).

    timesteps are the shifted sigmas times 1000 truncated to int64 (999, 991, ..., 71 for 40 steps, shift 3);
    the sigmas are the untruncated shifted values rounded to float32. The model sees the integer timestep and
    the update uses the sigma, exactly as in wan/utils/fm_solvers_unipc.py set_timesteps.
    """
    sigmas = _shift(_unipc_base_sigmas(steps), shift)  # float64, (steps,)
    timesteps = torch.from_numpy((sigmas * NUM_TRAIN_TIMESTEPS).astype(np.int64))
    sigmas = torch.from_numpy(np.concatenate([sigmas, [0.0]]).astype(np.float32))
    return timesteps, sigmas


def make_unipc_scheduler(steps: int = 40, shift: float = 3.0):
    """A diffusers UniPCMultistepScheduler set to the official schedule; checked against `unipc_schedule`.

    diffusers is imported here, not at module import: it costs ~1.6 s and only sampling needs it."""
    from diffusers import UniPCMultistepScheduler

    sched = UniPCMultistepScheduler(
        num_train_timesteps=NUM_TRAIN_TIMESTEPS, solver_order=2, prediction_type="flow_prediction",
        predict_x0=True, solver_type="bh2", lower_order_final=True, use_flow_sigmas=True, flow_shift=shift)
    sched.set_timesteps(sigmas=_unipc_base_sigmas(steps))  # shifted by flow_shift inside
    timesteps, sigmas = unipc_schedule(steps, shift)
    if not (torch.equal(sched.timesteps, timesteps) and torch.equal(sched.sigmas, sigmas)):
        # A diffusers release that changed its flow schedule would sample off the official grid: refuse.
        raise RuntimeError("diffusers' UniPCMultistepScheduler no longer reproduces the official Wan schedule")
    return sched


def sample_unipc(flow_fn: FlowFn, noise: torch.Tensor, steps: int = 40, shift: float = 3.0) -> torch.Tensor:
    """Official Wan2.2-S2V sampling of one clip: `steps` UniPC steps from `noise` (B, C, F, h, w). Returns the
    latent, same shape and dtype as `noise`.

    The latent is kept in the noise's dtype between steps, as the official loop does (its noise is bf16, so
    every step's result is rounded to bf16 there); the update arithmetic itself runs in the flow's dtype
    (float32 in the official code, whose DiT output is .float()).
    """
    sched = make_unipc_scheduler(steps, shift)
    x = noise
    for t in sched.timesteps:
        timestep = t.reshape(1).to(noise.device)  # (1,) int64, as speech2video.py passes it
        flow = flow_fn(x, timestep)  # (B, C, F, h, w)
        x = sched.step(flow, t, x, return_dict=False)[0]  # (B, C, F, h, w), noise's dtype
    return x


def euler_schedule(steps: int = 4, shift: float = 3.0) -> tuple[list[float], list[float]]:
    """LiveAvatar's schedule: diffusers FlowMatchEulerDiscreteScheduler(1000, shift=3).set_timesteps(4).

    Returns (timesteps, sigmas): float timesteps [1000.0, 857.6923, 602.1506, 8.9286] and sigmas
    [1.0, 0.857692, 0.602151, 0.008929, 0.0], float32 values as Python floats. The grid is linear in
    t from 1000 * sigma_max to 1000 * sigma_min of the shifted 1000-step training table (sigma_max = 1,
    sigma_min = shift(1/1000) computed in float32), then shifted. The model gets the float timestep (one
    per frame); the update is Euler: x <- x + (sigmas[i + 1] - sigmas[i]) * v.
    """
    n = NUM_TRAIN_TIMESTEPS
    train_min = _shift(torch.tensor([1.0], dtype=torch.float32) / n, shift)  # float32, as the training table
    t_grid = np.linspace(1.0 * n, train_min.item() * n, steps)  # float64; sigma_max = shift(1) = 1
    sigmas = torch.from_numpy(_shift(t_grid / n, shift)).to(torch.float32)  # (steps,)
    timesteps = sigmas * n  # float32, (steps,)
    return timesteps.tolist(), torch.cat([sigmas, torch.zeros(1)]).tolist()
