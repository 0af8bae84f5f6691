"""Training data: generated clips, turned into the tensors each phase trains on.

Every clip is a pure function of its index (see `clip_seeds`), so a resumed run sees the same data.
Identity and audio seeds come only from the training ranges of `avatar_cli.synth`:

- VAE clips     j = 0, 1, 2, ...  identity 0 + j,       audio 0 + j
- SR clips      k = 0 .. n_sr-1   identity 20_000 + k,  audio 20_000 + k
- DiT clips     k = 0 .. n_dit-1  identity 40_000 + k,  audio 40_000 + k

(all below 100_000: `TRAIN_IDENTITY_SEEDS` / `TRAIN_AUDIO_SEEDS`; the held-out ranges are never touched).
Expression and energy labels are drawn by `make_clip` from the two seeds.
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from avatar_cli.families.mini.audio import AudioParams, frame_window_starts, log_mel_windows
from avatar_cli.families.mini.config import FamilyConfig
from avatar_cli.families.mini.text import tokenize
from avatar_cli.families.mini.vae import VAE
from avatar_cli.files import atomic_path
from avatar_cli.modules.module import save_safetensors
from avatar_cli.synth import TRAIN_AUDIO_SEEDS, TRAIN_IDENTITY_SEEDS, make_clip, render_reference

SEED_BASE = {"vae": 0, "sr": 20_000, "dit": 40_000, "decoder": 60_000}
FPS = 25.0


def clip_seeds(kind: str, index: int) -> tuple[int, int]:
    """(identity_seed, audio_seed) of training clip `index` of a phase; always inside the training ranges."""
    s = SEED_BASE[kind] + index
    if s not in TRAIN_IDENTITY_SEEDS or s not in TRAIN_AUDIO_SEEDS:
        raise ValueError(f"{kind} clip {index}: seed {s} is outside the training ranges")
    return s, s


def to_unit(frames: torch.Tensor) -> torch.Tensor:
    """uint8 (T, S, S, 3) -> float32 (T, 3, S, S) in [-1, 1] (as `fit_square` does at render time)."""
    return frames.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def downsample(x: torch.Tensor, size: int) -> torch.Tensor:
    """(T, 3, S, S) -> (T, 3, size, size): the same resize the mini family's reference step applies to the reference."""
    return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def mel_features(audio: np.ndarray, num_frames: int, fps: float, p: AudioParams) -> torch.Tensor:
    """Per-frame log-mel windows, exactly as the mini family's context step computes them at render time:
    windows centred on (i + 0.5) / fps, zero-padded past both ends of the audio.  -> (T, n_mels, mel_frames)
    """
    starts = frame_window_starts(0, num_frames, fps, p)  # (T,)
    lo, hi = int(starts[0]), int(starts[-1]) + p.window_samples
    padded = np.zeros(hi - lo, np.float32)  # the reader's zero padding, outside [0, len(audio))
    a, b = max(lo, 0), min(hi, len(audio))
    if b > a:
        padded[a - lo:b - lo] = audio[a:b]
    samples = torch.from_numpy(padded)
    idx = (starts - lo)[:, None] + torch.arange(p.window_samples)  # (T, window)
    return log_mel_windows(samples[idx], p)  # (T, n_mels, mel_frames)


class VAEFrames:
    """Clips for the VAE phase, rendered on demand and kept in a small LRU."""

    def __init__(self, cfg: FamilyConfig, clip_s: float, keep: int = 6, kind: str = "vae"):
        self.cfg, self.clip_s, self.keep, self.kind = cfg, clip_s, keep, kind
        self._clips: dict[int, torch.Tensor] = {}

    def clip(self, j: int) -> torch.Tensor:
        """(T, 3, S, S) in [-1, 1] at the model's native size."""
        if j not in self._clips:
            ident, aud = clip_seeds(self.kind, j)
            c = make_clip(ident, aud, self.clip_s, FPS, size=self.cfg.image_size)
            self._clips[j] = to_unit(c.frames)
            while len(self._clips) > self.keep:
                self._clips.pop(next(k for k in self._clips if k != j))  # the oldest other clip
        return self._clips[j]


