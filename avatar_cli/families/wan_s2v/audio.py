"""The Wan2.2-S2V audio features: wav2vec2 (the release's `wav2vec2-large-xlsr-53-english/`) through transformers,
its 25 hidden states resampled 50 -> 30 fps, and the per-video-frame bucketing of the official AudioEncoder
(wan/modules/s2v/audio_encoder.py, wan/speech2video.py `encode_audio`).

    model, extractor = load_wav2vec2(ckpt / "wav2vec2-large-xlsr-53-english")
    feats = audio_features(model, extractor, samples_16k)          # (25, T30, 1024), the whole audio at once
    audio = clip_audio(feats, first_frame=80 * r, num_frames=80)   # (1, 25, 1024, 80): clip r's DiT input

The input is mono float32 at 16 kHz, as the renderer's audio reader delivers it. The official code gets it from
`librosa.load(path, sr=16000)`: channels averaged, and for other rates resampled with soxr ("soxr_hq", librosa's
default), whose filter differs from FFmpeg's, so for non-16-kHz files samples (and features) differ slightly
(mostly near the 8 kHz band edge); 16-kHz mono files give the same samples.

Time mapping: video frame k takes the 30-fps feature `i = round_half_even(k * 30 / fps)`, which is linearly
interpolated between wav2vec2 frames at position p = i * (T_w - 1) / (T30 - 1); wav2vec2 frame j sees samples
[320 j, 320 j + 400), centred at (320 j + 200) / 16000 s. So at fps 16 frame k's features come from audio time
k / 16 s + (-4.2 ms .. +42.5 ms), whatever the length (computed for 1 s to 4 h: the rounding to 30 fps adds up
to +-1/60 s, the frame centre +12.5 ms, the align_corners stretch of T_w - 1 onto T30 - 1 the rest; it does not
drift); `feature_time_s` gives the exact value. Giving output frame k the features of frame k keeps picture and
sound in step; the official pipeline's 3-frame lead (`WanS2V.generate` drops clip 0's first 3 decoded frames,
`image[:, :, 3:]`, in wan/speech2video.py) comes from dropping those frames, not
from these features.

The official path encodes the whole audio in one wav2vec2 call, whose memory grows with the length (quadratically
in attention; the first conv layer alone holds 512 x N/5 floats). `WindowedAudioFeatures` encodes overlapping
windows of bounded length instead and keeps each window's middle, so memory stays flat over hours; see its
docstring for how close it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Wav2Vec2FeatureExtractor

if TYPE_CHECKING:  # transformers' modeling import is slow: made where a model is loaded
    from transformers import Wav2Vec2Model

__all__ = ["SAMPLE_RATE", "HOP", "FIELD", "W2V_FPS", "FEATURE_FPS", "VIDEO_FPS", "CLIP_FRAMES", "NUM_LAYERS",
           "num_w2v_frames", "num_feature_frames", "num_clips", "frame_indices", "feature_time_s", "load_wav2vec2",
           "normalize", "hidden_states", "to_feature_rate", "audio_features", "clip_audio", "normalization_stats",
           "WindowedAudioFeatures", "LiveAudioFeatures"]

SAMPLE_RATE = 16000
HOP = 320  # samples per wav2vec2 frame: the conv strides 5 * 2**6
FIELD = 400  # samples one wav2vec2 frame sees: the conv stack's receptive field
W2V_FPS = 50  # the nominal wav2vec2 rate the official resampling assumes (16000 / 320)
FEATURE_FPS = 30  # the official AudioEncoder.video_rate
VIDEO_FPS = 16
CLIP_FRAMES = 80  # video frames per official clip (infer_frames)
NUM_LAYERS = 25  # hidden states: the embedding output plus 24 transformer layers


def num_w2v_frames(num_samples: int) -> int:
    """T_w = floor((N - 400) / 320) + 1 wav2vec2 frames for N samples (0 below 400 samples)."""
    return 0 if num_samples < FIELD else (num_samples - FIELD) // HOP + 1


def num_feature_frames(t_w: int) -> int:
    """T30: the official length `int(T_w / 50.0 * 30)`, in the same float arithmetic as the official code (an
    exact 0.6 * T_w could round differently). Below 2 wav2vec2 frames the official interpolation fails (length 0
    output); this raises instead."""
    t30 = int(t_w / float(W2V_FPS) * FEATURE_FPS)
    if t30 < 1:
        raise ValueError(f"audio too short: {t_w} wav2vec2 frame(s) give no 30-fps feature (needs >= 720 samples)")
    return t30


def num_clips(t30: int, fps: int = VIDEO_FPS, clip_frames: int = CLIP_FRAMES) -> int:
    """The official clip count `int(T30 / (clip_frames * 30 / fps)) + 1`: it always rounds up, so the last clip
    runs past the audio (zero features there) and a whole multiple of 150 features still gets one more clip."""
    return int(t30 / (clip_frames * (FEATURE_FPS / fps))) + 1


def frame_indices(num_frames: int, fps: int | float | Fraction = VIDEO_FPS, first_frame: int = 0) -> torch.Tensor:
    """(num_frames,) int64: the 30-fps feature index of video frames first_frame .. first_frame + num_frames - 1,
    round_half_even(k * 30 / fps) (numpy's np.round, as the official get_sample_indices; at fps 16 the official
    float arithmetic is exact, so this exact rational form equals it: frame 4 -> 8, frame 12 -> 22)."""
    rate = Fraction(fps)
    k = np.arange(first_frame, first_frame + num_frames, dtype=np.int64)
    num = k * (FEATURE_FPS * rate.denominator)  # k * 30 / fps == num / den exactly
    den = rate.numerator
    q, r = np.divmod(num, den)
    up = (2 * r > den) | ((2 * r == den) & (q % 2 == 1))  # ties go to the even neighbour
    return torch.from_numpy(q + up)


def feature_time_s(frame: int, num_samples: int, fps: int | float | Fraction = VIDEO_FPS) -> float | None:
    """The audio time (s) at the centre of what video frame `frame`'s features are interpolated from; None where
    the frame is past the audio (its features are zeros)."""
    t_w = num_w2v_frames(num_samples)
    t30 = num_feature_frames(t_w)
    i = int(frame_indices(1, fps, frame)[0])
    if i >= t30:
        return None
    p = i * (t_w - 1) / (t30 - 1) if t30 > 1 else 0.0  # align_corners=True: ends map to ends
    return (HOP * p + FIELD / 2) / SAMPLE_RATE


def load_wav2vec2(folder: str | Path) -> tuple[Wav2Vec2Model, Wav2Vec2FeatureExtractor]:
    """The checkpoint's wav2vec2 folder, from disk only: the encoder in eval mode on CPU in float32 (the release's
    dtype; the official code keeps it there), and the feature extractor. The folder holds a Wav2Vec2ForCTC: it is
    loaded as such (every key used, no load report) and its CTC head dropped, since only hidden states are read."""
    from transformers import Wav2Vec2ForCTC

    folder = Path(folder)
    ctc = Wav2Vec2ForCTC.from_pretrained(str(folder), local_files_only=True)
    model = ctc.wav2vec2.eval().requires_grad_(False)
    extractor = Wav2Vec2FeatureExtractor.from_pretrained(str(folder), local_files_only=True)
    return model, extractor


def normalize(samples: np.ndarray, extractor: Wav2Vec2FeatureExtractor) -> np.ndarray:
    """(N,) float32 model input: the extractor's zero-mean unit-variance normalisation over the whole array when
    its config says do_normalize (the release's does), else the samples as they are."""
    if extractor.sampling_rate != SAMPLE_RATE:
        raise ValueError(f"the feature extractor expects {extractor.sampling_rate} Hz, not {SAMPLE_RATE}")
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"expected mono samples (N,), got shape {x.shape}")
    if not extractor.do_normalize:
        return x
    return extractor(x, sampling_rate=SAMPLE_RATE, return_tensors="np").input_values[0]


