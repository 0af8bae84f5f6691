"""The Wan2.1 VAE (the one Wan2.2-S2V uses): a causal 3-D convolutional autoencoder, stride 4 in time, 8 in space.

Our own implementation, key-for-key compatible with the released `Wan2.1_VAE.pth` (the module tree below spells
the release's keys: `encoder.downsamples.5.time_conv.weight`, `decoder.middle.1.to_qkv.weight`, ...) and
numerically equal to the official `WanVAE_` (wan/modules/vae2_1.py; tests/test_wan_vae.py checks it at the tiny
size).

Time is causal everywhere: every temporal convolution pads on the left only, so frame t depends on frames <= t.
The official code encodes 1 + 4 + 4 + ... frames and decodes one latent per call, carrying the last CACHE_T = 2
input frames of every temporal convolution from call to call (the "feature cache"). We keep that cache in an
explicit object, `WanVAECache`, so a renderer can decode a timeline chunk after chunk and save the cache in a
resume checkpoint; decoding in any chunking gives bit-for-bit the same frames as one whole decode.

Two first-call rules of the official code shape the output length:
- encoder `downsample3d`: the first call skips the temporal convolution, so frame 0 becomes latent 0 on its own;
- decoder `upsample3d`: the first call skips the temporal convolution (the official cache marks the slot 'Rep'),
  so latent 0 decodes to 1 frame; every later latent decodes to 4.
The official second call then runs the temporal convolution with zero history and stores [zeros, x] as the
cache. That is exactly a cache of zeros, which is how we store it (so every slot is a tensor after one call).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Frames of history each temporal convolution keeps between calls (kernel 3 needs 2).
CACHE_T = 2

# Per-channel statistics of the encoder's mu over the training data (official wan/modules/vae2_1.py:629-636).
LATENT_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
LATENT_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)


@dataclass(frozen=True)
class WanVAEParams:
    dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    # Resolution scales (1.0 = full, 0.5 = half, ...) that get an attention block after each residual block.
    attn_scales: tuple[float, ...] = ()
    # Per encoder level (the decoder uses it reversed): whether the level's downsample also halves time.
    # The release's spelling ("temperal") is kept so configs read like the official code.
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    latent_mean: tuple[float, ...] = LATENT_MEAN
    latent_std: tuple[float, ...] = LATENT_STD

    def __post_init__(self):
        if len(self.latent_mean) != self.z_dim or len(self.latent_std) != self.z_dim:
            raise ValueError(f"latent_mean/latent_std need z_dim={self.z_dim} values each")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError("temperal_downsample needs one entry per downsample (len(dim_mult) - 1)")

    @classmethod
    def full(cls) -> "WanVAEParams":
        """The released Wan2.1 VAE (the checkpoint has no config file; official `_video_vae` hard-codes this)."""
        return cls()

    @classmethod
    def tiny(cls) -> "WanVAEParams":
        """The same architecture at dim 8, for tests (the goldens ran the official `WanVAE_` at this size)."""
        return cls(dim=8)

    @property
    def time_stride(self) -> int:
        return 2 ** sum(self.temperal_downsample)

    @property
    def space_stride(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)


@dataclass
class WanVAECache:
    """The decoder's causal feature cache for one timeline, after `latents` latents have been decoded.

    `slots` holds, per temporal convolution in call order, its last CACHE_T input frames (B, C, <=CACHE_T, h, w)
    at that layer's resolution. `decode_stream` never modifies a cache it is given: it returns a new one.

    Size at full size for one 480x832 stream (latent 60x104), from the slot shapes: 32 slots, 944,286,720
    values = 3.52 GiB in float32 (1.76 GiB bf16); 57% of it is the 7 slots at full resolution, 96 channels.
    After latent 0 alone it is half that (1 frame per slot).
    """

    slots: list[torch.Tensor]
    latents: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """The cache as named tensors (e.g. for safetensors); `from_tensors` rebuilds it."""
        out = {f"slot.{i:03d}": t for i, t in enumerate(self.slots)}
        out["latents"] = torch.tensor(self.latents, dtype=torch.int64)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "WanVAECache":
        names = sorted(k for k in tensors if k.startswith("slot."))
        if "latents" not in tensors or [f"slot.{i:03d}" for i in range(len(names))] != names:
            raise ValueError("not a Wan VAE decoder cache: expected 'latents' and slot.000, slot.001, ...")
        return cls([tensors[k] for k in names], int(tensors["latents"]))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)

    def to(self, *args, **kwargs) -> "WanVAECache":
        """Like Tensor.to (device and/or dtype), for every slot."""
        return WanVAECache([t.to(*args, **kwargs) for t in self.slots], self.latents)


class _Walk:
    """Hands each temporal convolution its slot of the previous call's cache, in call order, and collects the new
    cache. The model's call order is fixed, so the i-th request is always the same layer."""

    def __init__(self, old: list[torch.Tensor] | None):
        self.old = old
        self.new: list[torch.Tensor] = []

    def prev(self) -> torch.Tensor | None:
        return None if self.old is None else self.old[len(self.new)]

    def put(self, t: torch.Tensor) -> None:
        self.new.append(t)


