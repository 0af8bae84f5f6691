"""ReAE, SwiftVR's restoration-aware autoencoder (official `swiftvr/models/reae.py:ReAE`), key-for-key with the
release's `reae.safetensors`.

Frames are pixel-unshuffled by `patch` and encoded to latents 16x smaller in space (three stride-2 convs after the
unshuffle) and 4x shorter in time (two TPool x2 stages); the decoder mirrors it (nearest x2 upsampling, two TGrow x2
stages) and its first output trims the 3 frames of causal padding. Both are causal: each MemBlock mixes a frame with
the previous frame of its own input, and that previous frame is all that crosses a chunk boundary
(`swiftvr/streaming/tae.py:apply_parallel_with_boundary`). Here that state is explicit: `encode`/`decode` take and
return a dict of tensors, one per MemBlock (absent = the zeros the official code starts with), so a resume checkpoint
can hold it. TPool never carries frames: every chunk length is a multiple of its stride here (enforced).

The official code builds the modules as `nn.Sequential`s, so the checkpoint's keys are `encoder.N.*`/`decoder.N.*`
with N the position in the sequence; `EncoderSpec`/`DecoderSpec` lay the same positions out.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ReAEParams:
    """The release's ReAE is the official defaults (`ReAE(width_mult=2)`): `release()`. The channel counts are
    fields so that tests can build the same topology at a toy size."""

    enc_dim: int = 64  # every encoder stage (hard-coded 64 officially)
    dec_dims: tuple[int, int, int, int] = (512, 256, 128, 64)  # 256·w, 128·w, 64·w, 64 with width_mult w = 2
    latent_channels: int = 48
    patch: int = 2  # pixel (un)shuffle factor
    image_channels: int = 3

    @classmethod
    def release(cls) -> "ReAEParams":
        return cls()

    @property
    def space_factor(self) -> int:
        return self.patch * 8  # unshuffle, then three stride-2 convs

    time_factor = 4  # two TPool x2 stages
    trim_frames = 3  # 2 ** (number of temporal x2 stages) - 1, dropped from the first decode


class MemBlock(nn.Module):
    """relu(convs(cat[x_t, x_{t-1}]) + x_t): three 3x3 convs (keys conv.0, conv.2, conv.4) with ReLUs between,
    over the frame and the previous frame of the same input; the identity skip has no weights."""

    def __init__(self, n: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2 * n, n, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(n, n, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(n, n, 3, padding=1))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, C, H, W) consecutive frames; past (1, C, H, W) the frame before x[0]. -> (T, C, H, W) and the new
        past, x's last frame."""
        prev = torch.cat([past, x[:-1]])  # (T, C, H, W) each frame's predecessor
        return F.relu(self.conv(torch.cat([x, prev], dim=1)) + x), x[-1:].clone()  # a copy: a view keeps all T alive


class TPool(nn.Module):
    """Temporal pooling by `stride`: `stride` consecutive frames stacked on channels (earlier first), 1x1 conv."""

    def __init__(self, n: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n * stride, n, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, C, H, W), T a multiple of stride -> (T / stride, C, H, W)."""
        T, C, H, W = x.shape
        if T % self.stride:
            raise ValueError(f"TPool: {T} frames is not a multiple of its stride {self.stride}")
        return self.conv(x.reshape(T // self.stride, self.stride * C, H, W))


class TGrow(nn.Module):
    """Temporal upsampling. Stride 1: a 1x1 projection (`proj`). Stride 2 (`conv3d`): each frame repeated twice and a
    (3, 1, 1) conv with zero padding run over the pair, so output 0 = (W1 + W2) x and output 1 = (W0 + W1) x with
    W_k = conv3d.weight[:, :, k]. The conv3d itself is run, not the summed kernels: in bf16 a kernel sum rounded to
    bf16 moves the decoded frames by several bf16 steps off the official ones."""

    def __init__(self, n: int, stride: int):
        super().__init__()
        self.stride = stride
        if stride == 1:
            self.proj = nn.Conv2d(n, n, 1, bias=False)
        else:
            self.conv3d = nn.Conv3d(n, n, kernel_size=(3, 1, 1), padding=(1, 0, 0), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, C, H, W) -> (T * stride, C, H, W), each frame's outputs consecutive."""
        if self.stride == 1:
            return self.proj(x)
        T, C, H, W = x.shape
        y = self.conv3d(x[:, :, None].expand(T, C, 2, H, W))  # (T, C, 2, H, W) the frame, twice, in time
        return y.transpose(1, 2).reshape(T * 2, C, H, W)  # (2T, C, H, W)


