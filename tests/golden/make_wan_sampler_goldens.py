"""Goldens for the Wan2.2-S2V sampler (avatar_cli/families/wan_s2v/sampler.py), made with the official code.

    mkdir -p /tmp/wan22_sampler && git -C $REPO archive HEAD wan | tar -x -C /tmp/wan22_sampler
    OMP_NUM_THREADS=1 nice -n 19 $OFFICIAL_VENV/bin/python tests/golden/make_wan_sampler_goldens.py --wan-repo /tmp/wan22_sampler --official-git $REPO

$REPO is a git clone of Wan-Video/Wan2.2; $OFFICIAL_VENV its own environment (tests/golden/official_env.py create):
the script refuses to run under versions outside that repository's requirements.txt and records the commit and
the versions it ran with in every safetensors file it writes (header metadata `official`).

Writes tests/golden/wan_s2v/sampler_unipc.safetensors:
  timesteps_40 / sigmas_40: FlowUniPCMultistepScheduler(shift=1).set_timesteps(40, shift=3), as speech2video.py
  timesteps_3 / sigmas_3:   the same for 3 steps
  noise, toy_w, toy_b:       the fixed input and the toy flow function's weights (see toy_flow below)
  sample_{3,40}_fp32:        the official sampling loop (speech2video.py:617-642, guidance left out) over toy_flow
  sample_{3,40}_bf16:        the same from bf16 noise: the official loop keeps the latent in the noise's dtype
  calls_t_40:                the timestep the loop handed to the model at each step
and sampler_euler.safetensors: diffusers' FlowMatchEulerDiscreteScheduler(1000, shift=3).set_timesteps(4), the
schedule LiveAvatar's causal pipelines use (la/causal_s2v_pipeline*.py).
Tests never run this script.
"""

import argparse
import importlib.util
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

from official_env import as_metadata, provenance  # tests/golden/, on sys.path as the script's folder

META: dict[str, str] = {}  # the official commit and versions, set in main()


def save_file_with_provenance(tensors, path) -> None:
    save_file(tensors, str(path), metadata=META)

OUT = Path(__file__).resolve().parent / "wan_s2v"


def load_official_unipc(wan_repo: Path):
    """Import wan/utils/fm_solvers_unipc.py alone: stub packages keep wan/__init__ (every pipeline) from running."""
    for name in ("wan", "wan.utils"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(wan_repo / name.replace(".", "/"))]
        sys.modules[name] = pkg
    spec = importlib.util.spec_from_file_location(
        "wan.utils.fm_solvers_unipc", wan_repo / "wan" / "utils" / "fm_solvers_unipc.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.FlowUniPCMultistepScheduler


def toy_flow(w: torch.Tensor, b: torch.Tensor):
    """A fixed nonlinear, t-dependent flow: linear channel mix + tanh + a t-scaled per-channel bias. Returns fp32,
    as the official DiT does (its output is .float())."""
    def flow(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (torch.einsum("oc,bc...->bo...", w, xf) + 0.5 * torch.tanh(xf)
                + (t.float() / 1000.0).view(-1, 1, 1, 1, 1) * b.view(1, -1, 1, 1, 1))
    return flow


def official_sample(cls, flow, noise: torch.Tensor, steps: int, shift: float):
    """speech2video.py's loop for one clip, batch 1, guidance done by the caller (here: none)."""
    sched = cls(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False)
    sched.set_timesteps(steps, device="cpu", shift=shift)
    latents = [noise[0].clone()]
    calls = []
    for t in sched.timesteps:
        timestep = torch.stack([t])
        calls.append(timestep.clone())
        pred = flow(latents[0:1][0].unsqueeze(0), timestep)
        latents[0] = sched.step(pred[0].unsqueeze(0), t, latents[0].unsqueeze(0), return_dict=False)[0].squeeze(0)
    return latents[0].unsqueeze(0), torch.cat(calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wan-repo", type=Path, required=True)
    ap.add_argument("--official-git", type=Path, required=True,
                    help="a git clone of Wan-Video/Wan2.2: its commit and requirements.txt pins are checked and recorded")
    args = ap.parse_args()
    global META
    META = as_metadata(provenance(args.official_git, "Wan-Video/Wan2.2"))  # refuses outside the official pins
    cls = load_official_unipc(args.wan_repo)
    torch.manual_seed(0)
    noise = torch.randn(1, 16, 2, 4, 4)
    w = torch.randn(16, 16) * 0.25 - 0.5 * torch.eye(16)
    b = torch.randn(16)
    flow = toy_flow(w, b)
    out = {"noise": noise, "toy_w": w, "toy_b": b}
    for steps in (3, 40):
        sched = cls(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False)
        sched.set_timesteps(steps, device="cpu", shift=3.0)
        out[f"timesteps_{steps}"] = sched.timesteps.clone()
        out[f"sigmas_{steps}"] = sched.sigmas.clone()
        with torch.no_grad():
            out[f"sample_{steps}_fp32"], calls = official_sample(cls, flow, noise, steps, 3.0)
            out[f"sample_{steps}_bf16"], _ = official_sample(cls, flow, noise.bfloat16(), steps, 3.0)
        out[f"calls_t_{steps}"] = calls
    OUT.mkdir(parents=True, exist_ok=True)
    save_file_with_provenance({k: v.contiguous() for k, v in out.items()}, OUT / "sampler_unipc.safetensors")

    from diffusers import FlowMatchEulerDiscreteScheduler
    euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3)
    euler.set_timesteps(4)
    save_file_with_provenance({"timesteps": euler.timesteps.clone(), "sigmas": euler.sigmas.clone()},
              OUT / "sampler_euler.safetensors")
    print("timesteps_40", out["timesteps_40"].tolist())
    print("euler", euler.timesteps.tolist(), euler.sigmas.tolist())
    for k, v in out.items():
        print(k, v.dtype, tuple(v.shape))


if __name__ == "__main__":
    main()
