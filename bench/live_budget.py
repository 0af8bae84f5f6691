"""The wan-s2v streaming mode (LiveAvatar) at full size, on paper: fps, per-rank memory and time to first frame of
one GPU, the timestep pipeline (runtime.parallel: steps) and sequence parallel (bench/results.md records them).

    python bench/live_budget.py [--util 0.4] [--sp-util 0.35]

Shapes: Wan2.2-S2V-14B (40 layers, dim 5120, FFN 13824, 40 heads, text_len 512, 12 audio injectors) at 704x384
(latent 48x88, P = 1056 tokens a latent frame); a block is 3 latent frames (L = 3168 tokens, 12 video frames) and
attends to a full ring (12 latent frames) plus the sink (2640 tokens) after the first clip (causal.py's docstring).
FLOPs are counted by formula (matmuls and attention; norms, RoPE and elementwise ops left out, < 1 %). Peaks:
989 TFLOP/s dense bf16 and 1979 FP8 (H100/H800 SXM); utilisation is an assumption, given on the command line.
The VAE decode per block is scaled from bench/wan_budget.py's 480p figure (252.9 TFLOP for 20 latents at 832x448, TF32
at 40 % of 494.7 TFLOP/s: 1.28 s) by latents and pixels; bf16 halves it. Nothing here ran on a GPU.
"""

import argparse

D, FFN, HEADS, LAYERS, TEXT, INJECTORS, AUDIO_TOKENS = 5120, 13824, 40, 40, 512, 12, 32
P = 48 * 88 // 4  # tokens a latent frame at 704x384 (patch 1x2x2): 1056
L = 3 * P  # a block's tokens
RING = 12 * P  # a step's ring
SINK = 2640  # [ref | post | 2x | 4x] tokens
PEAK = {"bf16": 989e12, "fp8": 1979e12}
NVLINK = 450e9  # bytes/s one way per GPU (NVLink 4), for the all-to-alls
A2A_LATENCY = 25e-6
BYTES = {"bf16": 2, "fp8": 1}
VAE_480P_FLOPS, VAE_480P_S = 252.9e12, 1.28
DIT_GB = 32.6  # bf16 weights (bench/wan_budget.py); FP8 halves the linears' share
RING_GB = LAYERS * RING * D * 2 * 2 / 1e9  # k and v, bf16: 10.38
SINK_GB = LAYERS * SINK * D * 2 * 2 / 1e9  # 2.16
DECODER_CACHE_GB = 2.56
AUDIO_VAE_GB = 1.27 + 0.51  # wav2vec2-large and the VAE in fp32


def forward_flops(tokens: int, keys: int) -> float:
    """One DiT forward over `tokens` queries attending to `keys` self-attention keys."""
    per_layer = (8 * tokens * D * D + 4 * tokens * keys * D  # self-attention: q, k, v, o; scores and values
                 + 4 * tokens * D * D + 4 * TEXT * D * D + 4 * tokens * TEXT * D  # text cross-attention
                 + 4 * tokens * D * FFN)  # FFN
    injector = 4 * tokens * D * D + 4 * tokens * AUDIO_TOKENS * D  # audio cross-attention (q, o and scores)
    return LAYERS * per_layer + INJECTORS * injector