@torch.no_grad()
def hidden_states(model: Wav2Vec2Model, input_values: torch.Tensor) -> torch.Tensor:
    """(25, T_w, dim) float32 for (N,) normalised samples: every hidden state of one wav2vec2 call, as the
    official AudioEncoder stacks them under its pinned transformers (<= 4.51.3).

    The last layer is the encoder's output, `last_hidden_state`. For the stable-layer-norm encoder of
    wav2vec2-large-xlsr-53 that is the state after the encoder's final `layer_norm`: transformers 4.x appends
    that state as the last of `hidden_states`, while transformers 5 appends the one before the norm (and
    `last_hidden_state` alone carries the normed one). Taking `last_hidden_state` gives the official layer
    under either; for the post-norm encoder (wav2vec2-base) both versions agree that the two are the same.
    """
    p = next(model.parameters())
    out = model(input_values[None].to(p.device, p.dtype), output_hidden_states=True)  # (1, N) in
    layers = (*out.hidden_states[:-1], out.last_hidden_state)  # 25 x (1, T_w, dim)
    return torch.cat(layers).float()  # (25, T_w, dim)


def to_feature_rate(h: torch.Tensor) -> torch.Tensor:
    """(L, T_w, D) -> (L, T30, D): the official 50 -> 30 fps resampling, linear with align_corners=True."""
    t30 = num_feature_frames(h.shape[1])
    x = F.interpolate(h.transpose(1, 2), size=t30, mode="linear", align_corners=True)  # (L, D, T30)
    return x.transpose(1, 2)  # (L, T30, D)


