"""Speech-like audio made in code: a source-filter (formant) synthesizer.

A glottal pulse train with a per-speaker pitch and phrase intonation, plus consonant noise,
is shaped by time-varying formant filters. The filtering is done in the STFT domain (one FFT
per 8 ms hop, vectorized over the whole utterance) instead of per-sample IIR loops, which is
what makes a minute of audio take tens of milliseconds in numpy.

The timeline is syllables ([consonant] vowel [consonant], 3-6 per second) grouped into
phrases separated by 0.2-0.8 s pauses, so the mouth has a real open/close rhythm to follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000
PEAK = 0.5
_SALT = 0x5BEEC4
_NFFT, _HOP = 512, 128
_NOISE_LEVEL = 0.05  # noise=1 gives about the RMS of a sustained vowel at voiced=1

# Peterson & Barney style formants (F1, F2, F3) in Hz for an adult male vocal tract.
VOWELS: dict[str, tuple[float, float, float]] = {
    "aa": (730.0, 1090.0, 2440.0),
    "ah": (640.0, 1190.0, 2390.0),
    "eh": (530.0, 1840.0, 2480.0),
    "ih": (390.0, 1990.0, 2550.0),
    "ee": (270.0, 2290.0, 3010.0),
    "oh": (570.0, 840.0, 2410.0),
    "oo": (300.0, 870.0, 2240.0),
}
# Consonants: kind, duration range (s), noise band centre / width (Hz), level.
_CONSONANTS: dict[str, tuple[str, tuple[float, float], float, float, float]] = {
    "s": ("fricative", (0.07, 0.12), 5500.0, 1800.0, 0.30),
    "sh": ("fricative", (0.07, 0.12), 3000.0, 1000.0, 0.35),
    "f": ("fricative", (0.06, 0.10), 5000.0, 3500.0, 0.12),
    "h": ("fricative", (0.05, 0.08), 1600.0, 1500.0, 0.10),
    "p": ("plosive", (0.05, 0.08), 900.0, 900.0, 0.45),
    "t": ("plosive", (0.05, 0.08), 4000.0, 1800.0, 0.45),
    "k": ("plosive", (0.05, 0.08), 2000.0, 800.0, 0.45),
    "m": ("nasal", (0.05, 0.09), 0.0, 0.0, 0.30),
    "n": ("nasal", (0.05, 0.09), 0.0, 0.0, 0.30),
}
_NASAL_FORMANTS = (280.0, 1300.0, 2500.0)


@dataclass(frozen=True)
class Speaker:
    """Voice of one synthetic speaker, drawn from the audio seed."""

    pitch_hz: float  # base pitch, 90-250 Hz
    formant_scale: float  # shorter vocal tracts (higher voices) shift formants up
    syllables_per_s: float
    breathiness: float
    accent_prob: float

    @classmethod
    def sample(cls, rng: np.random.Generator) -> "Speaker":
        pitch = float(np.exp(rng.uniform(np.log(90.0), np.log(250.0))))
        scale = 0.95 + 0.22 * (pitch - 90.0) / 160.0 + rng.uniform(-0.03, 0.03)
        return cls(
            pitch_hz=pitch,
            formant_scale=float(scale),
            syllables_per_s=float(rng.uniform(3.0, 6.0)),
            breathiness=float(rng.uniform(0.02, 0.12)),
            accent_prob=float(rng.uniform(0.2, 0.45)),
        )


@dataclass
class _Tracks:
    """Per-sample control signals that the synthesizer fills in syllable by syllable."""

    voiced: np.ndarray  # voicing amplitude
    noise: np.ndarray  # consonant noise amplitude
    f0: np.ndarray  # pitch in Hz
    formants: np.ndarray  # (N, 3) target F1-F3
    noise_centre: np.ndarray
    noise_width: np.ndarray

    @classmethod
    def empty(cls, n: int, pitch: float) -> "_Tracks":
        formants = np.empty((n, 3))
        formants[:] = VOWELS["ah"]
        return cls(np.zeros(n), np.zeros(n), np.full(n, pitch), formants, np.full(n, 3000.0), np.full(n, 2000.0))


def synth_speech(seed: int, duration_s: float, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Deterministic speech-like mono audio, float32 in [-0.5, 0.5] (peak normalized)."""
    n = max(0, int(round(duration_s * sample_rate)))
    if n == 0:
        return np.zeros(0, np.float32)
    rng = np.random.default_rng([int(seed), _SALT])
    speaker = Speaker.sample(rng)
    tracks = _Tracks.empty(n, speaker.pitch_hz)
    _fill_timeline(tracks, speaker, rng, sample_rate)
    audio = _render(tracks, speaker, rng, sample_rate)
    peak = float(np.abs(audio).max())
    if peak > 0:
        audio *= PEAK / peak
    audio += rng.normal(0.0, 1e-4, n)  # microphone noise floor (-80 dBFS), keeps pauses "real"
    return audio.astype(np.float32)


