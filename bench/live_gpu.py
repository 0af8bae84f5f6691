"""`bench/gpu_check.py --sections live`: the wan-s2v streaming mode (LiveAvatar) at full size on one GPU, the
figures bench/live_budget.py predicts on paper. Not yet run on a GPU.

Wan2.2-S2V-14B with random bf16 weights at 704x384 (latent 48x88, 3168 tokens a block): the sink prefill; four
block forwards through one step's ring to fill it (blocks 0-3), then the median of 3 forwards against the full ring
(12 latent frames + the 2640-token sink, as every block after the first clip); peak memory; the VAE decode of one
block's 3 latents continuing a timeline (fp32 and bf16) and of the 8 latents before the first frame. From those:
the 1-GPU fps (4 forwards + a decode a block), the timestep pipeline's steady fps on 5 GPUs (a block per forward,
if the decode rank keeps up), and the time to the first frame. Sequence parallel needs several GPUs: its figure
stays the budget's. `--smoke` runs it on the CPU at the tiny size (the test suite does).
"""

import torch

from avatar_cli.families.wan_s2v import causal
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAEParams


def live(g) -> None:
    """g: the gpu_check module (its DEV, SMOKE, measure, mark, ms_between, median, reset_peak, peak_mb, size)."""
    flushed = g.SMOKE and torch.set_flush_denormal(True)  # on the CPU small random weights decay into denormals
    try:
        live_measure(g)
    finally:
        if flushed:
            torch.set_flush_denormal(False)


@torch.no_grad()
def live_measure(g) -> None:
    import wan_budget as wb

    dev = g.DEV
    p, vp = (WanDiTParams.tiny(), WanVAEParams.tiny()) if g.SMOKE else (WanDiTParams.full(), WanVAEParams.full())
    lat_h, lat_w = (8, 16) if g.SMOKE else (48, 88)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = wb.random_init(wb.on_meta(WanS2VDiT, p, dtype), dev, seed=0)
    gen = torch.Generator(device=dev).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    caches = causal.CausalCaches.empty(p, lat_h, lat_w, steps=1, dtype=dtype, device=dev)
    ref, motion = randn(16, 1, lat_h, lat_w), randn(16, p.lat_motion_frames, lat_h, lat_w)
    context = randn(p.text_len, p.text_dim)
    e0 = g.mark()
    causal.prefill_sink(model, caches, ref, motion, context)
    prefill_ms = g.ms_between(e0, g.mark())
    inputs = causal.block_inputs(model, context, randn(1, 25, p.audio_dim, 12))
    t = torch.full((3,), 1000.0, device=dev)
    for block in range(causal.RING_FRAMES // causal.FRAMES_PER_BLOCK):  # fill the ring (and warm up)
        causal.causal_forward(model, caches, 0, randn(16, 3, lat_h, lat_w), t, block, inputs, 10)
    times = []
    g.reset_peak()
    for block in range(4, 4 + g.size(3, 2)):
        x = randn(16, 3, lat_h, lat_w)
        e0 = g.mark()
        causal.causal_forward(model, caches, 0, x, t, block, inputs, 10)  # (16, 3, h, w)
        times.append(g.ms_between(e0, g.mark()))
    fwd_ms = g.median(times)
    g.measure("live block forward", latent=f"{lat_h}x{lat_w}", tokens=3 * caches.ring_tokens // 12,
              keys=caches.ring_tokens + caches.sink_k.shape[1], ms_median=round(fwd_ms, 2),
              ms_all=[round(x, 2) for x in times], prefill_ms=round(prefill_ms, 2),
              ring_gb=round(caches.k.nbytes * 2 / 1e9, 3), sink_gb=round(caches.sink_k.nbytes * 2 / 1e9, 3),
              peak_gb=round(g.peak_mb() * 2**20 / 1e9, 2))
    del model, caches, inputs
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    vae = wb.random_init(wb.on_meta(WanVAE, vp, torch.float32), dev, seed=2)
    decode = {}
    dtypes = (torch.float32,) if g.SMOKE else (torch.float32, torch.bfloat16)  # bf16 convolutions crawl on CPUs
    for vdtype in dtypes:
        vae = vae.to(vdtype)
        _, cache = vae.decode_stream(randn(1, 16, 8, lat_h, lat_w).to(vdtype))  # a timeline to continue, warm-up
        for n in (3, 8):
            z = randn(1, 16, n, lat_h, lat_w).to(vdtype)
            e0 = g.mark()
            vae.decode_stream(z, cache)  # (1, 3, 4n, H, W)
            decode[(vdtype, n)] = g.ms_between(e0, g.mark())
    dec3, dec8 = decode[(dtypes[-1], 3)], decode[(dtypes[-1], 8)]
    steps = 4
    g.measure("live vae decode", block_fp32_ms=round(decode[(torch.float32, 3)], 1), block_bf16_ms=round(dec3, 1) if not g.SMOKE else None,
              first_8_latents_bf16_ms=round(dec8, 1))
    g.measure("live fps", one_gpu=round(12e3 / (steps * fwd_ms + dec3), 2),
              steps_pipeline_5_gpus=round(12e3 / max(fwd_ms, dec3), 2),
              ttff_s=round((prefill_ms + steps * fwd_ms + dec8) / 1e3, 3),
              note="bf16 DiT, VAE in bf16; LiveAvatar reports 45 fps on 5 H800 and 1.21 s TTFF")
