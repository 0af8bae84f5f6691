"""Audio features: log-mel windows centred on each video frame, and the learned encoder over them."""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchaudio.functional as AF
from torch import nn

from avatar_cli.families.mini.layers import per_row


@dataclass(frozen=True)
class AudioParams:
    sample_rate: int = 16_000
    n_fft: int = 400
    hop: int = 160
    n_mels: int = 40
    # Each video frame sees this much audio on both sides of its timestamp (lip shapes lead the sound).
    context_s: float = 0.12
    dim: int = 128

    @property
    def window_samples(self) -> int:
        return int(round(2 * self.context_s * self.sample_rate))

    @property
    def mel_frames(self) -> int:
        return 1 + (self.window_samples - self.n_fft) // self.hop


def frame_window_starts(first_frame: int, num_frames: int, fps: float, p: AudioParams) -> torch.Tensor:
    """Sample index where each frame's audio window starts: centred on the frame's mid time (i + 0.5) / fps."""
    centres = (torch.arange(first_frame, first_frame + num_frames, dtype=torch.float64) + 0.5) / fps
    return torch.round(centres * p.sample_rate).long() - p.window_samples // 2  # (T,)


@functools.lru_cache(maxsize=4)
def _stft_tables(p: AudioParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hann window and mel filterbank (freqs, n_mels): built once, not on every chunk."""
    fb = AF.melscale_fbanks(p.n_fft // 2 + 1, 40.0, p.sample_rate / 2, p.n_mels, p.sample_rate)
    return torch.hann_window(p.n_fft), fb


def log_mel_windows(windows: torch.Tensor, p: AudioParams) -> torch.Tensor:
    """windows (T, window_samples) mono audio -> (T, n_mels, mel_frames) log-mel features."""
    window, fb = _stft_tables(p)
    spec = torch.stft(windows.float(), p.n_fft, p.hop, window=window, center=False,
                      return_complex=True).abs().pow(2)  # (T, n_fft/2+1, mel_frames)
    mel = torch.einsum("tfn,fm->tmn", spec, fb)  # (T, n_mels, mel_frames)
    return (torch.log(mel + 1e-6) + 6.0) / 4.0  # roughly zero-mean, unit-scale for speech at normal levels


class AudioEncoder(nn.Module):
    def __init__(self, p: AudioParams):
        super().__init__()
        self.params = p
        self.conv1 = nn.Conv1d(p.n_mels, p.dim, 3, padding=1)
        self.conv2 = nn.Conv1d(p.dim, p.dim, 3, stride=2, padding=1)
        self.out = nn.Linear(p.dim, p.dim)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (T, n_mels, mel_frames) -> per-frame audio features (T, dim)."""
        h = F.silu(self.conv1(mel))  # (T, dim, mel_frames)
        h = F.silu(self.conv2(h))  # (T, dim, ceil(mel_frames/2))
        return per_row(self.out, h.mean(dim=-1))  # (T, dim)