def _fill_timeline(tr: _Tracks, spk: Speaker, rng: np.random.Generator, sr: int) -> None:
    n = len(tr.voiced)
    t = rng.uniform(0.1, 0.35)  # leading silence
    names = list(VOWELS)
    cons = list(_CONSONANTS)
    while t < n / sr:
        start = t
        n_syl = int(rng.integers(3, 11))
        question = rng.random() < 0.25
        accents: list[tuple[float, float]] = []
        for _ in range(n_syl):
            dur = rng.uniform(0.75, 1.3) / spk.syllables_per_s
            onset = cons[int(rng.integers(len(cons)))] if rng.random() < 0.7 else None
            coda = cons[int(rng.integers(len(cons)))] if rng.random() < 0.25 else None
            stressed = rng.random() < spk.accent_prob
            t = _syllable(tr, spk, rng, sr, t, dur, names[int(rng.integers(len(names)))], onset, coda, stressed)
            if stressed:
                accents.append((t - dur * 0.5, rng.uniform(0.1, 0.25)))
        _intonation(tr, spk, rng, sr, start, t, accents, question)
        t += rng.uniform(0.2, 0.8)  # pause between phrases


def _syllable(
    tr: _Tracks, spk: Speaker, rng: np.random.Generator, sr: int,
    t: float, dur: float, vowel: str, onset: str | None, coda: str | None, stressed: bool,
) -> float:
    level = rng.uniform(0.85, 1.0) if stressed else rng.uniform(0.45, 0.75)
    t_start = t
    if onset is not None:
        t = _consonant(tr, spk, rng, sr, t, onset, level)
    coda_len = _CONSONANTS[coda][1][1] if coda else 0.0
    v_len = max(0.06, dur - (t - t_start) - coda_len)  # the vowel gets what is left
    formants = np.array(VOWELS[vowel]) * spk.formant_scale
    _segment(tr.voiced, sr, t, t + v_len, level, attack=0.03, release=0.06)
    _fill(tr.formants, sr, t - 0.02, t + v_len + 0.02, formants)
    t += v_len
    if coda is not None:
        t = _consonant(tr, spk, rng, sr, t, coda, level * 0.8)
    return t


def _consonant(
    tr: _Tracks, spk: Speaker, rng: np.random.Generator, sr: int, t: float, name: str, level: float
) -> float:
    kind, (lo, hi), centre, width, amp = _CONSONANTS[name]
    dur = rng.uniform(lo, hi)
    if kind == "nasal":
        _segment(tr.voiced, sr, t, t + dur, level * amp, attack=0.015, release=0.015)
        _fill(tr.formants, sr, t, t + dur, np.array(_NASAL_FORMANTS) * spk.formant_scale)
    elif kind == "fricative":
        _segment(tr.noise, sr, t, t + dur, level * amp, attack=0.02, release=0.02)
        _fill(tr.noise_centre, sr, t, t + dur, centre)
        _fill(tr.noise_width, sr, t, t + dur, width)
    else:  # plosive: silent closure, then a short burst
        burst = t + dur * 0.7
        _segment(tr.noise, sr, burst, t + dur, level * amp, attack=0.002, release=0.015)
        _fill(tr.noise_centre, sr, burst, t + dur, centre)
        _fill(tr.noise_width, sr, burst, t + dur, width)
    return t + dur