@torch.no_grad()
def encode_reference(vae: VAE, reference: np.ndarray, low_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (S, S, 3) -> (ref_lo (1, C, h, w), ref_hi (1, C, 2h, 2w)), as the mini family's reference step does."""
    x = to_unit(torch.from_numpy(np.ascontiguousarray(reference))[None])  # (1, 3, S, S)
    return _encode(vae, downsample(x, low_size)), _encode(vae, x)


@torch.no_grad()
def _encode(vae: VAE, x: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """Latent means of CPU frames, encoded on the VAE's device, returned on the CPU (the cache lives there)."""
    dev = next(vae.parameters()).device
    return torch.cat([vae.encode(x[i:i + batch].to(dev)).cpu() for i in range(0, x.shape[0], batch)])


@torch.no_grad()
def build_dit_clip(vae: VAE, cfg: FamilyConfig, index: int, clip_s: float) -> dict[str, torch.Tensor]:
    """One DiT training clip: low-res latents, audio windows, reference latents and prompt ids.

    Frames are rendered directly at the DiT's size (image_size / sr.scale); that is within half a grey
    level of resizing the native frames, and ~9x cheaper.
    """
    ident, aud = clip_seeds("dit", index)
    c = make_clip(ident, aud, clip_s, FPS, size=cfg.low_size)
    ref_lo, ref_hi = encode_reference(vae, render_reference(ident, cfg.image_size), cfg.low_size)
    words = c.prompt.replace(",", " ").split()
    return {
        "lat": _encode(vae, to_unit(c.frames)).half(),  # (T, C, h, w)
        "mel": mel_features(c.audio, c.frames.shape[0], FPS, cfg.audio).half(),  # (T, n_mels, mel_frames)
        "ref_lo": ref_lo[0], "ref_hi": ref_hi[0],  # (C, h, w), (C, 2h, 2w)
        "labels": torch.tensor([EXPRESSION_IDS[words[0]], ENERGY_IDS[words[1]]]),  # (2,)
    }


@torch.no_grad()
def build_sr_clip(vae: VAE, cfg: FamilyConfig, index: int, clip_s: float) -> dict[str, torch.Tensor]:
    """One SR training clip: the latent of each native frame, of its resized copy, and of the reference."""
    ident, aud = clip_seeds("sr", index)
    c = make_clip(ident, aud, clip_s, FPS, size=cfg.image_size)
    x = to_unit(c.frames)  # (T, 3, S, S)
    _, ref_hi = encode_reference(vae, c.reference, cfg.low_size)
    return {"lo": _encode(vae, downsample(x, cfg.low_size)).half(), "hi": _encode(vae, x).half(),
            "ref_hi": ref_hi[0]}


# Prompt words: the generator's labels and the vocabulary's synonyms for them (augmentation).
EXPRESSIONS = ("neutral", "smiling", "surprised")
ENERGIES = ("calm", "lively")
EXPRESSION_IDS = {w: i for i, w in enumerate(EXPRESSIONS)}
ENERGY_IDS = {w: i for i, w in enumerate(ENERGIES)}
SYNONYMS = {
    "neutral": ("neutral",), "smiling": ("smiling", "smile", "happy"),
    "surprised": ("surprised", "surprise", "shocked"),
    "calm": ("calm", "still"), "lively": ("lively", "energetic", "animated"),
}


def prompt_ids(labels: torch.Tensor, form: str, rng: np.random.Generator, p) -> torch.Tensor:
    """labels (B, 2) -> token ids (B, N) for one prompt form shared by the batch (so N is equal):
    "both" = "<expression> <energy>", "expr", "energy", or "talk" (a filler word first, then both)."""
    rows = []
    for e, g in labels.tolist():
        ew = SYNONYMS[EXPRESSIONS[e]][rng.integers(len(SYNONYMS[EXPRESSIONS[e]]))]
        gw = SYNONYMS[ENERGIES[g]][rng.integers(len(SYNONYMS[ENERGIES[g]]))]
        words = {"both": [ew, gw], "expr": [ew], "energy": [gw], "talk": ["talking", ew, gw]}[form]
        rows.append(tokenize(" ".join(words), p))
    return torch.tensor(rows, dtype=torch.long)  # (B, N)


def save_clip(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with atomic_path(path) as tmp:
        save_safetensors({k: v.contiguous() for k, v in tensors.items()}, tmp)


def load_clips(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Stack the cached clips (all of one length) into one dict of (N, ...) tensors."""
    items = [load_file(str(p)) for p in paths]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}

