"""One batch and one loss per phase. Each batch is a pure function of a numpy/torch generator pair."""

import math

import numpy as np
import torch
import torch.nn.functional as F

from avatar_cli.families.mini.config import FamilyConfig
from avatar_cli.synth import mouth_box
from avatar_cli.train.data import VAEFrames, downsample, prompt_ids
from avatar_cli.train.plan import TrainPlan


def step_rngs(seed: int, phase: str, step: int) -> tuple[np.random.Generator, torch.Generator]:
    """All randomness of one step, from (seed, phase, step) alone: resuming needs no RNG state."""
    key = [int(seed), {"vae": 1, "sr": 2, "dit": 3, "probe": 4, "decoder": 5}[phase], int(step)]
    rng = np.random.default_rng(key)
    return rng, torch.Generator().manual_seed(int(rng.integers(2**62)))


def mouth_weights(side: int, extra: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """(side, side) loss weights: 1, plus `extra` in the window the lip-sync meter reads."""
    weight = torch.ones(side, side, device=device)
    rows, cols = mouth_box(side)
    weight[rows, cols] += extra
    return weight


# --- VAE ------------------------------------------------------------------------------------------

def vae_batch(frames: VAEFrames, plan: TrainPlan, cfg: FamilyConfig, step: int, rng: np.random.Generator,
              native_only: bool = False) -> dict[int, torch.Tensor]:
    """{side: (windows, window + 1, 3, side, side)}: consecutive frames; frame 0 of each window is the
    previous frame whose latent the decoder gets as its cache. Both sizes, or the native one only."""
    current = step // plan.vae_steps_per_clip
    out = {}
    for side in (cfg.image_size,) if native_only else (cfg.image_size, cfg.low_size):
        wins = []
        for _ in range(plan.vae_windows):
            clip = frames.clip(int(rng.integers(max(0, current - 3), current + 1)))  # (T, 3, S, S)
            s = int(rng.integers(0, clip.shape[0] - plan.vae_window))
            x = clip[s:s + plan.vae_window + 1]
            wins.append(x if side == cfg.image_size else downsample(x, side))
        out[side] = torch.stack(wins)
    return out


def window_l1(vae, z: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, gen: torch.Generator,
              fast: bool = False) -> torch.Tensor:
    """Mean weighted L1 of decoding each window: z (W, n + 1, C, h, w) latents, x (W, n + 1, 3, S, S) frames;
    latent 0 of a window is the decoder's cache. fast: bf16 autocast and channels_last (the decoder polish)."""
    rec = 0.0
    for w in range(z.shape[0]):
        # One window in four starts a timeline (no cache): the decoder's first-chunk path.
        prev = None if torch.rand((), generator=gen) < 0.25 else z[w, :1]
        zw = z[w, 1:].contiguous(memory_format=torch.channels_last) if fast else z[w, 1:]  # (n, C, h, w)
        with torch.autocast(z.device.type, dtype=torch.bfloat16, enabled=fast):
            y, _ = vae.decode(zw, prev)  # (n, 3, S, S)
        rec = rec + ((y.float() - x[w, 1:]).abs() * weight).mean() / weight.mean()
    return rec / z.shape[0]


def vae_loss(vae, batch: dict[int, torch.Tensor], plan: TrainPlan, gen: torch.Generator) -> torch.Tensor:
    total = 0.0
    for side, x in batch.items():
        W, n1 = x.shape[:2]
        mean, logvar = vae.encoder(x.flatten(0, 1))  # (W*n1, C, h, w) each
        eps = torch.randn(mean.shape, generator=gen).to(mean.device)  # drawn on the CPU: same on any device
        z = mean + torch.exp(0.5 * logvar) * eps  # (W*n1, C, h, w)
        rec = window_l1(vae, z.unflatten(0, (W, n1)), x, mouth_weights(side, plan.mouth_weight, x.device), gen)
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        total = total + rec + plan.kl_weight * kl
    return total / len(batch)


def decoder_loss(vae, x: torch.Tensor, plan: TrainPlan, gen: torch.Generator) -> torch.Tensor:
    """The decoder polish: x (windows, window + 1, 3, S, S) at the native size. The frozen encoder's mean
    latent is decoded, as the render decodes the SR's latents (no sampling noise)."""
    with torch.no_grad():
        z = vae.encode(x.flatten(0, 1).contiguous(memory_format=torch.channels_last))  # (W*n1, C, h, w)
    return window_l1(vae, z.unflatten(0, x.shape[:2]), x, mouth_weights(x.shape[-1], plan.mouth_weight, x.device),
                     gen, fast=plan.decoder_autocast)


@torch.no_grad()
def normalize_latents(vae, xs: list[torch.Tensor]) -> torch.Tensor:
    """Rescale the latent space to unit RMS per channel, exactly (the sampler's noise is N(0, 1) and the
    pipeline applies no scale factor). z' = z / s: the encoder's mean head is divided by s, its log-variance
    shifted by -2 log s, and the decoder's first conv multiplied by s (zero padding keeps this exact).
    xs: batches of frames (N, 3, S, S) to measure on (one per resolution). Returns s (C,)."""
    enc, dec = vae.encoder, vae.decoder
    C = enc.conv_out.out_channels // 2
    s = torch.stack([vae.encode(x).pow(2).mean(dim=(0, 2, 3)) for x in xs]).mean(0).sqrt().clamp(min=1e-4)  # (C,)
    enc.conv_out.weight[:C] /= s[:, None, None, None]
    enc.conv_out.bias[:C] /= s
    enc.conv_out.bias[C:] -= 2 * torch.log(s)
    dec.conv_in.weight[:, :C] *= s[None, :, None, None]  # the current frame
    dec.conv_in.weight[:, C:] *= s[None, :, None, None]  # the previous frame
    return s


# --- SR -------------------------------------------------------------------------------------------

def sr_batch(cache: dict[str, torch.Tensor], plan: TrainPlan, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    n, T = cache["lo"].shape[:2]
    c = torch.from_numpy(rng.integers(0, n, plan.sr_batch))
    f = torch.from_numpy(rng.integers(0, T, plan.sr_batch))
    return {"lo": cache["lo"][c, f].float(), "hi": cache["hi"][c, f].float(), "ref_hi": cache["ref_hi"][c].float()}


def sr_loss(sr, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(sr(b["lo"], b["ref_hi"]), b["hi"])


# --- DiT ------------------------------------------------------------------------------------------

def window_layout(plan: TrainPlan, rng: np.random.Generator) -> tuple[str, int, tuple[int, ...]]:
    """(kind, window length, given positions), in the proportions of `plan.p_window`:
    an N chunk continuing from motion frames, the first N chunk (nothing given), or an I chunk
    (anchors at both ends). Lengths vary a little around the spec defaults."""
    kind = rng.choice(["N", "N0", "I"], p=list(plan.p_window))
    if kind == "N":
        m = plan.motion_frames if rng.random() < 0.7 else int(rng.integers(1, 2 * plan.motion_frames + 1))
        return "N", m + plan.chunk_frames, tuple(range(m))
    if kind == "N0":
        return "N0", plan.chunk_frames, ()
    a = plan.transition_frames if rng.random() < 0.7 else int(rng.integers(1, 2 * plan.transition_frames + 1))
    return "I", a + 2, (0, a + 1)


def dit_batch(cache: dict[str, torch.Tensor], plan: TrainPlan, cfg: FamilyConfig, rng: np.random.Generator,
              gen: torch.Generator) -> dict:
    kind, L, given = window_layout(plan, rng)
    n, T = cache["lat"].shape[:2]
    B = max(1, plan.dit_tokens // L)
    clips = torch.from_numpy(rng.integers(0, n, B))
    starts = torch.from_numpy(rng.integers(0, T - L + 1, B))
    idx = starts[:, None] + torch.arange(L)  # (B, L)
    x1 = cache["lat"][clips[:, None], idx].float()  # (B, L, C, h, w)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[:, list(given)] = True
    # Frames 1-2 away from a given frame are where a chunk must continue the one before: weigh them more.
    frame_w = torch.ones(L)
    if given:
        dist = (torch.arange(L)[:, None] - torch.tensor(given)[None]).abs().min(dim=1).values  # (L,)
        frame_w[(dist >= 1) & (dist <= 2)] = plan.dit_seam_weight
    # Noise level per sample, on the sampler's shifted schedule (most) or uniform (some).
    sigma = torch.sigmoid(torch.randn(B, generator=gen))
    sigma = plan.shift * sigma / (1 + (plan.shift - 1) * sigma)
    uniform = torch.rand(B, generator=gen)
    sigma = torch.where(torch.rand(B, generator=gen) < 0.2, uniform, sigma)
    t = (1.0 - sigma)[:, None].expand(B, L)  # (B, L)
    t = torch.where(mask, 1.0, t)
    x0 = torch.randn(x1.shape, generator=gen)  # (B, L, C, h, w)
    cond = x1
    if given and rng.random() < 0.5:
        cond = x1 + plan.cond_noise * torch.randn(x1.shape, generator=gen)
    tt = t[:, :, None, None, None]
    xt = torch.where(mask[:, :, None, None, None], cond, tt * x1 + (1 - tt) * x0)  # (B, L, C, h, w)
    form = ["both", "both", "expr", "energy", "talk"][int(rng.integers(5))]
    text_ids = None if rng.random() < plan.p_prompt_drop else prompt_ids(cache["labels"][clips], form, rng, cfg.text)
    return {
        "kind": kind, "xt": xt, "t": t, "mask": mask, "v": x1 - x0, "frame_w": frame_w.expand(B, L),
        "mel": cache["mel"][clips[:, None], idx].float(),  # (B, L, n_mels, mel_frames)
        "audio_keep": torch.rand(B, generator=gen) >= plan.p_audio_drop,  # (B,)
        "ref_lo": cache["ref_lo"][clips].float(), "ref_hi": cache["ref_hi"][clips].float(),
        "text_ids": text_ids,
    }


def dit_loss(dit, audio_enc, text_enc, b: dict, cfg: FamilyConfig, autocast: bool, mouth_weight: float = 0.0
             ) -> torch.Tensor:
    B, L = b["t"].shape
    with torch.autocast(b["xt"].device.type, dtype=torch.bfloat16, enabled=autocast):
        audio = audio_enc(b["mel"].flatten(0, 1)).unflatten(0, (B, L))  # (B, L, audio_dim)
        audio = audio * b["audio_keep"][:, None, None]  # dropped: zeros, as the unconditional CFG branch
        if b["text_ids"] is None:
            text = torch.zeros(B, 0, cfg.text.dim, device=b["xt"].device)
        else:
            text = text_enc(b["text_ids"])  # (B, Nt, text_dim)
        v = dit(b["xt"], b["t"], b["mask"], audio, b["ref_lo"], b["ref_hi"], text)  # (B, L, C, h, w)
    # (h, w): lip sync lives in a few latent cells
    weight = mouth_weights(b["xt"].shape[-1], mouth_weight, b["xt"].device)
    err = ((v.float() - b["v"]).pow(2) * weight).mean(dim=(2, 3, 4)) / weight.mean()  # (B, L)
    free = (~b["mask"]).float() * b["frame_w"]  # (B, L)
    return (err * free).sum() / free.sum()


def lr_at(progress: float, step: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 10% of the base rate; progress in [0, 1]."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))
