"""The CPU speed levers (docs/speed.md), each measured alone in one process (median of repeats), so their effects
compare as ratios on whatever machine runs this. Writes a section to bench/results.md.

    python bench/cpu_levers.py [--compile]          # --compile adds torch.compile (cold compile ~20 s)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_levers.py   # as an AVX2-only CPU

Shapes are the `mini` demo's: decoder batches of 8 frames of 32x32 latents, SR on 24 frames, one N chunk
(28 frames) through the DiT. Weights are random: speed does not depend on their values.
"""

import argparse
import statistics
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from avatar_cli.families.mini import layers
from avatar_cli.families.mini import dit as dit_module
from avatar_cli.families.mini.dit import DiT, DiTBlock
from avatar_cli.families.mini.config import SIZES
from avatar_cli.families.mini.sr import SuperRes
from avatar_cli.families.mini.vae import VAE
from machine import describe, peaks

ROOT = Path(__file__).resolve().parent.parent


def ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def paired(run, modes: dict[str, callable], repeats: int = 15) -> dict[str, float]:
    """Median ms of `run` under each mode (a function that switches it on), the modes interleaved so that a
    noisy machine's slow spells hit them alike; 'ratio' is the median of first-mode / second-mode pairs."""
    times: dict[str, list[float]] = {k: [] for k in modes}
    for switch in modes.values():
        switch()
        run()
    for i in range(repeats):
        for name in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
            modes[name]()
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1000)
    a, b = times.values()
    return {**{k: statistics.median(v) for k, v in times.items()},
            "ratio": statistics.median(x / y for x, y in zip(a, b))}


def _old_modulate(x, shift, scale):  # before f73bbcf: two passes
    return x * (1 + scale) + shift


def _old_rope(x, cos, sin):  # before f73bbcf: the real-valued rotation
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)


def _old_block(self, ctx, vid, c_ctx, c_vid, cos, sin):  # before f73bbcf: residual + gate * branch in two passes
    m_ctx, m_vid = self.ada(F.silu(c_ctx)).chunk(6, dim=-1), self.ada(F.silu(c_vid)).chunk(6, dim=-1)
    B, L, P, D = vid.shape
    n = ctx.shape[1]
    h = torch.cat([_old_modulate(self.norm1(ctx), m_ctx[0], m_ctx[1]),
                   _old_modulate(self.norm1(vid), m_vid[0], m_vid[1]).reshape(B, L * P, D)], dim=1)
    a = self.attn(h, cos, sin)
    ctx, vid = ctx + m_ctx[2] * a[:, :n], vid + m_vid[2] * a[:, n:].reshape(B, L, P, D)
    ctx = ctx + m_ctx[5] * self.mlp(_old_modulate(self.norm2(ctx), m_ctx[3], m_ctx[4]))
    return ctx, vid + m_vid[5] * self.mlp(_old_modulate(self.norm2(vid), m_vid[3], m_vid[4]))


def _fused_resblock(self, x):  # measured, not kept: the residual add as oneDNN's binary post-op
    y = layers.conv_silu(self.conv1, F.silu(x))
    c = self.conv2
    return torch.ops.mkldnn._convolution_pointwise.binary(y, x, c.weight, c.bias, list(c.padding), list(c.stride),
                                                          list(c.dilation), c.groups, "add", None, None, [], None)


class plain_path:
    """Turn the fused / sub-pixel CPU fast paths off (the formulas as written)."""

    def __enter__(self):
        self.saved = layers._fast_path
        layers._fast_path = lambda conv, x: False

    def __exit__(self, *exc):
        layers._fast_path = self.saved