def _intonation(
    tr: _Tracks, spk: Speaker, rng: np.random.Generator, sr: int,
    start: float, end: float, accents: list[tuple[float, float]], question: bool,
) -> None:
    i0, i1 = _span(sr, start, end + 0.1, len(tr.f0))
    if i1 <= i0:
        return
    prog = np.linspace(0.0, 1.0, i1 - i0)
    contour = 1.1 - 0.22 * prog  # declination over the phrase
    tail = np.clip((prog - 0.8) / 0.2, 0.0, 1.0)
    contour *= 1.0 + (0.3 if question else -0.08) * tail
    wobble = rng.uniform(0.01, 0.04) * np.sin(2 * np.pi * rng.uniform(0.5, 2.0) * prog + rng.uniform(0, 6.3))
    contour *= 1.0 + wobble
    times = (np.arange(i0, i1) + 0.5) / sr
    for centre, height in accents:  # pitch accents on stressed syllables
        contour *= 1.0 + height * np.exp(-0.5 * ((times - centre) / 0.07) ** 2)
    tr.f0[i0:i1] = spk.pitch_hz * contour


def _segment(track: np.ndarray, sr: int, t0: float, t1: float, level: float, attack: float, release: float) -> None:
    """Add a smooth attack/sustain/release bump to an amplitude track (max, not sum)."""
    i0, i1 = _span(sr, t0, t1, len(track))
    if i1 <= i0:
        return
    t = (np.arange(i0, i1) + 0.5) / sr
    env = np.clip(np.minimum((t - t0) / attack, (t1 - t) / release), 0.0, 1.0)
    env = env * env * (3 - 2 * env)  # smoothstep: no clicks
    np.maximum(track[i0:i1], level * env, out=track[i0:i1])


def _fill(track: np.ndarray, sr: int, t0: float, t1: float, value: np.ndarray | float) -> None:
    i0, i1 = _span(sr, t0, t1, len(track))
    if i1 > i0:
        track[i0:i1] = value


def _span(sr: int, t0: float, t1: float, n: int) -> tuple[int, int]:
    return max(0, int(t0 * sr)), min(n, int(t1 * sr))


def _render(tr: _Tracks, spk: Speaker, rng: np.random.Generator, sr: int) -> np.ndarray:
    n = len(tr.voiced)
    # Glottal pulses: one per pitch period, split linearly between the two nearest samples so
    # the pitch is not quantized to whole samples.
    f0 = tr.f0 * (1.0 + 0.006 * rng.standard_normal(n).cumsum().clip(-3, 3) / 3)  # slow jitter
    phase = np.cumsum(f0 / sr)
    idx = np.nonzero(np.diff(np.floor(phase)))[0] + 1
    frac = (phase[idx] - np.floor(phase[idx])) / (f0[idx] / sr)
    gain = tr.voiced[idx] * (1.0 + 0.08 * rng.standard_normal(len(idx)))  # shimmer
    gain *= np.sqrt(100.0 / f0[idx])  # equal loudness across voice pitches
    source = np.zeros(n)
    source[idx] += gain * (1.0 - frac).clip(0, 1)
    source[np.maximum(idx - 1, 0)] += gain * frac.clip(0, 1)
    source += spk.breathiness * tr.voiced * rng.standard_normal(n) * 0.15  # aspiration
    noise = tr.noise * rng.standard_normal(n)

    frames_v, frames_n, centres = _stft(source), _stft(noise), _frame_centres(n)
    freqs = np.fft.rfftfreq(_NFFT, 1.0 / sr)  # (F,)
    formants = _smooth(tr.formants, int(0.025 * sr))[centres]  # (K, 3) with coarticulation
    env_v = _vowel_envelope(freqs, formants, spk.formant_scale)  # (K, F)
    nc, nw = tr.noise_centre[centres, None], tr.noise_width[centres, None]  # (K, 1)
    env_n = np.exp(-0.5 * ((freqs[None, :] - nc) / nw) ** 2) + 0.02  # (K, F)
    # Unit-power noise bands at a sustained vowel's level, so the consonant levels in
    # _CONSONANTS read as "fraction of a vowel" whatever the band width.
    env_n *= _NOISE_LEVEL / np.sqrt((env_n**2).mean(axis=1, keepdims=True))
    return _istft(frames_v * env_v + frames_n * env_n, n)


