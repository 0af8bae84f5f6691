"""The training recipe as one typed plan: steps, batch sizes and learning rates per phase, and the time split."""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TrainPlan:
    # Steps per phase. A phase also ends when its share of the time budget is spent (whichever comes first).
    vae_steps: int = 1500
    sr_steps: int = 1500
    dit_steps: int = 4400
    decoder_steps: int = 6000
    # Shares of the budget; the latent cache is built between the VAE and SR phases out of the remainder.
    vae_share: float = 0.315
    sr_share: float = 0.06
    dit_share: float = 0.478
    decoder_share: float = 0.11
    # VAE: windows of consecutive frames at the native and at the DiT's resolution (trains the temporal cache).
    vae_windows: int = 2  # per resolution
    vae_window: int = 4  # frames decoded per window (one more is encoded as the cached previous frame)
    vae_clip_s: float = 1.6
    vae_steps_per_clip: int = 3  # a new clip every few steps; each step samples from the last 4 clips
    vae_lr: float = 1e-3  # 2e-3 looked better after 180 steps but its loss was twice as high at step 600
    kl_weight: float = 1e-4
    mouth_weight: float = 3.0  # extra L1 weight in the mouth window (the lip-sync meter reads it)
    # SR: pairs of latents (resized frame -> native frame) from clips rendered at the native size.
    sr_clips: int = 48
    sr_clip_s: float = 2.0
    sr_batch: int = 16
    sr_lr: float = 1e-3
    # DiT: flow matching on windows of cached low-res latents.
    dit_clips: int = 512
    dit_clip_s: float = 3.2
    dit_tokens: int = 112  # frames per batch: batch size = dit_tokens // window length
    dit_lr: float = 1e-3  # 300-step trials: probe loss 1.95 at 1e-3 vs 2.08 at 4e-4
    chunk_frames: int = 24  # N chunk: new frames (spec chunking.frames)
    motion_frames: int = 4  # N chunk: given frames at the start (chunking.motion_frames)
    transition_frames: int = 6  # I chunk: frames between the two anchors (chunking.transition_frames)
    p_window: tuple[float, float, float] = (0.5, 0.15, 0.35)  # N with motion, first N (no motion), I
    p_prompt_drop: float = 0.25
    p_audio_drop: float = 0.1
    dit_mouth_weight: float = 3.0  # extra flow-matching weight on the mouth's latent cells
    dit_seam_weight: float = 3.0  # loss weight of the 2 frames next to a given frame (where chunks meet)
    cond_noise: float = 0.03  # noise on given frames half of the time: the model learns to trust imperfect ones
    shift: float = 3.0  # training noise levels follow the sampler's shifted schedule
    dit_autocast: bool = True  # bf16 autocast on the DiT (faster on CPU: bench/results.md); convs stay fp32
    # Decoder polish: the encoder is frozen (the cached latents, and so the DiT and SR, stay valid) and the
    # decoder trains alone at the native size on the encoder's mean latents, as the render decodes them.
    # Windows, clip length and mouth weight as in the VAE phase; fresh clips.
    decoder_lr: float = 1e-3  # 800-step trials: +1.1 dB held-out PSNR at 1e-3, +0.6 dB at 5e-4
    decoder_autocast: bool = True  # bf16 + channels_last: 0.20 s/step vs 0.31 in fp32, same PSNR at equal steps
    warmup: int = 100
    grad_clip: float = 1.0
    ckpt_every_s: float = 180.0
    probes: int = 3  # fixed batches whose loss is reported before and after each phase


PLANS = {
    "mini": TrainPlan(),
    # The real code path at toy size, for tests: a few steps per phase, seconds in all.
    "tiny": TrainPlan(vae_steps=8, sr_steps=8, dit_steps=8, decoder_steps=8, vae_windows=1, vae_window=3,
                      vae_clip_s=0.4, vae_steps_per_clip=4, vae_lr=3e-3, sr_clips=2, sr_clip_s=0.4, sr_batch=8,
                      sr_lr=3e-3, dit_clips=3, dit_clip_s=1.4, dit_tokens=28, dit_lr=3e-3, chunk_frames=8,
                      motion_frames=2, transition_frames=2, warmup=2, ckpt_every_s=1e9, probes=2),
}


def plan_for(size: str, **overrides) -> TrainPlan:
    return replace(PLANS.get(size, PLANS["mini"]), **overrides)