class Clamp(nn.Module):
    """Soft clamp of the latents to (-3, 3) before decoding: 3 tanh(x / 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


def _run(seq: nn.Sequential, x: torch.Tensor, state: State | None, prefix: str) -> tuple[torch.Tensor, State]:
    """Run a Sequential of streaming blocks on consecutive frames x (T, C, H, W), each MemBlock with its past frame
    from `state` (key f"{prefix}{i}", zeros when absent: the stream's start). -> output and the new state."""
    new: State = {}
    for i, block in enumerate(seq):
        if isinstance(block, MemBlock):
            key = f"{prefix}{i}"
            past = state.get(key) if state else None
            if past is None:
                past = x.new_zeros(1, *x.shape[1:])  # (1, C, H, W) the official zero padding of the first frame
            x, new[key] = block(x, past)
        else:
            x = block(x)
    return x, new


class ReAE(nn.Module):
    """Encoder and decoder as the release's Sequentials (keys encoder.N.*, decoder.N.*)."""

    def __init__(self, p: ReAEParams):
        super().__init__()
        self.params = p
        e, (d0, d1, d2, d3) = p.enc_dim, p.dec_dims
        pix = p.image_channels * p.patch ** 2

        def conv(n_in: int, n_out: int, **kw) -> nn.Conv2d:
            return nn.Conv2d(n_in, n_out, 3, padding=1, **kw)

        def enc_stage(stride: int) -> list[nn.Module]:
            return [TPool(e, stride), conv(e, e, stride=2, bias=False), MemBlock(e), MemBlock(e), MemBlock(e)]

        self.encoder = nn.Sequential(conv(pix, e), nn.ReLU(), *enc_stage(2), *enc_stage(2), *enc_stage(1),
                                     conv(e, p.latent_channels))

        def dec_stage(n: int, n_next: int, t_stride: int) -> list[nn.Module]:
            return [MemBlock(n), MemBlock(n), MemBlock(n), nn.Upsample(scale_factor=2), TGrow(n, t_stride),
                    conv(n, n_next, bias=False)]

        self.decoder = nn.Sequential(Clamp(), conv(p.latent_channels, d0), nn.ReLU(), *dec_stage(d0, d1, 1),
                                     *dec_stage(d1, d2, 2), *dec_stage(d2, d3, 2), nn.ReLU(), conv(d3, pix))

    def encode(self, frames: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        """frames (T, 3, H, W) in [0, 1], T a multiple of 4, H and W of 16 -> latents (T / 4, C_lat, H/16, W/16)
        and the encoder state after them (keys enc.N)."""
        x = F.pixel_unshuffle(frames, self.params.patch)  # (T, 12, H/2, W/2)
        return _run(self.encoder, x, state, "enc.")

    def decode(self, latents: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        """latents (L, C_lat, h, w) -> frames (4L, 3, 16h, 16w) clamped to [0, 1] and the decoder state (keys
        dec.N). The stream's first decode starts with 3 frames of causal padding to drop (`params.trim_frames`)."""
        x, new = _run(self.decoder, latents, state, "dec.")  # (4L, 12, 8h, 8w)
        return F.pixel_shuffle(x.clamp(0, 1), self.params.patch), new  # (4L, 3, 16h, 16w)