def _vowel_envelope(freqs: np.ndarray, formants: np.ndarray, scale: float) -> np.ndarray:
    """Cascade of resonances |H(f)| = F^2 / sqrt((F^2 - f^2)^2 + (B f)^2) plus glottal tilt."""
    f = freqs[None, :]  # (1, F)
    env = 1.0 / np.sqrt(1.0 + (f / 300.0) ** 2)  # glottal roll-off net of lip radiation
    poles = [(formants[:, 0], 90.0), (formants[:, 1], 110.0), (formants[:, 2], 160.0)]
    poles += [(np.full(len(formants), 3500.0 * scale), 250.0), (np.full(len(formants), 4500.0 * scale), 300.0)]
    for fc, bw in poles:
        fc2 = fc[:, None] ** 2  # (K, 1)
        env = env * fc2 / np.sqrt((fc2 - f * f) ** 2 + (bw * f) ** 2)
    return env  # (K, F)


def _smooth(x: np.ndarray, width: int) -> np.ndarray:
    """Moving average along time (axis 0) via cumulative sums."""
    if width <= 1:
        return x
    c = np.cumsum(np.pad(x, ((width // 2 + 1, width - width // 2 - 1), (0, 0)), mode="edge"), axis=0)
    return (c[width:] - c[:-width]) / width


def _frame_centres(n: int) -> np.ndarray:
    """Sample index at the centre of each `_stft` frame (frame k is centred on k * _HOP)."""
    k = (n + _NFFT) // _HOP + 1
    return np.clip(np.arange(k) * _HOP, 0, n - 1)


def _stft(x: np.ndarray) -> np.ndarray:
    """Hann-windowed frames every _HOP samples, frame k centred on sample k * _HOP."""
    k = (len(x) + _NFFT) // _HOP + 1
    pad = np.zeros(k * _HOP + _NFFT)
    pad[_NFFT // 2 : _NFFT // 2 + len(x)] = x
    frames = np.lib.stride_tricks.sliding_window_view(pad, _NFFT)[::_HOP][:k]  # (K, NFFT)
    return np.fft.rfft(frames * np.hanning(_NFFT + 1)[:-1], axis=1)


def _istft(spec: np.ndarray, n: int) -> np.ndarray:
    """Weighted overlap-add inverse of `_stft` (hop = NFFT / 4, so 4 shifted block sums)."""
    win = np.hanning(_NFFT + 1)[:-1]
    frames = np.fft.irfft(spec, n=_NFFT, axis=1) * win  # (K, NFFT)
    k, parts = frames.shape[0], _NFFT // _HOP
    out = np.zeros((k + parts, _HOP))
    for m in range(parts):  # block m of frame j lands on output block j + m
        out[m : m + k] += frames[:, m * _HOP : (m + 1) * _HOP]
    norm = (win**2).reshape(parts, _HOP).sum(axis=0)  # constant-overlap weight per position
    flat = (out / norm).reshape(-1)
    return flat[_NFFT // 2 : _NFFT // 2 + n]
