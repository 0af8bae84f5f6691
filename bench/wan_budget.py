"""Wan2.2-S2V-14B on paper, from the real module shapes: bytes per component, activations and FLOPs
of one 480p clip's DiT forward, what fits where on 8 x 80 GB and 8 x 24 GB, and the expected time per clip.

    python bench/wan_budget.py      # seconds on a CPU; prints the tables bench/results.md records

Every figure is computed here, on the meta device (no weights, no GPU):
- parameter bytes: each model built on meta and its parameters counted (DiT and umT5 in bf16, VAE and wav2vec2 in
  fp32, the dtypes the official code runs them in);
- FLOPs: torch's FlopCounterMode (avatar_cli/runtime/flops.py: 2 per multiply-add, matmuls, convolutions and the
  attention's two matmuls) over a meta forward with one 480p clip's shapes, checked against a closed formula (formula_flops);
- activation peak: `LiveBytes`, the most bytes held at once by the tensors a meta forward allocates (weights and
  inputs excluded), with every attention taken as a fused kernel (output and logsumexp, no N x N scores), as flash
  attention runs on a GPU. The CUDA caching allocator rounds blocks up, so `bench/gpu_check.py --sections wan`
  measures the real peak on a GPU.
Assumptions are stated where used (ASSUMED_*), never measured here.

GB = 10^9 bytes throughout (an "80 GB" card holds 80 GiB = 85.9 GB, a "24 GB" card 25.8 GB, less ~1 GB of CUDA
context). Shared with bench/gpu_check.py: `Clip`, `dit_inputs`, `random_init`, `dit_flops`, `formula_flops`.
"""

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT, s2v_positions  # noqa: E402
from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAEParams  # noqa: E402
from avatar_cli.runtime.flops import flop_counter  # noqa: E402
# The meta-device counters live in the package (`avatar plan` counts with them too); re-exported for gpu_check.
from avatar_cli.runtime.meta_count import FusedAttention, LiveBytes, n_bytes, on_meta, peak_bytes  # noqa: E402,F401

GB = 1e9
ASSUMED_PEAK_TFLOPS = 989.0  # H100/H800 SXM bf16 dense, the vendor's figure
ASSUMED_TF32_TFLOPS = 494.7  # the same cards' TF32 dense: fp32 convolutions run as TF32 by cuDNN's default
ASSUMED_UTILISATION = 0.40  # sustained share of that peak (bench/gpu_check.py --sections wan measures ours)
STEPS, CFG = 40, 2  # official sample_steps, and two forwards per step for classifier-free guidance
RANKS = 8


@dataclass(frozen=True)
class Clip:
    """One clip's latent geometry: `frames` latent frames of lat_h x lat_w, `text_tokens` trimmed T5 tokens (the
    DiT zero-pads them to text_len, so the count changes nothing), motion latents present (clip r >= 1) or not."""

    frames: int
    lat_h: int
    lat_w: int
    text_tokens: int
    motion: bool = True

    @property
    def pixels(self) -> tuple[int, int]:
        return self.lat_h * 8, self.lat_w * 8


CLIP_480P = Clip(frames=20, lat_h=56, lat_w=104, text_tokens=128)  # 448x832, 80 frames
CLIP_TINY = Clip(frames=1, lat_h=8, lat_w=8, text_tokens=8)  # FramePack needs latent sides divisible by 8
MOTION_LATENTS = 19  # 73 motion frames -> 19 latents (the official (73 + 3) // 4)


def dit_inputs(p: WanDiTParams, clip: Clip, device: torch.device | str,
               generator: torch.Generator | None = None) -> dict:
    """`WanS2VDiT.forward`'s keyword arguments for one clip, in the dtypes the pipeline hands over (latents and
    wav2vec2 features fp32, T5 output bf16): random normal, or empty on meta."""
    c, f, h, w = p.in_dim, clip.frames, clip.lat_h, clip.lat_w

    def make(*shape: int, dtype=torch.float32) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)

    return {"x": make(c, f, h, w), "t": 900.0, "context": make(clip.text_tokens, p.text_dim, dtype=torch.bfloat16),
            "ref": make(c, 1, h, w), "motion": make(c, MOTION_LATENTS, h, w) if clip.motion else None,
            "cond": torch.zeros((p.cond_dim, f, h, w), device=device),  # no pose video: zeros, as official
            "audio": make(1, 25, p.audio_dim, 4 * f)}