def audio_features(model: Wav2Vec2Model, extractor: Wav2Vec2FeatureExtractor, samples: np.ndarray) -> torch.Tensor:
    """(25, T30, dim) float32 on the model's device: the official whole-audio features of mono 16-kHz samples."""
    x = torch.from_numpy(normalize(samples, extractor))  # (N,)
    return to_feature_rate(hidden_states(model, x))  # (25, T30, dim)


def clip_audio(features: torch.Tensor, first_frame: int, num_frames: int, fps: int = VIDEO_FPS) -> torch.Tensor:
    """(1, 25, dim, num_frames): the DiT's audio input for video frames first_frame .. first_frame + num_frames - 1,
    one 30-fps feature per frame, zeros past the audio's end (the official bucket, m=0, sliced as clip r slices it
    with first_frame = 80 r)."""
    layers, t30, dim = features.shape
    idx = frame_indices(num_frames, fps, first_frame).to(features.device)  # (n,)
    inside = idx < t30  # (n,)
    out = features.new_zeros(layers, num_frames, dim)  # (25, n, dim)
    out[:, inside] = features[:, idx[inside]]  # (25, n_inside, dim)
    return out.permute(0, 2, 1)[None]  # (1, 25, dim, n)


def normalization_stats(chunks: Iterable[np.ndarray]) -> tuple[float, float]:
    """(mean, std) of a stream of sample chunks in one pass (float64 sums), for WindowedAudioFeatures fed by a
    reader; std includes the extractor's 1e-7 variance floor. Equals the extractor's float32 statistics to ~1e-7."""
    n, s, ss = 0, 0.0, 0.0
    for c in chunks:
        c = np.asarray(c, dtype=np.float64).reshape(-1)
        n, s, ss = n + c.size, s + float(c.sum()), ss + float(np.dot(c, c))
    if n == 0:
        raise ValueError("no samples")
    mean = s / n
    return mean, float(np.sqrt(max(ss / n - mean * mean, 0.0) + 1e-7))