def _tail(x: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """The last CACHE_T frames of the timeline [prev, x] (fewer only while the timeline is shorter)."""
    t = x.shape[2]
    if t >= CACHE_T or prev is None:
        return x[:, :, -CACHE_T:].clone()  # (B, C, <=2, h, w); a copy, so x itself can be freed
    return torch.cat([prev[:, :, t - CACHE_T:], x], dim=2)  # (B, C, 2, h, w)


def _onednn_conv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether CausalConv3d may call oneDNN directly: a CPU inference with a plain weight (not a DTensor or an
    offloader's stand-in) in a dtype oneDNN computes here."""
    if (x.device.type != "cpu" or torch.is_grad_enabled() or type(w) is not nn.Parameter
            or not torch.backends.mkldnn.is_available()):
        return False
    return x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class CausalConv3d(nn.Conv3d):
    """A Conv3d that pads time on the left only (2*p frames, or fewer when cached frames stand in for them), so
    output frame t sees input frames <= t. Spatial padding stays symmetric. The padding is applied explicitly,
    so the parent convolution runs unpadded."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__(cin, cout, kernel, stride=stride, padding=0)
        p = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        self.time_pad = 2 * p[0]
        self.space_pad = (p[2], p[2], p[1], p[1])  # F.pad order: W left/right, H top/bottom

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        time_pad = self.time_pad
        if prev is not None and time_pad > 0:
            x = torch.cat([prev, x], dim=2)  # (B, C, k + T, H, W): real history instead of zeros
            time_pad -= prev.shape[2]
        x = F.pad(x, (*self.space_pad, time_pad, 0))  # (B, C, 2p + T, H + 2p, W + 2p)
        if _onednn_conv(x, self.weight):
            # torch sends a batch-1 input with few channels x frames x rows (< 20480) to its unblocked
            # slow_conv3d; oneDNN was faster on every such shape measured, latent 0 at 480x832 included
            # (bench/wan_vae_cpu.py; figures in bench/results.md), and agrees to 2e-4.
            return torch.mkldnn_convolution(x, self.weight, self.bias, [0, 0, 0], self.stride, self.dilation,
                                            self.groups)  # (B, Cout, T', H', W')
        return super().forward(x)  # (B, Cout, T', H', W')

    def cached(self, x: torch.Tensor, walk: _Walk) -> torch.Tensor:
        """Convolve x continuing the timeline of earlier calls, and record x's tail for the next call."""
        prev = walk.prev()
        out = self(x, prev)  # (B, Cout, T, H, W)
        walk.put(_tail(x, prev))
        return out


class RMSNorm(nn.Module):
    """L2-normalise over channels, times sqrt(C) and a learned per-channel gain (the release's RMS_norm)."""

    def __init__(self, dim: int, images: bool = False):
        super().__init__()
        # images: applied to (N, C, H, W) rather than (B, C, T, H, W); only the gain's shape differs.
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1) if images else torch.ones(dim, 1, 1, 1))
        self.scale = dim ** 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # F.normalize's strided vector_norm over dim 1 is slower on a CPU than this sum of squares (the same
            # value to 1 ulp; bench/wan_vae_cpu.py, figures in bench/results.md). On a GPU the full-size square would cost memory: kept.
            norm = (x * x).sum(dim=1, keepdim=True).sqrt_().clamp_min_(1e-12)  # (B, 1, ...): F.normalize's eps
            return x / norm * self.scale * self.gamma  # same shape as x
        return F.normalize(x, dim=1) * self.scale * self.gamma  # same shape as x


