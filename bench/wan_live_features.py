"""How far wan-s2v's live audio features (audio.LiveAudioFeatures: a window ending `lookahead_s` past the frames asked
for, normalised on its own, a fixed 50 -> 30 fps rate) are from the official whole-audio features, on the tiny
wav2vec2 of the goldens and their 6-s speech-like wave, a second of video (16 frames at 16 fps) per request.

    python bench/wan_live_features.py [--lookahead 0.5 1.0 2.0]

Prints, per lookahead, the relative L2 difference of each second's features and of all of them. The tiny model's
weights are random: this bounds how the approximation behaves, not what it does to the released wav2vec2."""

import argparse
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from avatar_cli.families.wan_s2v.audio import LiveAudioFeatures, audio_features, clip_audio, load_wav2vec2

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "wan_s2v"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lookahead", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    args = ap.parse_args()
    wave = load_file(str(GOLDEN / "w2v_io.safetensors"))["wave"].numpy()
    model, extractor = load_wav2vec2(GOLDEN / "w2v_tiny")
    frames = int(wave.size / 16000 * 16)
    official = clip_audio(audio_features(model, extractor, wave), 0, frames)  # (1, 25, dim, frames)

    def read(a: int, b: int) -> np.ndarray:  # what a live source holds: zeros past what has arrived
        out = np.zeros(b - a, np.float32)
        lo, hi = max(a, 0), min(b, wave.size)
        if lo < hi:
            out[lo - a:hi - a] = wave[lo:hi]
        return out

    for lookahead in args.lookahead:
        live = LiveAudioFeatures(model, extractor, read, lookahead_s=lookahead)
        parts = [live.clip(a, min(16, frames - a)) for a in range(0, frames, 16)]
        rel = [float((p - official[..., a:a + p.shape[-1]]).norm() / official[..., a:a + p.shape[-1]].norm())
               for a, p in zip(range(0, frames, 16), parts)]
        print(f"lookahead {lookahead:g} s: relative L2 per second {', '.join(f'{r:.3f}' for r in rel)}; "
              f"median {float(np.median(rel)):.3f}")


if __name__ == "__main__":
    main()