class WindowedAudioFeatures:
    """The features of a long audio, computed lazily from overlapping windows of bounded length.

    wav2vec2 frames are cut into windows of `window_s` seconds (whole frames, so each window's conv features equal
    the whole-audio ones) that overlap by `overlap_s`; each window contributes only its middle (it drops
    overlap_s / 2 at each inner edge), so every kept frame has at least overlap_s / 2 of context on both sides. The
    last window is moved back to end at the audio's end. Normalisation uses the whole audio's mean and std, and the
    50 -> 30 fps resampling uses the whole audio's T_w and T30, so the only difference from `audio_features` is the
    attention span (and the positional conv, 64 frames wide, at window edges); audio no longer than one window
    gives the whole-audio features. The grid is fixed, so a frame's features do not depend on the access order.

    `read(start, end)` returns float32 samples [start, end) (the renderer's AudioWindowReader.read fits); at most
    `cache` windows are kept (one window: 25 x window_s * 50 x dim floats, 154 MB at 30 s for the release).
    """

    def __init__(self, model: Wav2Vec2Model, extractor: Wav2Vec2FeatureExtractor,
                 read: Callable[[int, int], np.ndarray], num_samples: int, *, mean: float = 0.0, std: float = 1.0,
                 window_s: float = 30.0, overlap_s: float = 6.0, cache: int = 2):
        self.model, self.read, self.num_samples = model, read, int(num_samples)
        # Exactly the extractor's float32 arithmetic: (x - mean) / sqrt(var + 1e-7), std passed as that sqrt.
        self.mean, self.std = np.float32(mean), np.float32(std)
        self.normalize = bool(extractor.do_normalize)
        self.t_w = num_w2v_frames(self.num_samples)
        self.t30 = num_feature_frames(self.t_w)
        self.window = int(round(window_s * W2V_FPS))
        self.half = int(round(overlap_s * W2V_FPS)) // 2
        self.hop = self.window - 2 * self.half
        if self.hop < 1:
            raise ValueError(f"overlap {overlap_s} s leaves no hop in a {window_s} s window")
        self.cache_size = max(1, cache)
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    @classmethod
    def from_array(cls, model: Wav2Vec2Model, extractor: Wav2Vec2FeatureExtractor, samples: np.ndarray,
                   **kw) -> WindowedAudioFeatures:
        """For samples in memory: the statistics computed exactly as the extractor computes them."""
        x = np.asarray(samples, dtype=np.float32)
        var = x.var()
        return cls(model, extractor, lambda a, b: x[a:b], x.size, mean=x.mean(),
                   std=np.sqrt(var + np.float32(1e-7)), **kw)

    @property
    def num_windows(self) -> int:
        return 1 if self.t_w <= self.window else max(0, (self.t_w - 1 - self.half) // self.hop) + 1

    def window_of(self, frames: np.ndarray) -> np.ndarray:
        """The window that owns each wav2vec2 frame (its kept middle holds the frame)."""
        return np.minimum(np.maximum(0, (frames - self.half) // self.hop), self.num_windows - 1)

    def span(self, a: int) -> tuple[int, int]:
        """Window a's wav2vec2 frames [f0, f1)."""
        if self.t_w <= self.window:
            return 0, self.t_w
        if a == self.num_windows - 1:
            return self.t_w - self.window, self.t_w
        return a * self.hop, min(a * self.hop + self.window, self.t_w)

    def _window(self, a: int) -> torch.Tensor:
        """(25, f1 - f0, dim) hidden states of window a, cached."""
        if a in self._cache:
            self._cache.move_to_end(a)
            return self._cache[a]
        f0, f1 = self.span(a)
        x = np.asarray(self.read(HOP * f0, HOP * (f1 - 1) + FIELD), dtype=np.float32)  # (n,)
        if self.normalize:
            x = (x - self.mean) / self.std
        h = hidden_states(self.model, torch.from_numpy(np.ascontiguousarray(x)))  # (25, f1 - f0, dim)
        if h.shape[1] != f1 - f0:
            raise ValueError(f"read({HOP * f0}, {HOP * (f1 - 1) + FIELD}) returned {x.size} samples")
        self._cache[a] = h
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return h

    def _frames(self, frames: np.ndarray) -> torch.Tensor:
        """(25, n, dim) hidden states of the given wav2vec2 frames, each from its owning window."""
        owners = self.window_of(frames)
        parts = []
        for a in np.unique(owners):
            sel = frames[owners == a]
            f0, _ = self.span(int(a))
            parts.append(self._window(int(a))[:, torch.from_numpy(sel - f0)])  # (25, n_a, dim)
        return torch.cat(parts, dim=1)  # frames are sorted, windows ascending: (25, n, dim)

    def features(self, start: int, end: int) -> torch.Tensor:
        """(25, end - start, dim) 30-fps features [start, end), as audio_features(...)[:, start:end]."""
        if not 0 <= start <= end <= self.t30:
            raise IndexError(f"features [{start}, {end}) outside [0, {self.t30})")
        if end == start:
            device = next(self.model.parameters()).device
            return torch.zeros(NUM_LAYERS, 0, self.model.config.hidden_size, device=device)
        # F.interpolate's linear align_corners arithmetic (float32): src = i * (T_w - 1) / (T30 - 1).
        scale = (torch.tensor(self.t_w - 1, dtype=torch.float32) / (self.t30 - 1)) if self.t30 > 1 \
            else torch.tensor(0.0)
        src = torch.arange(start, end, dtype=torch.float32) * scale  # (n,)
        lo = src.long().clamp(max=self.t_w - 1)  # (n,)
        hi = (lo + 1).clamp(max=self.t_w - 1)  # (n,)
        lam = (src - lo.float()).clamp(0, 1)  # (n,)
        needed = np.arange(int(lo.min()), int(hi.max()) + 1)  # the wav2vec2 frames these features read
        h = self._frames(needed)  # (25, m, dim)
        base = int(needed[0])
        lam = lam.to(h.device)[None, :, None]  # (1, n, 1)
        x0, x1 = h[:, lo - base], h[:, hi - base]  # (25, n, dim) each
        # The CPU kernel computes fma(x0, 1 - lam, x1 * lam): the same rounding, so a single window is bit-exact.
        return (x0.double() * (1 - lam).double() + (x1 * lam).double()).float()  # (25, n, dim)

    def clip(self, first_frame: int, num_frames: int, fps: int = VIDEO_FPS) -> torch.Tensor:
        """(1, 25, dim, num_frames): as clip_audio(audio_features(...), first_frame, num_frames, fps)."""
        idx = frame_indices(num_frames, fps, first_frame)  # (n,)
        inside = idx < self.t30  # (n,)
        sel = idx[inside]  # ascending
        lo = int(sel[0]) if len(sel) else 0
        feats = self.features(lo, int(sel[-1]) + 1 if len(sel) else 0)  # (25, span, dim)
        out = feats.new_zeros(NUM_LAYERS, num_frames, self.model.config.hidden_size)  # (25, n, dim)
        out[:, inside.to(out.device)] = feats[:, (sel - lo).to(out.device)]  # (25, n_inside, dim)
        return out.permute(0, 2, 1)[None]  # (1, 25, dim, n)


class LiveAudioFeatures:
    """The features of audio that is still arriving (a live session), where the official whole-audio computation
    cannot run: its normalisation uses the whole audio's mean and deviation, and its 50 -> 30 fps resampling maps
    wav2vec2 frame T_w - 1 onto feature T30 - 1 of the whole length. Here, for each request:

    - wav2vec2 runs on a window of `window_s` ending `lookahead_s` past the last frame asked for (so a frame sees
      context on both sides, as in the windowed file path), normalised with that window's own mean and deviation;
    - 30-fps feature i is interpolated at wav2vec2 position i * 50 / 30, the rate the official mapping tends to as
      the audio grows (for a 10-s audio it stretches by 0.2 %).

    So a live render's features are close to, not equal to, a file render's of the same audio; `read` must hold the
    samples up to `lookahead_s` past the request (the live plan waits for them: `lookahead_s` is the family's
    audio lookahead).
    """

    def __init__(self, model: Wav2Vec2Model, extractor: Wav2Vec2FeatureExtractor,
                 read: Callable[[int, int], np.ndarray], *, window_s: float = 10.0, lookahead_s: float = 0.5):
        self.model, self.read = model, read
        self.normalize = bool(extractor.do_normalize)
        self.window = int(round(window_s * W2V_FPS))
        self.ahead = int(round(lookahead_s * W2V_FPS))

    def clip(self, first_frame: int, num_frames: int, fps: int = VIDEO_FPS) -> torch.Tensor:
        """(1, 25, dim, num_frames) features of video frames first_frame .. first_frame + num_frames - 1."""
        idx = frame_indices(num_frames, fps, first_frame).to(torch.float64)  # (n,) 30-fps feature indices
        pos = idx * (W2V_FPS / FEATURE_FPS)  # (n,) wav2vec2 positions
        f1 = int(pos.max().floor()) + 2 + self.ahead  # frames [f0, f1): the window ends past the last one asked for
        f0 = max(0, min(int(pos.min().floor()), f1 - self.window))
        x = np.asarray(self.read(HOP * f0, HOP * (f1 - 1) + FIELD), dtype=np.float32)  # (n_samples,)
        if self.normalize:
            x = (x - x.mean()) / np.sqrt(x.var() + np.float32(1e-7))  # the extractor's rule, over this window
        h = hidden_states(self.model, torch.from_numpy(np.ascontiguousarray(x)))  # (25, f1 - f0, dim)
        local = (pos - f0).clamp(0, h.shape[1] - 1)  # (n,)
        lo = local.floor().long()  # (n,)
        hi = (lo + 1).clamp(max=h.shape[1] - 1)  # (n,)
        lam = (local - lo.to(local.dtype)).to(h.dtype)[None, :, None].to(h.device)  # (1, n, 1)
        out = h[:, lo.to(h.device)] * (1 - lam) + h[:, hi.to(h.device)] * lam  # (25, n, dim)
        return out.permute(0, 2, 1)[None]  # (1, 25, dim, n)