def setattr_all(fns) -> None:
    dit_module.modulate, dit_module.apply_rope, DiTBlock.forward = fns


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = SIZES["mini"]
    wide_cfg = cfg.vae.__class__(**{**cfg.vae.__dict__, "decoder_channels": None})
    wide, thin = VAE(wide_cfg).eval(), VAE(cfg.vae).eval()
    z = torch.randn(8, 8, 32, 32).contiguous(memory_format=torch.channels_last)
    prev = torch.randn(1, 8, 32, 32)
    rows = []
    with plain_path():
        base = ms(lambda: wide.decode(z, prev)) / 8
    rows.append(("decoder (32, 64, 128), plain ops", base, 1.0))
    fast = ms(lambda: wide.decode(z, prev)) / 8
    rows.append(("decoder (32, 64, 128), fused SiLU + sub-pixel upsampling conv", fast, base / fast))
    t = ms(lambda: thin.decode(z, prev)) / 8
    rows.append((f"decoder {cfg.vae.decoder_channels} (shipped), fast paths", t, base / t))
    if args.compile:
        torch._dynamo.reset()
        t0 = time.perf_counter()
        compiled = torch.compile(wide.decoder)
        compiled(z, prev)
        cold = time.perf_counter() - t0
        with plain_path():
            c = ms(lambda: compiled(z, prev)) / 8
        rows.append((f"decoder (32, 64, 128), torch.compile inductor (compile {cold:.1f} s)", c, base / c))

    sr = SuperRes(cfg.sr).eval()
    lo = torch.randn(24, 8, 16, 16).contiguous(memory_format=torch.channels_last)
    ref = torch.randn(1, 8, 32, 32)
    with plain_path():
        s0 = ms(lambda: sr(lo, ref)) / 24
    s1 = ms(lambda: sr(lo, ref)) / 24
    rows += [("SR, plain ops (per frame)", s0, 1.0), ("SR, fused SiLU (per frame)", s1, s0 / s1)]

    dit = DiT(cfg.dit).eval()
    dit.init_weights(torch.Generator().manual_seed(0))
    for prm in dit.parameters():  # adaLN-Zero leaves gates and the output at 0: give every path some weight
        if not prm.any():
            prm.normal_(std=0.02)
    p = cfg.dit
    x = torch.randn(1, 28, 8, 16, 16)
    tt = torch.full((1, 28), 0.3)
    mask = torch.zeros(1, 28, dtype=torch.bool)
    mask[:, :4] = True
    inputs = (x, tt, mask, torch.randn(1, 28, p.audio_dim), torch.randn(1, 8, 16, 16), torch.randn(1, 8, 32, 32),
              torch.randn(1, 2, p.text_dim))
    with plain_path():
        dp = ms(lambda: dit(*inputs), 5)
    d0 = ms(lambda: dit(*inputs), 5)
    rows.append(("DiT forward, one N chunk (28 frames, 1922 tokens), plain ops", dp, 1.0))
    rows.append(("DiT forward, GELU fused into the MLP matmul", d0, dp / d0))
    new = (dit_module.modulate, dit_module.apply_rope, DiTBlock.forward)
    old = (_old_modulate, _old_rope, _old_block)
    r = paired(lambda: dit(*inputs), {
        "old": lambda: setattr_all(old), "new": lambda: setattr_all(new)})
    rows.append(("DiT forward, modulate / gated residuals as addcmul + RoPE as a complex multiply (shipped; vs the "
                 "two-pass forms, paired)", r["new"], r["ratio"]))
    plain_res = layers.ResBlock2d.forward
    r = paired(lambda: thin.decode(z, prev), {
        "plain": lambda: setattr(layers.ResBlock2d, "forward", plain_res),
        "fused": lambda: setattr(layers.ResBlock2d, "forward", _fused_resblock)})
    layers.ResBlock2d.forward = plain_res
    rows.append(("decoder, residual adds fused into the convolutions (not kept; vs shipped, paired)", r["fused"] / 8,
                 r["ratio"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic  # deprecated: measured, not adopted

        q = quantize_dynamic(dit, {torch.nn.Linear}, dtype=torch.qint8)
        d1 = ms(lambda: q(*inputs), 5)
        err = ((q(*inputs) - dit(*inputs)).abs().max() / dit(*inputs).abs().max()).item()
    rows.append((f"DiT forward, int8 dynamic linears (max rel. error {err:.3f}; not adopted)", d1, d0 / d1))

    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
        d2 = ms(lambda: dit(*inputs), 3)
        c2 = ms(lambda: thin.decode(z, prev), 3) / 8
        torch.set_num_threads(threads)
        rows.append((f"DiT forward on 1 thread (vs {threads})", d2, d0 / d2))
        rows.append((f"decoder {cfg.vae.decoder_channels} on 1 thread (vs {threads})", c2, t / c2))

    m, pk = describe(), peaks()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import os

    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    lines = [
        f"## CPU speed levers, {stamp}",
        "",
        f"- machine: {m['cores']} cores, {m['cpu']}; torch {m['torch']} capability {m['torch_capability']}"
        + (f" (capped: ATEN_CPU_CAPABILITY={cap}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')})" if cap else "")
        + f"; {m['threads']} threads; peak fp32 matmul {pk['matmul_fp32']:.0f}, conv {pk['conv_fp32']:.0f} GFLOP/s; "
        f"bf16 matmul {pk['matmul_bf16']:.1f}",
        "- command: `" + ("ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 " if cap else "")
        + "python bench/cpu_levers.py" + (" --compile" if args.compile else "") + "` (float32, medians)",
        "",
        "| lever | ms | speed-up vs its row's baseline |",
        "| --- | --- | --- |",
        *[f"| {a} | {b:.2f} | {c:.2f}x |" for a, b, c in rows],
        "",
    ]
    results = ROOT / "bench" / "results.md"
    head, _, rest = results.read_text().partition("\n## ")
    results.write_text(head.rstrip() + "\n\n" + "\n".join(lines) + ("\n## " + rest if rest else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