def seq_len(p: WanDiTParams, clip: Clip) -> tuple[int, int]:
    """(tokens into the blocks, noisy tokens) of one clip."""
    pt, ph, pw = p.patch_size
    noisy = clip.frames // pt * (clip.lat_h // ph) * (clip.lat_w // pw)
    return s2v_positions(p, clip.frames, clip.lat_h, clip.lat_w, clip.motion).shape[0], noisy


@torch.no_grad()
def random_init(model: nn.Module, device: torch.device, seed: int, std: float = 0.02) -> nn.Module:
    """A model built on meta, given storage on `device` and every parameter drawn N(0, std^2) from one seeded
    generator: cheap at 16 B parameters, and the values only have to keep activations finite."""
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for prm in model.parameters():
        prm.normal_(0.0, std, generator=g)
    return model


def n_params(model: nn.Module) -> int:
    return sum(prm.numel() for prm in model.parameters())  # parameters() lists a tied weight once


def dit_flops(model: WanS2VDiT, inputs: dict) -> dict[str, float]:
    """FLOPs of one forward, counted by FlopCounterMode over whatever device the model and inputs are on (meta:
    no compute). Attention is the bmm of the attention's two matmuls (the math path meta takes; flash does the
    same arithmetic), everything else the Linears and convolutions; `injectors` is the audio injectors' share."""
    counter = flop_counter()
    with torch.no_grad(), counter:
        model(**inputs)
    by_module = counter.get_flop_counts()
    total = sum(by_module["Global"].values())
    attention = sum(n for op, n in by_module["Global"].items() if "bmm" in str(op))
    injectors = sum(by_module.get(f"{type(model).__name__}.audio_injector", {}).values())
    return {"total": total, "attention": attention, "linear_conv": total - attention, "injectors": injectors}


def formula_flops(p: WanDiTParams, n: int, noisy: int, frames: int) -> float:
    """The closed form of one forward's matmul FLOPs (2 per multiply-add): per block self-attention
    q, k, v, o on n tokens plus scores and values (4 n^2 D), text cross-attention q, o on n tokens and k, v on
    text_len plus its scores (4 n L D), the FFN; per injector q, o on the noisy tokens and k, v on 5 audio tokens
    per frame plus its scores; the text and time embedders and the head. The audio convs and patch convs are
    left out (under 0.1 %)."""
    d, f, L = p.dim, p.ffn_dim, p.text_len
    audio_tok = p.num_audio_token + 1
    block = (2 * n * d * d * 4 + 4 * n * n * d  # self-attention
             + 2 * n * d * d * 2 + 2 * L * d * d * 2 + 4 * n * L * d  # text cross-attention
             + 2 * n * d * f * 2)  # FFN
    injector = (2 * noisy * d * d * 2 + 2 * frames * audio_tok * d * d * 2 + 4 * noisy * audio_tok * d
                + 2 * frames * d * 2 * d)  # + the AdaIN's Linear on the frame's global token
    embed = 2 * L * (p.text_dim * d + d * d) + 2 * 2 * (p.freq_dim * d + d * d + d * 6 * d) + 2 * noisy * d * 64
    return p.num_layers * block + len(p.audio_inject_layers) * injector + embed


def vae_decode_meta(vp: WanVAEParams, clip: Clip, dtype: torch.dtype) -> dict[str, float]:
    """One clip's VAE decode continuing a timeline (20 latents -> 80 frames, the cache carried), on meta: FLOPs,
    the decoder cache's bytes and the decode's peak beyond weights, input latents and incoming cache."""
    vae = on_meta(WanVAE, vp, dtype)
    z = torch.empty(1, vp.z_dim, clip.frames, clip.lat_h, clip.lat_w, device="meta")
    with torch.no_grad():
        _, cache = vae.decode_stream(z)  # a first clip, to have a cache to continue
    counter = flop_counter()
    with torch.no_grad(), counter:
        vae.decode_stream(z, cache)
    peak = peak_bytes(lambda: vae.decode_stream(z, cache))
    return {"flops": counter.get_total_flops(), "cache_bytes": cache.nbytes(), "peak_bytes": peak}


