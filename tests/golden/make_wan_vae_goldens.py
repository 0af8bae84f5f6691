"""Make the Wan VAE goldens: the official `WanVAE_` (wan/modules/vae2_1.py) at a tiny size (dim 8, see main),
float32 on CPU, fixed seed.

    mkdir -p /tmp/wan22_vae && git -C $REPO archive HEAD wan | tar -x -C /tmp/wan22_vae
    OMP_NUM_THREADS=1 nice -n 19 $OFFICIAL_VENV/bin/python tests/golden/make_wan_vae_goldens.py --wan-repo /tmp/wan22_vae --official-git $REPO

$REPO is a git clone of Wan-Video/Wan2.2; $OFFICIAL_VENV its own environment (tests/golden/official_env.py create):
the script refuses to run under versions outside that repository's requirements.txt and records the commit and
the versions it ran with in every safetensors file it writes (header metadata `official`).

Writes to tests/golden/wan_s2v/:
- vae_tiny_weights.safetensors: the tiny random weights, in the official key layout;
- vae_io.safetensors: `video` (2, 3, 9, 32, 40) in [-1, 1] and its official encode `mu` (normalised as the
  official wrapper does: (mu - mean) * (1 / std), with the release's 16-channel mean/std); random normalised
  latents `z` (2, 16, 4, 4, 5) and their official decode `frames` (2, 3, 13, 32, 40), raw (the wrapper's clamp
  to [-1, 1] is left to the test).
The width differs from the height so a swapped H/W anywhere would show.

Not run by the tests (they never import the official code); committed to document how the goldens were made.
"""

import argparse
import importlib
import sys
import time
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

from official_env import as_metadata, provenance  # tests/golden/, on sys.path as the script's folder

META: dict[str, str] = {}  # the official commit and versions, set in main()


def save_file_with_provenance(tensors, path) -> None:
    save_file(tensors, str(path), metadata=META)

OUT = Path(__file__).resolve().parent / "wan_s2v"

# The release's latent statistics (official wan/modules/vae2_1.py:629-636, the Wan2_1_VAE wrapper).
MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
       3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


def import_official(wan_repo: Path):
    """Import wan.modules.vae2_1 without running wan/__init__.py (which imports every pipeline and their
    CUDA/decord/librosa dependencies): stub packages whose __path__ points at the tree."""
    for name, sub in (("wan", "wan"), ("wan.modules", "wan/modules")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(wan_repo / sub)]
        sys.modules[name] = pkg
    return importlib.import_module("wan.modules.vae2_1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wan-repo", type=Path, required=True, help="folder holding the official wan/ package")
    ap.add_argument("--official-git", type=Path, required=True,
                    help="a git clone of Wan-Video/Wan2.2: its commit and requirements.txt pins are checked and recorded")
    args = ap.parse_args()
    global META
    META = as_metadata(provenance(args.official_git, "Wan-Video/Wan2.2"))  # refuses outside the official pins
    vae2_1 = import_official(args.wan_repo)

    torch.manual_seed(0)
    model = vae2_1.WanVAE_(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                           temperal_downsample=[False, True, True], dropout=0.0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gamma"):
                # RMS gains start at exactly 1: make them vary per channel so their layout is checked.
                p.copy_(1.0 + 0.25 * torch.randn_like(p))
            elif name.endswith("proj.weight"):
                # The attention output projections are zero-initialised: re-randomise so attention is live.
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    print(f"params: {sum(p.numel() for p in model.parameters()):,}")

    scale = [torch.tensor(MEAN), 1.0 / torch.tensor(STD)]
    # A smooth-ish video (a moving gradient plus noise), so the encoder sees structure, not just noise.
    b, t, h, w = 2, 9, 32, 40
    tt = torch.arange(t).view(1, 1, t, 1, 1)
    yy = torch.linspace(-1, 1, h).view(1, 1, 1, h, 1)
    xx = torch.linspace(-1, 1, w).view(1, 1, 1, 1, w)
    phase = torch.tensor([0.0, 1.0, 2.0]).view(1, 3, 1, 1, 1) + torch.tensor([0.0, 0.5]).view(b, 1, 1, 1, 1)
    video = torch.sin(3 * xx + 2 * yy + 0.4 * tt + phase) * 0.7 + 0.3 * torch.randn(b, 3, t, h, w)
    video = video.clamp(-1, 1).contiguous()
    z = torch.randn(2, 16, 4, 4, 5)

    with torch.no_grad():
        t0 = time.perf_counter()
        mu = model.encode(video, scale)
        t1 = time.perf_counter()
        frames = model.decode(z, scale)
        t2 = time.perf_counter()
    print(f"encode {tuple(video.shape)} -> {tuple(mu.shape)} in {t1 - t0:.2f}s; "
          f"decode {tuple(z.shape)} -> {tuple(frames.shape)} in {t2 - t1:.2f}s")
    print(f"frames: |max| {frames.abs().max():.3f}, fraction outside [-1, 1] {(frames.abs() > 1).float().mean():.3f}")
    print(f"mu: |max| {mu.abs().max():.3f}, std {mu.std():.3f}")

    OUT.mkdir(parents=True, exist_ok=True)
    save_file_with_provenance({k: v.contiguous() for k, v in model.state_dict().items()}, OUT / "vae_tiny_weights.safetensors")
    save_file_with_provenance({"video": video, "mu": mu.contiguous(), "z": z, "frames": frames.contiguous()},
              OUT / "vae_io.safetensors")
    print(f"wrote {OUT / 'vae_tiny_weights.safetensors'} and {OUT / 'vae_io.safetensors'}")


if __name__ == "__main__":
    main()