class NearestUp2x(nn.Module):
    """Nearest-exact 2x spatial upsampling, done in float32 (nearest interpolation lacks bf16 on some backends;
    the copy is exact either way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)  # (N, C, 2H, 2W)


def _per_frame(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply a 2-D module to every frame: (B, C, T, H, W) -> (B*T, C, H, W) -> fn -> (B, C', T, H', W')."""
    b, _, t = x.shape[:3]
    y = fn(x.transpose(1, 2).flatten(0, 1))  # (B*T, C', H', W')
    return y.unflatten(0, (b, t)).transpose(1, 2)  # (B, C', T, H', W')


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        # Index layout of the release (residual.0 / .2 / .3 / .6 hold weights); index 5 was Dropout(0.0).
        self.residual = nn.Sequential(
            RMSNorm(cin), nn.SiLU(), CausalConv3d(cin, cout, 3, padding=1),
            RMSNorm(cout), nn.SiLU(), nn.Identity(), CausalConv3d(cout, cout, 3, padding=1))
        self.shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, walk: _Walk) -> torch.Tensor:
        norm1, act1, conv1, norm2, act2, _, conv2 = self.residual
        h = conv1.cached(act1(norm1(x)), walk)  # (B, Cout, T, H, W)
        h = conv2.cached(act2(norm2(h)), walk)  # (B, Cout, T, H, W)
        return h + self.shortcut(x)  # (B, Cout, T, H, W)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame separately (no attention across time)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def _frame(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x))  # (N, 3C, H, W)
        qkv = qkv.reshape(n, 1, c * 3, h * w).permute(0, 1, 3, 2).contiguous()  # (N, 1, HW, 3C)
        q, k, v = qkv.chunk(3, dim=-1)  # (N, 1, HW, C) each
        y = F.scaled_dot_product_attention(q, k, v)  # (N, 1, HW, C)
        y = y.squeeze(1).permute(0, 2, 1).reshape(n, c, h, w)  # (N, C, H, W)
        return self.proj(y)  # (N, C, H, W)

    def forward(self, x: torch.Tensor, walk: _Walk | None = None) -> torch.Tensor:
        # Attention first: the sum then keeps the official memory layout (frame-major), so the next norm's
        # reductions round exactly as the official code's do.
        return _per_frame(self._frame, x) + x  # (B, C, T, H, W)