def decode_s(latents: int, dtype: str) -> float:
    scale = latents / 20 * (704 * 384) / (832 * 448)
    return VAE_480P_S * scale / (2 if dtype == "bf16" else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--util", type=float, default=0.4, help="matmul utilisation of a whole block forward")
    ap.add_argument("--sp-util", type=float, default=0.35, help="utilisation with 1/8 of the tokens per rank")
    ap.add_argument("--ranks", type=int, default=8)
    a = ap.parse_args()
    W, steps = a.ranks, 4
    block, prefill = forward_flops(L, RING + SINK), forward_flops(SINK, SINK)
    print(f"block forward {block / 1e12:.1f} TFLOP (L={L}, keys {RING + SINK}); sink prefill {prefill / 1e12:.1f} "
          f"TFLOP; a block = {steps} forwards = 12 frames")
    rows = []
    for dt in ("bf16", "fp8"):
        t_fwd = block / (a.util * PEAK[dt])
        t_pre = prefill / (a.util * PEAK[dt])
        dec, prime = decode_s(3, "bf16"), decode_s(8, "bf16")  # the VAE in bf16 (fp32: x2)
        # Ulysses: per layer q, k, v to head shards and the output back, (W-1)/W of each rank's share moves.
        a2a = LAYERS * (4 * L / W * D * BYTES["bf16"] * (W - 1) / W / NVLINK + 2 * A2A_LATENCY)
        t_sp = block / (W * a.sp_util * PEAK[dt]) + a2a
        one = 12 / (steps * t_fwd + dec)
        tpp = 12 / max(t_fwd, dec)  # one block leaves the line per step-forward; the decode rank must keep up
        sp_inline, sp_worker = 12 / (steps * t_sp + dec), 12 / max(steps * t_sp, dec)
        ttff_one = t_pre + steps * t_fwd + prime
        ttff_tpp = t_pre + steps * t_fwd + prime  # block 0 still passes the 4 step ranks one after another
        ttff_sp = t_pre / W + steps * t_sp + prime
        rows.append((dt, t_fwd, one, tpp, sp_inline, sp_worker, ttff_one, ttff_tpp, ttff_sp, t_sp, dec))
    print(f"\n| DiT dtype | block forward, 1 GPU | 1 GPU fps | steps ({steps + 1} GPUs) fps | sequence ({W} GPUs) fps, "
          f"decode inline / worker | TTFF 1 GPU / steps / sequence |\n|---|---|---|---|---|---|")
    for dt, t_fwd, one, tpp, spi, spw, t1, tt, ts, t_sp, _ in rows:
        print(f"| {dt} | {t_fwd * 1e3:.0f} ms ({W} GPUs: {t_sp * 1e3:.0f} ms) | {one:.1f} | {tpp:.1f} | "
              f"{spi:.1f} / {spw:.1f} | {t1:.2f} / {tt:.2f} / {ts:.2f} s |")
    # A live session: a block starts once its 12 frames' audio (0.75 s at 16 fps) has arrived, so a block's latency
    # (its last audio sample in -> its frames out) is its own processing time, as long as the layout keeps up with
    # 16 fps; below that, latency grows by (16 / fps - 1) s every second of speech.
    def live(fps: float, seconds: float) -> str:
        return f"{seconds:.2f} s" if fps >= 16 else f"{seconds:.2f} s, growing {16 / fps - 1:.2f} s/s"
    print("\n| DiT dtype | live latency per block: 1 GPU | steps (5 GPUs) | sequence (8 GPUs; a session decodes inline) |"
          "\n|---|---|---|---|")
    for dt, t_fwd, one, tpp, spi, spw, t1, tt, ts, t_sp, dec in rows:
        print(f"| {dt} | {live(one, steps * t_fwd + dec)} | {live(tpp, steps * t_fwd + dec)} | "
              f"{live(spi, steps * t_sp + dec)} |")
    step_rank = DIT_GB + RING_GB + SINK_GB + AUDIO_VAE_GB + 1.0
    decode_rank = 0.51 + DECODER_CACHE_GB + 1.1 + steps * RING_GB + SINK_GB
    sp_rank = DIT_GB + steps * RING_GB / W + SINK_GB / W + AUDIO_VAE_GB + DECODER_CACHE_GB + 1.1 + 0.5
    print(f"\nper-rank memory (bf16 DiT, umT5 not loaded: text cache hit):\n"
          f"- steps: a step rank {step_rank:.1f} GB (DiT {DIT_GB}, its ring {RING_GB:.2f}, sink {SINK_GB:.2f}, "
          f"wav2vec2 + VAE {AUDIO_VAE_GB:.2f}, ~1 activations); the decode rank {decode_rank:.1f} GB, of which "
          f"{steps * RING_GB + SINK_GB:.1f} GB are the gathered rings and sink its resume points need\n"
          f"- sequence ({W} ranks): {sp_rank:.1f} GB a rank (DiT replicated, 1/{W} of the heads of the 4 rings "
          f"{steps * RING_GB / W:.2f} GB and of the sink, decoder on every rank)")


if __name__ == "__main__":
    main()