def vae_encode_meta(vp: WanVAEParams, clip: Clip, frames: int) -> dict[str, float]:
    """FLOPs and peak bytes (beyond weights and input) of encoding `frames` pixel frames in fp32: every clip's 73
    motion frames are re-encoded into its 19 motion latents (official, and the wan-s2v family does the same)."""
    vae = on_meta(WanVAE, vp, torch.float32)
    h, w = clip.pixels
    x = torch.empty(1, 3, frames, h, w, device="meta")
    counter = flop_counter()
    with torch.no_grad(), counter:
        vae.encode(x)
    return {"flops": counter.get_total_flops(), "peak_bytes": peak_bytes(lambda: vae.encode(x))}


def wav2vec2_large():
    """The release's wav2vec2-large-xlsr-53-english (a Wav2Vec2ForCTC, 33-token head) on meta, fp32."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    cfg = Wav2Vec2Config(vocab_size=33, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                         intermediate_size=4096, conv_dim=(512,) * 7, conv_kernel=(10, 3, 3, 3, 3, 2, 2),
                         conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_bias=True, feat_extract_norm="layer",
                         do_stable_layer_norm=True, num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16)
    with torch.device("meta"):
        return Wav2Vec2ForCTC(cfg)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def gb(n: float) -> str:
    return f"{n / GB:.2f}"


def weights() -> dict:
    """Every model on meta in its run dtype, and its bytes split the way FSDP2 sees the DiT."""
    from avatar_cli.families.wan_s2v.text import build_text_encoder

    p = WanDiTParams.full()
    dit = on_meta(WanS2VDiT, p, torch.bfloat16)
    with torch.device("meta"):
        t5 = build_text_encoder().to(torch.bfloat16)
    vae, w2v = on_meta(WanVAE, WanVAEParams.full(), torch.float32), wav2vec2_large()
    blocks = n_bytes(dit.blocks)
    print("## Weights (built on meta, parameters counted)\n")
    print(table(["component", "params", "dtype", "GB"], [
        ["DiT (WanS2VDiT)", f"{n_params(dit):,}", "bf16", gb(n_bytes(dit))],
        ["- its 40 blocks", f"{n_params(dit.blocks):,}", "bf16", f"{gb(blocks)} ({gb(n_bytes(dit.blocks[0]))} each)"],
        ["- the rest: 12 audio injectors, embedders, audio encoder, head", f"{n_params(dit) - n_params(dit.blocks):,}",
         "bf16", f"{gb(n_bytes(dit) - blocks)} (injectors {gb(n_bytes(dit.audio_injector))})"],
        ["umT5-XXL encoder", f"{n_params(t5):,}", "bf16", gb(n_bytes(t5))],
        ["VAE", f"{n_params(vae):,}", "fp32", gb(n_bytes(vae))],
        ["wav2vec2-large-xlsr-53 (CTC)", f"{n_params(w2v):,}", "fp32", gb(n_bytes(w2v))],
    ]))
    return {"p": p, "dit_model": dit, "dit": n_bytes(dit), "blocks": blocks, "block": n_bytes(dit.blocks[0]),
            "root": n_bytes(dit) - blocks, "t5": n_bytes(t5), "t5_root": n_bytes(t5) - n_bytes(t5.encoder.block),
            "vae": n_bytes(vae), "w2v": n_bytes(w2v)}


def one_clip(w: dict) -> dict:
    """Tokens, activations, FLOPs of one 480p clip's DiT forward; the VAE's work per clip."""
    p, dit = w["p"], w["dit_model"]
    n, noisy = seq_len(p, CLIP_480P)
    clip0 = dataclasses.replace(CLIP_480P, motion=False)
    n0, _ = seq_len(p, clip0)
    inputs = dit_inputs(p, CLIP_480P, "meta")
    fl, fl0 = dit_flops(dit, inputs), dit_flops(dit, dit_inputs(p, clip0, "meta"))
    formula = formula_flops(p, n, noisy, CLIP_480P.frames)
    act = peak_bytes(lambda: dit(**inputs))
    # The official sequence parallelism all-gathers the residual stream around each injector and injects on the
    # whole noisy sequence on every rank: what that costs one rank.
    h = torch.empty(1, noisy, p.dim, device="meta")  # (1, N_noisy, D) fp32
    loc = torch.empty(CLIP_480P.frames, p.num_audio_token + 1, p.dim, device="meta")  # (F, 5, D)
    inj = peak_bytes(lambda: dit.audio_injector(0, h, loc, loc[:, 0]))
    d, ffn = p.dim, p.ffn_dim
    print(f"\n## One 480p clip ({CLIP_480P.pixels[0]}x{CLIP_480P.pixels[1]}, latent {p.in_dim}x{CLIP_480P.frames}x"
          f"{CLIP_480P.lat_h}x{CLIP_480P.lat_w}): {n:,} tokens ({noisy:,} noisy), clip 0 without motion {n0:,}\n")
    print(table(["activation (one forward, one GPU, no sequence parallelism)", "size", "GB"], [
        ["residual stream, fp32 after block 0", "N·D·4", gb(n * d * 4)],
        ["self-attention q, k, v (bf16)", "3·N·D·2", gb(3 * n * d * 2)],
        ["RoPE transient per q or k: float64 copy + complex128 product", "2·N·D·8", gb(2 * n * d * 8)],
        ["FFN hidden + its GELU (bf16)", "2·N·13824·2", gb(2 * n * ffn * 2)],
        ["injector: AdaIN output fp32 + q bf16 (noisy tokens only)", "N_noisy·D·(4+2)", gb(noisy * d * 6)],
        ["RoPE table (N, 64) complex128", "N·64·16", gb(n * d // p.num_heads // 2 * 16)],
        ["**peak of the whole forward (meta, fused attention)**", "LiveBytes", f"**{gb(act)}**"],
    ]))
    print(f"\nFLOPs per forward (FlopCounterMode on meta): {fl['total'] / 1e15:.3f} PFLOP (attention "
          f"{100 * fl['attention'] / fl['total']:.0f} %, Linears and convs {100 * fl['linear_conv'] / fl['total']:.0f} "
          f"%, of which the injectors {fl['injectors'] / 1e15:.3f} PFLOP); closed formula "
          f"{formula / 1e15:.3f} PFLOP ({100 * (formula / fl['total'] - 1):+.2f} %); clip 0 {fl0['total'] / 1e15:.3f} "
          "PFLOP")
    vp = WanVAEParams.full()
    dec, enc = vae_decode_meta(vp, CLIP_480P, torch.float32), vae_encode_meta(vp, CLIP_480P, 73)
    dec16 = vae_decode_meta(vp, CLIP_480P, torch.bfloat16)
    print(f"VAE decode of one clip (20 latents -> 80 frames, cache carried), fp32: {dec['flops'] / 1e12:.1f} TFLOP, "
          f"peak {gb(dec['peak_bytes'])} GB beyond weights, latents and incoming cache (the new cache included); "
          f"decoder cache {gb(dec['cache_bytes'])} GB. In bf16: peak {gb(dec16['peak_bytes'])} GB, cache "
          f"{gb(dec16['cache_bytes'])} GB. Encode of the 73 motion frames, fp32: {enc['flops'] / 1e12:.1f} TFLOP, "
          f"peak {gb(enc['peak_bytes'])} GB")
    return {"n": n, "n0": n0, "noisy": noisy, "flops": fl["total"], "act": act, "inj": inj, "dec": dec,
            "enc": enc["flops"], "enc_peak": enc["peak_bytes"]}


def placement(w: dict, c: dict) -> None:
    """Per-rank bytes on 8 GPUs: what stays resident, plus the larger of the DiT stage's and the VAE stage's
    transients (the stages run one after the other)."""
    p = w["p"]
    sp_act = c["act"] / RANKS  # every per-token tensor splits 8 ways; q/k/v after the all-to-all: 5 heads of 40
    official = c["n"] * p.dim * 4 + c["inj"]  # + the gathered fp32 residual and a whole-sequence injection
    vae_res = w["vae"] + c["dec"]["cache_bytes"]
    dec = max(c["dec"]["peak_bytes"], c["enc_peak"])  # the decode, then the motion frames' re-encode
    two_blocks = 2 * w["block"]  # per_block: the running block and the prefetched one
    cols = {  # DiT bytes resident per rank, DiT-stage transient besides activations
        "replicate": (w["dit"], 0),
        "FSDP2 per_block": (w["dit"] / RANKS + w["root"], two_blocks),  # the root unit stays gathered
        "FSDP2 per_block, offload: block": (w["root"], two_blocks),  # shards in pinned host memory
    }
    # The wan-s2v family shards umT5 like the DiT (its root, the 256k-token embedding, then stays gathered) and
    # replicates wav2vec2; with offload the shards and the idle replicated models wait in pinned host memory.
    t5 = {"replicate": w["t5"] / RANKS + w["t5_root"], "FSDP2 per_block": w["t5"] / RANKS + w["t5_root"],
          "FSDP2 per_block, offload: block": w["t5_root"]}
    w2v = {"replicate": w["w2v"], "FSDP2 per_block": w["w2v"], "FSDP2 per_block, offload: block": 0.0}
    rows = [["DiT weights resident", *(gb(r) for r, _ in cols.values())],
            ["umT5 (sharded: shard + gathered root) and wav2vec2 (fp32), as the family places them",
             *(f"{gb(t5[k])} + {gb(w2v[k])}" for k in cols)],
            ["VAE fp32 + decoder cache (carried from clip to clip)", *[gb(vae_res)] * 3],
            ["DiT stage: gathered blocks", *(gb(t) for _, t in cols.values())],
            ["DiT stage: activations, Ulysses over 8 (ours: local injection / official: all-gather)",
             *[f"{gb(sp_act)} / {gb(sp_act + official)}"] * 3],
            ["VAE stage: decode (or motion re-encode) peak, fp32", *[gb(dec)] * 3]]
    totals, highs = [], []
    for k, (r, t) in cols.items():
        r += t5[k] + w2v[k] + vae_res
        lo, hi = r + max(t + sp_act, dec), r + max(t + sp_act + official, dec)
        totals.append(f"**{gb(lo)}**" if abs(hi - lo) < 0.005 * GB else f"**{gb(lo)}-{gb(hi)}**")
        highs.append(hi)
    rows.append(["**peak per GPU**", *totals])
    usable = {"80 GB": 80 * 2**30 - GB, "24 GB": 24 * 2**30 - GB}  # GiB-sized cards less ~1 GB of CUDA context
    rows.append(["fits (80 GB / 24 GB card, 1 GB kept for the CUDA context)",
                 *(" / ".join("yes" if peak_hi <= cap else "no" for cap in usable.values()) for peak_hi in highs)])
    print(f"\n## Per GPU, {RANKS} ranks, GB\n")
    print(table(["", *cols], rows))
    moved_plain = (RANKS - 1) / RANKS * w["dit"]
    moved_ours = (RANKS - 1) / RANKS * w["blocks"]
    print(f"\nFSDP2 all-gather per rank per forward: {gb(moved_plain)} GB if the whole DiT is re-gathered "
          f"(7/8 of {gb(w['dit'])}); {gb(moved_ours)} GB with parallelize_model, whose root unit "
          f"({gb(w['root'])} GB) stays gathered; x {STEPS * CFG} forwards = {moved_ours * STEPS * CFG / 1e12:.2f} "
          f"TB per rank per clip. Replicated: none, and {gb(usable['80 GB'] - highs[0])} GB of an 80 GB card "
          "left over.")
    # Our Ulysses: one all-to-all of q, k, v stacked and one back per block, each rank sending 7/8 of its rows.
    rows_per_rank = -(-c["n"] // RANKS)
    a2a = 4 * rows_per_rank * p.dim * 2 * (RANKS - 1) / RANKS * p.num_layers
    print(f"Ulysses all-to-all per rank per forward: {gb(a2a)} GB sent (q, k, v and the output, 7/8 of "
          f"{rows_per_rank:,} rows x {p.dim} bf16, x {p.num_layers} blocks); x {STEPS * CFG} = "
          f"{a2a * STEPS * CFG / GB:.0f} GB per rank per clip, on the critical path (not overlapped)")
    ok = [r for r in range(1, RANKS + 1) if p.num_heads % r == 0]
    even = [r for r in ok if c["n"] % r == 0 and c["n0"] % r == 0]
    pad = {r: (-c["n"] % r, -c["n0"] % r) for r in ok if r not in even}
    print(f"Ulysses rank counts dividing {p.num_heads} heads: {ok}. The official split (torch.chunk, no padding) "
          f"also needs {c['n']:,} and {c['n0']:,} (clip 0) tokens to divide evenly: {even}; wan_s2v/parallel.py pads "
          f"to a multiple of the rank count (padding tokens at r >= 1 / clip 0: {pad})")
    print(f"umT5: {gb(w['t5'])} GB whole, {gb(w['t5'] / RANKS)} GB per rank sharded over {RANKS}, its root "
          f"(embedding) {gb(w['t5_root'])} GB; it runs once per job (two contexts of <= 512 x 4096 bf16, 4 MB each): "
          f"freeing it after the prompt saves {gb(t5['FSDP2 per_block'])} GB per rank")


def clip_time(w: dict, c: dict) -> None:
    forwards = STEPS * CFG
    rate = RANKS * ASSUMED_UTILISATION * ASSUMED_PEAK_TFLOPS * 1e12
    dit_s = forwards * c["flops"] / rate
    vae_rate = ASSUMED_UTILISATION * ASSUMED_TF32_TFLOPS * 1e12  # the decode runs whole on every rank
    dec_s, enc_s = c["dec"]["flops"] / vae_rate, c["enc"] / vae_rate
    video_s = 4 * CLIP_480P.frames / 16
    print(f"\n## Time per 480p clip on {RANKS} GPUs at {ASSUMED_UTILISATION:.0%} of {ASSUMED_PEAK_TFLOPS:.0f} "
          "TFLOP/s bf16 dense (assumed)\n")
    print(table(["work", "FLOP", "s"], [
        [f"DiT: {STEPS} steps x {CFG} CFG forwards, split over {RANKS} ranks", f"{forwards * c['flops'] / 1e15:.1f} P",
         f"{dit_s:.1f}"],
        [f"VAE decode, 20 latents, fp32 (TF32 convs) at {ASSUMED_UTILISATION:.0%} of {ASSUMED_TF32_TFLOPS}, whole "
         "on each rank", f"{c['dec']['flops'] / 1e12:.1f} T", f"{dec_s:.2f}"],
        ["VAE encode of the 73 motion frames, re-encoded per clip", f"{c['enc'] / 1e12:.1f} T",
         f"{enc_s:.2f}"],
        ["**total**", "", f"**{dit_s + dec_s + enc_s:.1f}**"],
    ]))
    print(f"\nA clip is {4 * CLIP_480P.frames} frames at 16 fps = {video_s:.0f} s of video: "
          f"{(dit_s + dec_s + enc_s) / video_s:.1f} s of 8-GPU time per second of video. One forward on {RANKS} GPUs "
          f"takes {c['flops'] / rate:.2f} s, so a sharded DiT's all-gather stays hidden at "
          f"{(RANKS - 1) / RANKS * w['blocks'] / (c['flops'] / rate) / GB:.0f} GB/s per rank or more.")


def main() -> None:
    w = weights()
    c = one_clip(w)
    placement(w, c)
    clip_time(w, c)


if __name__ == "__main__":
    main()