class Resample(nn.Module):
    """2x spatial down/upsampling per frame; the '3d' modes also halve/double time with a causal `time_conv`."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):
            # Channels halve on the way up (dim -> dim // 2); the next level's first block takes dim // 2.
            self.resample = nn.Sequential(NearestUp2x(), nn.Conv2d(dim, dim // 2, 3, padding=1))
            if mode == "upsample3d":
                # Emits two output frames per input frame, as the two halves of its channels.
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode.startswith("downsample"):
            # Pad right/bottom by one so a 3x3 stride-2 conv halves even sizes exactly.
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
            if mode == "downsample3d":
                # Stride 2 over [last frame of the previous call, this call's frames]: 4 frames -> 2.
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))
        else:
            raise ValueError(f"unknown resample mode {mode!r}")

    def _upsample_time(self, x: torch.Tensor, walk: _Walk) -> torch.Tensor:
        prev = walk.prev()
        if prev is None:
            # First call of a timeline: no temporal upsampling (latent 0 -> 1 frame). The official code marks the
            # slot 'Rep'; its next call convolves with zero history and caches [zeros, x]: a zero cache here.
            walk.put(torch.zeros_like(x[:, :, -1:]))  # (B, C, 1, H, W)
            return x
        b, c, t, h, w = x.shape
        y = self.time_conv(x, prev)  # (B, 2C, T, H, W)
        walk.put(_tail(x, prev))
        # Channel half 0 is frame 2i, half 1 is frame 2i+1.
        y = y.reshape(b, 2, c, t, h, w)  # (B, 2, C, T, H, W)
        y = torch.stack((y[:, 0], y[:, 1]), dim=3)  # (B, C, T, 2, H, W)
        return y.reshape(b, c, t * 2, h, w)  # (B, C, 2T, H, W)

    def _downsample_time(self, x: torch.Tensor, walk: _Walk) -> torch.Tensor:
        prev = walk.prev()
        walk.put(x[:, :, -1:].clone())  # (B, C, 1, H, W): only the last frame is ever read back
        if prev is None:
            # First call of a timeline: no temporal downsampling (frame 0 -> latent 0 on its own).
            return x
        return self.time_conv(torch.cat([prev[:, :, -1:], x], dim=2))  # (B, C, T/2, H, W)

    def forward(self, x: torch.Tensor, walk: _Walk) -> torch.Tensor:
        if self.mode == "upsample3d":
            x = self._upsample_time(x, walk)  # (B, C, 2T or 1, H, W)
        x = _per_frame(self.resample, x)  # (B, C', T, 2H or H/2, 2W or W/2)
        if self.mode == "downsample3d":
            x = self._downsample_time(x, walk)  # (B, C, T/2 or 1, H, W)
        return x


def _run(layers: nn.Sequential, x: torch.Tensor, walk: _Walk) -> torch.Tensor:
    for layer in layers:
        x = layer(x, walk)  # (B, C, T, H, W)
    return x


class Encoder3d(nn.Module):
    def __init__(self, p: WanVAEParams):
        super().__init__()
        dims = [p.dim * m for m in (1, *p.dim_mult)]
        self.conv1 = CausalConv3d(3, dims[0], 3, padding=1)
        layers, scale = [], 1.0
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(p.num_res_blocks):
                layers.append(ResidualBlock(cin, cout))
                if scale in p.attn_scales:
                    layers.append(AttentionBlock(cout))
                cin = cout
            if i != len(p.dim_mult) - 1:
                layers.append(Resample(cout, "downsample3d" if p.temperal_downsample[i] else "downsample2d"))
                scale /= 2.0
        self.downsamples = nn.Sequential(*layers)
        self.middle = nn.Sequential(ResidualBlock(dims[-1], dims[-1]), AttentionBlock(dims[-1]),
                                    ResidualBlock(dims[-1], dims[-1]))
        # Outputs mu and logvar (2 * z_dim channels).
        self.head = nn.Sequential(RMSNorm(dims[-1]), nn.SiLU(), CausalConv3d(dims[-1], p.z_dim * 2, 3, padding=1))

    def forward(self, x: torch.Tensor, walk: _Walk) -> torch.Tensor:
        x = self.conv1.cached(x, walk)  # (B, dim, T, H, W)
        x = _run(self.downsamples, x, walk)  # (B, 4*dim, T', H/8, W/8)
        x = _run(self.middle, x, walk)  # (B, 4*dim, T', H/8, W/8)
        norm, act, conv = self.head
        return conv.cached(act(norm(x)), walk)  # (B, 2*z_dim, T', H/8, W/8)


class Decoder3d(nn.Module):
    def __init__(self, p: WanVAEParams):
        super().__init__()
        dims = [p.dim * m for m in (p.dim_mult[-1], *p.dim_mult[::-1])]
        temperal_upsample = p.temperal_downsample[::-1]
        self.conv1 = CausalConv3d(p.z_dim, dims[0], 3, padding=1)
        self.middle = nn.Sequential(ResidualBlock(dims[0], dims[0]), AttentionBlock(dims[0]),
                                    ResidualBlock(dims[0], dims[0]))
        layers, scale = [], 1.0 / 2 ** (len(p.dim_mult) - 2)
        cin = dims[0]
        for i, cout in enumerate(dims[1:]):
            for _ in range(p.num_res_blocks + 1):
                layers.append(ResidualBlock(cin, cout))
                if scale in p.attn_scales:
                    layers.append(AttentionBlock(cout))
                cin = cout
            if i != len(p.dim_mult) - 1:
                layers.append(Resample(cout, "upsample3d" if temperal_upsample[i] else "upsample2d"))
                cin = cout // 2  # the resample's conv halves the channels
                scale *= 2.0
        self.upsamples = nn.Sequential(*layers)
        self.head = nn.Sequential(RMSNorm(dims[-1]), nn.SiLU(), CausalConv3d(dims[-1], 3, 3, padding=1))
        # Cache slots per call: conv1, two per residual block, one per upsample3d, the head.
        self.n_slots = (2 + 2 * sum(isinstance(m, ResidualBlock) for m in self.modules())
                        + sum(isinstance(m, Resample) and m.mode == "upsample3d" for m in self.modules()))

    def forward(self, x: torch.Tensor, walk: _Walk) -> torch.Tensor:
        x = self.conv1.cached(x, walk)  # (B, 4*dim, t, h, w)
        x = _run(self.middle, x, walk)  # (B, 4*dim, t, h, w)
        x = _run(self.upsamples, x, walk)  # (B, dim, t', 8h, 8w)
        norm, act, conv = self.head
        return conv.cached(act(norm(x)), walk)  # (B, 3, t', 8h, 8w)


class WanVAE(nn.Module):
    """encode: video (B, 3, 1+4k, H, W) in [-1, 1] -> normalised latent (B, 16, 1+k, H/8, W/8).
    decode / decode_stream: normalised latent -> video, latent 0 -> 1 frame, every later latent -> 4 frames.

    Inputs are cast to the weights' dtype; the latent normalisation runs in float32 and both directions return
    float32, like the official wrapper (which keeps the whole VAE in float32)."""

    def __init__(self, p: WanVAEParams):
        super().__init__()
        self.params = p
        self.encoder = Encoder3d(p)
        self.conv1 = CausalConv3d(p.z_dim * 2, p.z_dim * 2, 1)  # on (mu, logvar) after the encoder
        self.conv2 = CausalConv3d(p.z_dim, p.z_dim, 1)  # on the latent before the decoder
        self.decoder = Decoder3d(p)

    def _stats(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, 1/std), float32, shaped (1, z_dim, 1, 1, 1). The official wrapper multiplies by 1/std on encode
        and divides by it on decode; we do the same so the roundings match."""
        mean = torch.tensor(self.params.latent_mean, dtype=torch.float32, device=device)  # (z,)
        inv_std = 1.0 / torch.tensor(self.params.latent_std, dtype=torch.float32, device=device)  # (z,)
        return mean.view(1, -1, 1, 1, 1), inv_std.view(1, -1, 1, 1, 1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, 3, T, H, W) in [-1, 1], T = 1 + 4k, H and W multiples of 8 -> mu (B, z, 1+k, H/8, W/8), float32.

        Only the posterior mean is returned (the official pipeline never samples)."""
        p = self.params
        if x.dim() != 5 or x.shape[1] != 3:
            raise ValueError(f"Wan VAE encode expects video (B, 3, T, H, W), got shape {tuple(x.shape)}")
        t, h, w = x.shape[2:]
        if t < 1 or (t - 1) % p.time_stride:
            raise ValueError(f"Wan VAE encode needs T = 1 + {p.time_stride}k frames, got T={t}")
        if h % p.space_stride or w % p.space_stride:
            raise ValueError(f"Wan VAE encode needs H and W divisible by {p.space_stride}, got {h}x{w}")
        x = x.to(self.conv1.weight.dtype)
        # One timeline: frame 0 alone, then groups of time_stride frames, one latent each (official chunking).
        walk, outs = _Walk(None), []
        bounds = [0, 1, *range(1 + p.time_stride, t + 1, p.time_stride)]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            outs.append(self.encoder(x[:, :, start:stop], walk))  # (B, 2z, 1, h, w)
            walk = _Walk(walk.new)
        mu, _logvar = self.conv1(torch.cat(outs, dim=2)).chunk(2, dim=1)  # (B, z, 1+k, h, w) each
        mean, inv_std = self._stats(mu.device)
        return (mu.float() - mean) * inv_std  # (B, z, 1+k, h, w)

    def decode_stream(self, z: torch.Tensor, cache: WanVAECache | None = None,
                      clamp: bool = True) -> tuple[torch.Tensor, WanVAECache]:
        """Continue a timeline: z (B, z_dim, n, h, w) normalised latents following those already decoded into
        `cache` (None starts a timeline) -> (frames (B, 3, T, 8h, 8w) float32, the cache after them), where
        T = 4n, or 4n - 3 when the timeline starts here. Frames are clamped to [-1, 1] unless clamp=False.

        Decodes one latent at a time (as the official decode does), so any chunking of a timeline gives
        bit-for-bit the same frames. The given cache is not modified."""
        p = self.params
        if z.dim() != 5 or z.shape[1] != p.z_dim or z.shape[2] < 1:
            raise ValueError(f"Wan VAE decode expects latents (B, {p.z_dim}, n>=1, h, w), got {tuple(z.shape)}")
        if cache is not None:
            if len(cache.slots) != self.decoder.n_slots:
                raise ValueError(f"cache has {len(cache.slots)} slots, this decoder uses {self.decoder.n_slots}")
            first = cache.slots[0]  # decoder.conv1's input tail: (B, z, k, h, w)
            if first.shape[0] != z.shape[0] or first.shape[-2:] != z.shape[-2:]:
                raise ValueError(f"latents {tuple(z.shape)} do not continue a cache of batch {first.shape[0]} "
                                 f"and size {tuple(first.shape[-2:])}")
        mean, inv_std = self._stats(z.device)
        dtype = self.conv2.weight.dtype
        slots = None if cache is None else cache.slots
        latents = 0 if cache is None else cache.latents
        frames = []
        for i in range(z.shape[2]):
            zi = (z[:, :, i:i + 1].float() / inv_std + mean).to(dtype)  # (B, z, 1, h, w): de-normalised
            walk = _Walk(slots)
            frames.append(self.decoder(self.conv2(zi), walk))  # (B, 3, 1 or 4, 8h, 8w)
            slots, latents = walk.new, latents + 1
        out = torch.cat(frames, dim=2).float()  # (B, 3, T, 8h, 8w)
        if clamp:
            out = out.clamp(-1.0, 1.0)
        return out, WanVAECache(slots, latents)

    def decode(self, z: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """Whole-sequence decode from a fresh timeline (the official decode): z (B, z_dim, n, h, w) ->
        frames (B, 3, 1 + 4(n-1), 8h, 8w), float32, clamped to [-1, 1] unless clamp=False."""
        return self.decode_stream(z, None, clamp=clamp)[0]
