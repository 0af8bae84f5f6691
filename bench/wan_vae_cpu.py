"""The wan VAE decode on a CPU: torch's own kernel choices against the two the decoder makes itself
(avatar_cli/families/wan_s2v/vae.py), old and new interleaved in one process, medians and paired ratios.
Writes a section to bench/results.md.

    python bench/wan_vae_cpu.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/wan_vae_cpu.py   # as an AVX2-only CPU

- RMSNorm: F.normalize(x, dim=1) (a strided vector_norm) against sum(x * x) over channels, sqrt, divide.
- CausalConv3d: F.conv3d (torch sends a batch-1 input whose channels x frames x rows < 20480 to slow_conv3d)
  against torch.mkldnn_convolution (oneDNN) on the same padded input.
- Whole decodes: the tiny VAE of the tests (20 latents of 8x8 -> 77 frames of 64x64) and the release's widths
  (dim 96) on 4 latents of 16x16 (13 frames of 128x128), random weights.
"""

import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from avatar_cli.families.wan_s2v import vae as vae_module
from avatar_cli.families.wan_s2v.vae import RMSNorm, WanVAE, WanVAEParams
from cpu_levers import ms, paired
from machine import describe

ROOT = Path(__file__).resolve().parent.parent
NEW_NORM, NEW_ONEDNN = RMSNorm.forward, vae_module._onednn_conv


def _old_norm(self, x):
    return F.normalize(x, dim=1) * self.scale * self.gamma


def old() -> None:
    RMSNorm.forward, vae_module._onednn_conv = _old_norm, lambda x, w: False


def new() -> None:
    RMSNorm.forward, vae_module._onednn_conv = NEW_NORM, NEW_ONEDNN


def op_rows() -> list[str]:
    rows = []
    # (B, C, T, H, W) inputs the decoder meets: the tiny VAE's top level, a middle level, and latent 0 of the
    # release's first decoder level at 480x832 (60x104 latents).
    for shape in [(1, 8, 4, 64, 64), (1, 16, 4, 32, 32), (1, 32, 2, 16, 16), (1, 96, 1, 60, 104)]:
        x = torch.randn(shape)
        a = ms(lambda: F.normalize(x, dim=1))
        b = ms(lambda: x / (x * x).sum(dim=1, keepdim=True).sqrt_().clamp_min_(1e-12))
        err = (F.normalize(x, dim=1) - x / (x * x).sum(dim=1, keepdim=True).sqrt_().clamp_min_(1e-12)).abs().max()
        rows.append(f"| RMSNorm {tuple(shape)} | {a:.2f} | {b:.2f} | **{a / b:.1f}x** | max diff {err:.1e} |")
        c = shape[1]
        w, xp = torch.randn(c, c, 3, 3, 3), F.pad(x, (1, 1, 1, 1, 2, 0))
        a = ms(lambda: F.conv3d(xp, w))
        b = ms(lambda: torch.mkldnn_convolution(xp, w, None, [0, 0, 0], [1, 1, 1], [1, 1, 1], 1))
        err = (F.conv3d(xp, w) - torch.mkldnn_convolution(xp, w, None, [0, 0, 0], [1, 1, 1], [1, 1, 1], 1)).abs().max()
        rows.append(f"| conv 3x3x3 {tuple(xp.shape)} | {a:.2f} | {b:.2f} | **{a / b:.1f}x** | max diff {err:.1e} |")
    return rows


def decode_rows() -> list[str]:
    rows = []
    torch.manual_seed(0)
    for name, params, z, repeats in [
            ("tiny (dim 8), 20 latents 8x8 -> 77 x 64x64", WanVAEParams.tiny(), torch.randn(1, 16, 20, 8, 8), 9),
            ("release widths (dim 96), 4 latents 16x16 -> 13 x 128x128", WanVAEParams.full(),
             torch.randn(1, 16, 4, 16, 16), 5)]:
        model = WanVAE(params).eval()
        with torch.no_grad():
            new()
            a = model.decode(z, clamp=False)
            old()
            b = model.decode(z, clamp=False)
            rel = ((a - b).abs().max() / b.abs().max()).item()
            r = paired(lambda: model.decode(z, clamp=False), {"old": old, "new": new}, repeats=repeats)
        new()
        rows.append(f"| decode, {name} | {r['old']:.0f} | {r['new']:.0f} | **{r['ratio']:.2f}x** | "
                    f"relative max diff {rel:.1e} |")
    return rows


def main() -> None:
    m = describe()
    with torch.no_grad():
        rows = op_rows() + decode_rows()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        f"\n## wan VAE on a CPU: torch's kernels against the decoder's own ({stamp})\n",
        f"- Machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, capability {m['torch_capability']}, "
        f"{m['threads']} threads.",
        f"- Command: `{' '.join(['python', *sys.argv])}` (ms are medians; decodes interleave old and new, "
        "the ratio is the median of their pairs).\n",
        "| what | torch's (ms) | ours (ms) | speed-up | agreement |",
        "|---|---|---|---|---|",
        *rows, ""])
    print(text)
    with open(ROOT / "bench" / "results.md", "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
