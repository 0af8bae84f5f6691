"""The Wan2.2-S2V DiT (official `WanModel_S2V`), key-for-key compatible with the released checkpoint.

One forward denoises one clip. The token sequence is [noisy (F·h/2·w/2) | reference (h/2·w/2) | motion (FramePack,
absent on clip 0)]. Noisy tokens are modulated by the current timestep, reference and motion tokens by t = 0; a learned
token-type embedding tells the three apart. Every block is full self-attention over the whole sequence (3-axis RoPE
with fixed positions for reference and motion), unmasked cross-attention to the zero-padded text, and an FFN. After
the listed blocks an audio injector adds, to each latent frame's noisy tokens, cross-attention to that frame's own
audio tokens, after an AdaIN driven by the frame's global audio token. The head maps the noisy tokens to the flow
prediction (velocity, noise - x0) in float32.

Sequence parallelism (`parallel.SequenceParallelWanDiT` wraps this model; `forward(..., shard=TokenShard(...))` computes
one rank's contiguous rows [start, start + length) of the sequence, padded with zero tokens past its end):
- Self-attention is the only op that mixes tokens across the sequence: the wrapper swaps each block's
  `self_attn.attn_op` for an all-to-all op (`WanS2VDiT.set_attn_op`). Cross-attention, the FFN and the modulation
  are per token.
- Modulation is chosen per segment: tokens before `seg` (the noisy ones) use the current timestep, the rest t = 0. A
  shard passes seg - start to each block, which clamps it to [0, end - start].
- RoPE is per token: `s2v_positions(...)[start:end]` through `rope_freqs` gives a shard its own table.
- The audio injection is per token too once the token's latent frame is known (AdaIN normalises each token; the
  frame picks its scale, shift and the audio keys), so a shard injects its own noisy tokens, cut at latent-frame
  boundaries into a partial first frame, whole frames and a partial last frame (`inject`). The official code
  all-gathers the full sequence around each injector instead.
- The head reads only the noisy tokens, which come first: a shard returns the head output of the noisy tokens it
  holds, and the wrapper gathers them. (Official SP splits with torch.chunk, no padding: N must divide evenly.)
"""

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from avatar_cli.families.wan_s2v.layers import (
    AttentionOp,
    AudioAdaLN,
    CausalAudioEncoder,
    CrossAttention,
    FP32LayerNorm,
    FramePack,
    SelfAttention,
    as_weight_dtype,
    linear_f32,
    rope_freqs,
    sequential_f32,
    sinusoidal_embedding,
)

REF_T_POSITION = 30  # the official code places the reference latent at RoPE time 30


@dataclass(frozen=True)
class WanDiTParams:
    """Every architecture field of the checkpoint's config.json (build it with `from_config`, never from defaults)."""

    patch_size: tuple[int, int, int]
    in_dim: int
    out_dim: int
    dim: int
    ffn_dim: int
    freq_dim: int
    num_heads: int
    num_layers: int
    text_dim: int
    text_len: int
    window_size: tuple[int, int]
    qk_norm: bool
    cross_attn_norm: bool
    eps: float
    audio_dim: int
    num_audio_token: int
    cond_dim: int
    audio_inject_layers: tuple[int, ...]
    enable_adain: bool
    adain_mode: str
    enable_framepack: bool
    framepack_drop_mode: str
    zero_timestep: bool
    add_last_motion: bool
    motion_frames: int  # pixel frames of motion history; the pipeline passes [motion_frames, lat_motion_frames]

    def __post_init__(self):
        def bad(field: str, why: str):
            raise ValueError(f"WanDiTParams.{field}={getattr(self, field)!r}: {why}")

        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            bad("num_heads", f"dim {self.dim} must split into heads of an even size")
        if tuple(self.window_size) != (-1, -1):
            bad("window_size", "only full attention (-1, -1) is implemented, as the release uses")
        if not (self.enable_adain and self.adain_mode == "attn_norm"):
            bad("adain_mode" if self.enable_adain else "enable_adain",
                "only the release's AdaIN injectors (enable_adain=True, adain_mode='attn_norm') are implemented")
        if not self.enable_framepack:
            bad("enable_framepack", "only FramePack motion tokens are implemented (the release has it on)")
        if self.framepack_drop_mode not in ("padd", "drop"):
            bad("framepack_drop_mode", "must be 'padd' or 'drop'")
        if not self.zero_timestep:
            bad("zero_timestep", "the official forward cannot run without it (it calls .item() on an int)")
        if self.cond_dim <= 0:
            bad("cond_dim", "the forward always applies cond_encoder (pose latents), so it must exist")
        layers = self.audio_inject_layers
        if len(set(layers)) != len(layers) or any(not 0 <= i < self.num_layers for i in layers):
            bad("audio_inject_layers", f"must be distinct block indices below num_layers={self.num_layers}")
        # The official code maps injectors to blocks with a substring test ('transformer_blocks.1' also matches
        # block 10); refuse a layout where that differs from the plain mapping implemented here.
        for i in layers:
            if any(j != i and str(j).startswith(str(i)) for j in range(self.num_layers)):
                bad("audio_inject_layers", f"block {i} would also match other blocks in the official injector mapping")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def lat_motion_frames(self) -> int:
        return (self.motion_frames + 3) // 4

    @property
    def add_last_motion_level(self) -> int:
        """The official forward multiplies the config flag by its add_last_motion argument, 2 in the pipeline."""
        return 2 if self.add_last_motion else 0

    @classmethod
    def from_config(cls, d: dict) -> "WanDiTParams":
        """Build from a parsed config.json. Architecture fields come from the file; a missing one or an unknown key
        is a ValueError naming it; keys starting with '_' (diffusers metadata) and known non-architecture keys are
        ignored.

        Exception, matching the official loader exactly: the official class lists patch_size, text_dim, window_size,
        qk_norm and cross_attn_norm in `ignore_for_config`, so diffusers never writes them to config.json nor reads
        them from it, and always uses the class's own values; they are taken from the file when present and are
        otherwise those values. Likewise motion_frames is a pipeline setting (wan/configs/wan_s2v_14B.py) that the
        official pipeline passes at forward time; it is read when present, otherwise the pipeline's 73."""
        known_ignored = {"zero_init", "enable_tsm", "trainable_token_pos_emb", "motion_token_num", "trainable_token"}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in names | known_ignored
                         | {"model_type", "enable_motioner"})
        if unknown:
            raise ValueError(f"WanDiT config.json: unknown key(s) {', '.join(unknown)}")
        if d.get("model_type", "s2v") != "s2v":
            raise ValueError(f"WanDiT config.json: model_type={d['model_type']!r}, expected 's2v'")
        if "enable_motioner" not in d:
            raise ValueError("WanDiT config.json: missing field enable_motioner (the official default True builds "
                             "the transformer motioner, which this model does not implement)")
        if d["enable_motioner"] is not False:
            raise ValueError(f"WanDiT config.json: enable_motioner={d['enable_motioner']!r}: only FramePack is "
                             "implemented (the release has enable_motioner=false)")
        values = {**_OFFICIAL_UNSERIALISED, **{k: v for k, v in d.items() if k in names}}
        for f in dataclasses.fields(cls):
            if f.name not in values:
                raise ValueError(f"WanDiT config.json: missing field {f.name}")
            values[f.name] = _coerce(f.name, values[f.name], f.type)
        return cls(**values)

    @classmethod
    def tiny(cls) -> "WanDiTParams":
        """The tiny test size (the official `WanModel_S2V` at this size makes the goldens)."""
        return cls(patch_size=(1, 2, 2), in_dim=16, out_dim=16, dim=64, ffn_dim=128, freq_dim=32, num_heads=2,
                   num_layers=3, text_dim=32, text_len=16, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True,
                   eps=1e-6, audio_dim=32, num_audio_token=4, cond_dim=16, audio_inject_layers=(0, 2),
                   enable_adain=True, adain_mode="attn_norm", enable_framepack=True, framepack_drop_mode="padd",
                   zero_timestep=True, add_last_motion=True, motion_frames=73)

    @classmethod
    def full(cls) -> "WanDiTParams":
        """The released Wan2.2-S2V-14B (16,295,755,609 parameters)."""
        return cls(patch_size=(1, 2, 2), in_dim=16, out_dim=16, dim=5120, ffn_dim=13824, freq_dim=256, num_heads=40,
                   num_layers=40, text_dim=4096, text_len=512, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True,
                   eps=1e-6, audio_dim=1024, num_audio_token=4, cond_dim=16,
                   audio_inject_layers=(0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39), enable_adain=True,
                   adain_mode="attn_norm", enable_framepack=True, framepack_drop_mode="padd", zero_timestep=True,
                   add_last_motion=True, motion_frames=73)


# What the official loader uses for the fields it never reads from config.json (see from_config).
_OFFICIAL_UNSERIALISED = {"patch_size": (1, 2, 2), "text_dim": 4096, "window_size": (-1, -1), "qk_norm": True,
                          "cross_attn_norm": True, "motion_frames": 73}


def _coerce(name: str, v, typ):
    """JSON value -> the dataclass field's type, refusing anything else by name."""
    def fail():
        raise ValueError(f"WanDiT config.json: field {name}={v!r} is not a valid {typ}")

    if typ is bool:
        if not isinstance(v, bool):
            fail()
        return v
    if typ is int:
        if isinstance(v, bool) or not isinstance(v, int):
            fail()
        return v
    if typ is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            fail()
        return float(v)
    if typ is str:
        if not isinstance(v, str):
            fail()
        return v
    # tuples of ints, of a fixed length unless declared tuple[int, ...]
    args = typing.get_args(typ)
    if not isinstance(v, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in v):
        fail()
    if Ellipsis not in args and len(v) != len(args):
        fail()
    return tuple(v)


def _linspace_int(start: int, stop: int, num: int) -> list[int]:
    """np.linspace(start, stop, num).astype(int), with numpy's exact float64 steps (the official positions)."""
    if num == 1:
        return [start]
    step = (stop - start) / (num - 1)
    vals = [int(i * step + start) for i in range(num)]
    vals[-1] = stop
    return vals


def _grid(ts: list[int], hs: list[int], ws: list[int]) -> torch.Tensor:
    """(t, h, w) positions of a t-major, then h, then w token block. -> (len(ts)*len(hs)*len(ws), 3) int64."""
    t, h, w = torch.meshgrid(torch.tensor(ts), torch.tensor(hs), torch.tensor(ws), indexing="ij")
    return torch.stack([t.flatten(), h.flatten(), w.flatten()], dim=1).long()


def s2v_positions(p: WanDiTParams, frames: int, lat_h: int, lat_w: int, with_motion: bool) -> torch.Tensor:
    """RoPE (t, h, w) positions of every token, in sequence order. A pure function: a sequence-parallel rank
    slices rows [start, end). -> (N, 3) int64.

    noisy: t 0..F-1 and the dense patch grid; reference: t 30, dense; motion (FramePack): post t -1 dense, 2x t -3
    and 4x t -19, -14, -9, -4, each on a sparse spread over the full-resolution grid (h positions
    linspace(0, h/2 - 1, h/4) and linspace(0, h/2 - 1, h/8) truncated)."""
    pt, ph, pw = p.patch_size
    F_, H, W = frames // pt, lat_h // ph, lat_w // pw
    parts = [_grid(list(range(F_)), list(range(H)), list(range(W))),
             _grid([REF_T_POSITION], list(range(H)), list(range(W)))]
    if with_motion:
        full_h, full_w = lat_h // 2, lat_w // 2  # FramePack's finest kernel is 1x2x2 whatever the DiT patch size
        kept = FramePack.kept_buckets(p.add_last_motion_level, p.framepack_drop_mode)
        start = 0
        for n, spatial, use in zip(FramePack.BUCKETS, (2, 4, 8), kept):
            start += n  # this bucket covers latents -start .. -start + n - 1
            if not use:
                continue
            t_compress = spatial // 2  # 1, 2, 4 latents per token
            ts = [-v for v in _linspace_int(start, start - n + 1, n // t_compress)]
            hs = _linspace_int(0, full_h - 1, lat_h // spatial)
            ws = _linspace_int(0, full_w - 1, lat_w // spatial)
            parts.append(_grid(ts, hs, ws))
    return torch.cat(parts, dim=0)  # (N, 3)


def _modulate_segments(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, seg: int) -> torch.Tensor:
    """x (B, N, D) fp32; shift, scale (B, 2, D): slot 0 for tokens [0, seg), slot 1 for [seg, N). -> (B, N, D)."""
    return torch.cat([x[:, :seg] * (1 + scale[:, 0:1]) + shift[:, 0:1],
                      x[:, seg:] * (1 + scale[:, 1:2]) + shift[:, 1:2]], dim=1)  # (B, N, D)


def _gate_segments(y: torch.Tensor, gate: torch.Tensor, seg: int) -> torch.Tensor:
    """y (B, N, D); gate (B, 2, D) fp32, per segment as in _modulate_segments. -> (B, N, D) fp32."""
    return torch.cat([y[:, :seg] * gate[:, 0:1], y[:, seg:] * gate[:, 1:2]], dim=1)  # (B, N, D)


def _randn_over(shape: tuple[int, ...], divisor: float) -> torch.Tensor:
    """randn(shape) / divisor on the default device, the official init. On the meta device (every header check
    builds the DiT there) the division is skipped: it would run torch's Python reference ops, whose first use
    imports torch._dynamo (1.8 s)."""
    x = torch.randn(shape)
    return x if x.is_meta else x / divisor


class WanS2VBlock(nn.Module):
    """Self-attention, text cross-attention and FFN with 6-way modulation chosen per segment (official
    WanS2VAttentionBlock). The residual stream leaves in fp32 (the official modulation runs in fp32)."""

    def __init__(self, p: WanDiTParams):
        super().__init__()
        d = p.dim
        self.norm1 = FP32LayerNorm(d, eps=p.eps, elementwise_affine=False)
        self.self_attn = SelfAttention(d, p.num_heads, p.qk_norm, p.eps)
        self.norm3 = FP32LayerNorm(d, eps=p.eps, elementwise_affine=True) if p.cross_attn_norm else nn.Identity()
        self.cross_attn = CrossAttention(d, p.num_heads, p.qk_norm, p.eps)
        self.norm2 = FP32LayerNorm(d, eps=p.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(d, p.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(p.ffn_dim, d))
        self.modulation = nn.Parameter(_randn_over((1, 6, d), d**0.5))

    def forward(self, x: torch.Tensor, e0: torch.Tensor | None, seg: int, freqs: torch.Tensor | None,
                context: torch.Tensor, *, frame_e0: torch.Tensor | None = None, row_frames: torch.Tensor | None = None,
                attend: Callable[[torch.Tensor], torch.Tensor] | None = None,
                attention_only: bool = False) -> torch.Tensor:
        """x (B, N, D); e0 (B, 6, 2, D) fp32 (slot 0: current t, slot 1: t = 0); seg: first token of slot 1
        (clamped to [0, N]); freqs (N, Dh/2) complex128; context (B, L, D). -> (B, N, D).

        The streaming forward (causal.py) passes instead, by keyword (B = 1): frame_e0 (F, 6, D) fp32, the time
        modulation of each latent frame; row_frames (N,) int64, each row's frame (None: every row takes frame 0's);
        attend(h) -> the self-attention output (1, N, D) of the modulated rows h, which reads and writes its
        caches. e0, seg and freqs are then unused. attention_only: return after the self-attention's residual (the
        sink prefill's last layer needs only its keys and values)."""
        if attend is not None:
            return self._stream(x, frame_e0, row_frames, context, attend, attention_only)
        seg = min(max(0, seg), x.shape[1])
        e = (self.modulation.float().unsqueeze(2) + e0).chunk(6, dim=1)  # 6 x (B, 1, 2, D)
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = (c.squeeze(1) for c in e)  # (B, 2, D)
        h = _modulate_segments(self.norm1(x).float(), shift_msa, scale_msa, seg)  # (B, N, D)
        x = x + _gate_segments(self.self_attn(h, freqs), gate_msa, seg)  # (B, N, D)
        x = x + self.cross_attn(self.norm3(x), context)  # (B, N, D)
        h = _modulate_segments(self.norm2(x).float(), shift_ffn, scale_ffn, seg)  # (B, N, D)
        y = self.ffn(as_weight_dtype(h, self.ffn[0]))  # (B, N, D)
        return x + _gate_segments(y, gate_ffn, seg)  # (B, N, D)

    def _stream(self, x: torch.Tensor, frame_e0: torch.Tensor, row_frames: torch.Tensor | None, context: torch.Tensor,
                attend: Callable[[torch.Tensor], torch.Tensor], attention_only: bool) -> torch.Tensor:
        """The block with per-row modulation (forward's streaming arguments). x (1, n, D) -> (1, n, D) fp32."""
        mod = self.modulation.float()[0] + frame_e0  # (F, 6, D)
        mod = mod[0, :, None] if row_frames is None else mod[row_frames].transpose(0, 1)  # (6, 1 or n, D)
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = mod[:, None]  # (1, n, D) each
        x = x + attend(self.norm1(x).float() * (1 + scale_msa) + shift_msa) * gate_msa  # (1, n, D) fp32
        if attention_only:
            return x
        x = x + self.cross_attn(self.norm3(x), context)  # (1, n, D)
        h = self.norm2(x).float() * (1 + scale_ffn) + shift_ffn  # (1, n, D)
        return x + self.ffn(as_weight_dtype(h, self.ffn[0])) * gate_ffn  # (1, n, D)


class AudioInjector(nn.Module):
    """Per-frame audio cross-attention added (ungated) to the noisy tokens after the listed blocks (official
    AudioInjector_WAN in 'attn_norm' AdaIN mode). Keys injector.i.* and injector_adain_layers.i.linear.*."""

    def __init__(self, p: WanDiTParams):
        super().__init__()
        n = len(p.audio_inject_layers)
        # The official injectors always use qk_norm=True and eps 1e-6, whatever the config says.
        self.injector = nn.ModuleList([CrossAttention(p.dim, p.num_heads, True, 1e-6) for _ in range(n)])
        self.injector_adain_layers = nn.ModuleList([AudioAdaLN(p.dim) for _ in range(n)])
        self.block_to_injector = {b: i for i, b in enumerate(sorted(p.audio_inject_layers))}

    def forward(self, i: int, x: torch.Tensor, audio_local: torch.Tensor, audio_global: torch.Tensor) -> torch.Tensor:
        """Injector i on whole latent frames of noisy tokens. x (B, F·P, D) noisy tokens only; audio_local
        (B·F, n_tok, D); audio_global (B·F, D). -> x + injection (B, F·P, D)."""
        B, L, D = x.shape
        frames = audio_local.shape[0] // B
        h = x.reshape(B * frames, L // frames, D)  # (B·F, P, D) one item per latent frame
        h = self.injector_adain_layers[i](h, audio_global)  # (B·F, P, D) fp32
        out = self.injector[i](h, audio_local)  # (B·F, P, D)
        return x + out.reshape(B, L, D)  # (B, F·P, D)


class Head(nn.Module):
    """LN · (1 + scale) + shift from the noisy timestep, then Linear to prod(patch)·out_dim, in fp32 (an official
    fp32 island). Keys modulation, head."""

    def __init__(self, p: WanDiTParams):
        super().__init__()
        self.norm = FP32LayerNorm(p.dim, eps=p.eps, elementwise_affine=False)
        self.head = nn.Linear(p.dim, p.patch_size[0] * p.patch_size[1] * p.patch_size[2] * p.out_dim)
        self.modulation = nn.Parameter(_randn_over((1, 2, p.dim), p.dim**0.5))

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x (B, L, D); e (B, D) fp32 time embedding of the current t. -> (B, L, prod(patch)·out_dim) fp32."""
        shift, scale = (self.modulation.float() + e.unsqueeze(1)).chunk(2, dim=1)  # (B, 1, D) each
        return linear_f32(self.head, self.norm(x).float() * (1 + scale) + shift)  # (B, L, C_out)


@dataclass(frozen=True)
class TokenShard:
    """Rows [start, start + length) of one clip's token sequence: what a sequence-parallel rank computes. Rows past
    the sequence's end are zero tokens (padding to a multiple of the degree): the attention op must never use them
    as keys, and nothing reads their output (they follow the noisy tokens, the only ones the head reads)."""

    start: int
    length: int

    def rows(self, z: torch.Tensor) -> torch.Tensor:
        """z (N, ...) over the whole sequence -> this shard's rows (length, ...), zero rows past N."""
        r = z[self.start:self.start + self.length]  # (<= length, ...)
        return torch.cat([r, r.new_zeros(self.length - r.shape[0], *r.shape[1:])])  # (length, ...)


@dataclass
class S2VSequence:
    """Everything the blocks need for one clip, prepared once per forward: the whole sequence, or one shard's rows
    of it (see the module docstring)."""

    tokens: torch.Tensor  # (1, n, D) [noisy | ref | motion], or rows [start, start + n) of it
    seg: int  # number of noisy tokens in the whole sequence: the first token of the t = 0 segment
    start: int  # index in the whole sequence of the first row of `tokens` (0 unless sharded)
    freqs: torch.Tensor  # (n, Dh/2) complex128 RoPE rotations of these rows
    e0: torch.Tensor  # (1, 6, 2, D) fp32 modulation: slot 0 current t, slot 1 t = 0
    e_head: torch.Tensor  # (1, D) fp32 time embedding of the current t (the head's)
    context: torch.Tensor  # (1, text_len, D) embedded text
    audio_local: torch.Tensor  # (F, num_audio_token + 1, D) fp32 per-frame audio tokens
    audio_global: torch.Tensor  # (F, D) fp32 per-frame global audio token
    grid: tuple[int, int, int]  # noisy token grid (F/pt, h/ph, w/pw)

    @property
    def local_seg(self) -> int:
        """How many of these rows are noisy tokens (they come first)."""
        return min(max(0, self.seg - self.start), self.tokens.shape[1])


class WanS2VDiT(nn.Module):
    """Wan2.2-S2V DiT; state_dict keys and shapes equal the release's (tests/golden/wan_s2v/dit_keys.txt)."""

    def __init__(self, p: WanDiTParams):
        super().__init__()
        self.params = p
        d = p.dim
        self.patch_embedding = nn.Conv3d(p.in_dim, d, kernel_size=p.patch_size, stride=p.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(p.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(p.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList([WanS2VBlock(p) for _ in range(p.num_layers)])
        self.head = Head(p)
        self.cond_encoder = nn.Conv3d(p.cond_dim, d, kernel_size=p.patch_size, stride=p.patch_size)
        self.casual_audio_encoder = CausalAudioEncoder(p.audio_dim, d, p.num_audio_token)  # (sic) the release's name
        self.audio_injector = AudioInjector(p)
        self.trainable_cond_mask = nn.Embedding(3, d)  # token type: 0 noisy, 1 reference, 2 motion
        self.frame_packer = FramePack(d)

    def set_attn_op(self, op: AttentionOp) -> None:
        """Use `op(q, k, v)` on (B, H, N, Dh) tensors for every block's self-attention."""
        for block in self.blocks:
            block.self_attn.attn_op = op

    def audio_tokens(self, audio: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """audio (1, 25, C_a, 4F) per-video-frame wav2vec2 features -> local (F, n_tok + 1, D), global (F, D) fp32.

        Like the official forward: motion_frames copies of the first audio frame stand in for the motion history
        (the causal convs need it), and the first lat_motion_frames outputs are dropped."""
        p = self.params
        a = torch.cat([audio[..., :1].expand(-1, -1, -1, p.motion_frames), audio], dim=-1)  # (1, 25, C_a, mf + 4F)
        loc, glob = self.casual_audio_encoder(a)  # (1, T', n+1, D), (1, T', 1, D)
        loc, glob = loc[0, p.lat_motion_frames:], glob[0, p.lat_motion_frames:, 0]  # (F', n+1, D), (F', D)
        if loc.shape[0] != frames:
            raise ValueError(f"WanS2VDiT: audio of {audio.shape[-1]} frames gives {loc.shape[0]} latent frames of "
                             f"audio tokens, the clip has {frames} (pass 4 video frames per latent frame)")
        return loc, glob

    def time_embeddings(self, t, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """t: the timestep as the sampler passes it (int, float or a 1-element tensor; an int64 tensor for the official
        UniPC). -> e_head (1, D), e0 (1, 6, 2, D) fp32, slot 1 being t = 0 (zero_timestep) for ref and motion."""
        if isinstance(t, torch.Tensor):
            t = t.reshape(1).to(device)  # keeps the caller's dtype: an int64 or float32 timestep converts exactly
        else:
            t = torch.tensor([t], dtype=torch.float64, device=device)  # (1,)
        t2 = torch.cat([t, torch.zeros_like(t)])  # (2,)
        e = sequential_f32(self.time_embedding, sinusoidal_embedding(t2, self.params.freq_dim).float())  # (2, D)
        e0 = sequential_f32(self.time_projection, e).unflatten(1, (6, self.params.dim))  # (2, 6, D)
        return e[:1], torch.stack([e0[0], e0[1]], dim=1)[None]  # (1, D), (1, 6, 2, D)

    def prepare(self, x: torch.Tensor, t, context: torch.Tensor, ref: torch.Tensor, motion: torch.Tensor | None,
                cond: torch.Tensor, audio: torch.Tensor, shard: TokenShard | None = None) -> S2VSequence:
        """The inputs of `forward` -> the token sequence (or the shard's rows of it) and everything the blocks need.
        A shard still embeds the whole sequence (the patch embeddings cost little next to one block) and keeps its
        rows; its RoPE table is computed for its rows only."""
        p = self.params
        C, frames, lat_h, lat_w = x.shape
        dt = self.patch_embedding.weight.dtype
        audio_local, audio_global = self.audio_tokens(audio, frames)  # (F, n+1, D), (F, D)

        noisy = self.patch_embedding(x[None].to(dt)) + self.cond_encoder(cond[None].to(dt))  # (1, D, F, H, W)
        grid = tuple(noisy.shape[2:])
        noisy = noisy.flatten(2).transpose(1, 2)  # (1, F·H·W, D)
        ref_tok = self.patch_embedding(ref[None].to(dt)).flatten(2).transpose(1, 2)  # (1, H·W, D)
        kind = self.trainable_cond_mask.weight.to(noisy.dtype)  # (3, D)
        parts = [noisy + kind[0], ref_tok + kind[1]]
        if motion is not None:
            mot = self.frame_packer(motion, p.add_last_motion_level, p.framepack_drop_mode)  # (1, N_m, D)
            parts.append(mot + kind[2])
        tokens = torch.cat(parts, dim=1)  # (1, N, D)

        positions = s2v_positions(p, frames, lat_h, lat_w, motion is not None)  # (N, 3)
        start = 0
        if shard is not None:
            start = shard.start
            tokens, positions = shard.rows(tokens[0])[None], shard.rows(positions)  # (1, n, D), (n, 3)
        freqs = rope_freqs(positions.to(x.device), p.head_dim)  # (n, Dh/2) complex128

        e_head, e0 = self.time_embeddings(t, x.device)  # (1, D), (1, 6, 2, D)

        L = context.shape[0]
        if L > p.text_len:
            raise ValueError(f"WanS2VDiT: {L} text tokens, the model takes at most text_len={p.text_len}")
        # Zero-padded to text_len after trimming, and attended to without a mask, as the official model does.
        ctx = torch.cat([context, context.new_zeros(p.text_len - L, context.shape[1])])[None]  # (1, text_len, C_t)
        ctx = self.text_embedding(as_weight_dtype(ctx, self.text_embedding[0]))  # (1, text_len, D)
        return S2VSequence(tokens, noisy.shape[1], start, freqs, e0, e_head, ctx, audio_local, audio_global, grid)

    def forward(self, x: torch.Tensor, t, context: torch.Tensor, ref: torch.Tensor, motion: torch.Tensor | None,
                cond: torch.Tensor, audio: torch.Tensor, shard: TokenShard | None = None) -> torch.Tensor:
        """Velocity prediction for one clip.

        x (16, F, h, w) noisy latent; t the timestep as the sampler passes it; context (L, text_dim) trimmed T5
        output; ref (16, 1, h, w) reference latent; motion (16, 19, h, w) latents of the last 73 frames, or None
        when motion is dropped (clip 0); cond (16, F, h, w) pose latents (zeros without a pose video); audio
        (1, 25, audio_dim, 4F) per-video-frame wav2vec2 features. -> (16, F, h, w) float32.

        With a shard (sequence parallelism, the self-attention op being the wrapper's all-to-all): only the shard's
        rows are computed, and the result is the head output of the noisy tokens among them,
        (1, local noisy tokens, prod(patch)·C) float32, for the wrapper to gather and unpatchify."""
        s = self.prepare(x, t, context, ref, motion, cond, audio, shard)
        h = s.tokens  # (1, n, D)
        for idx, block in enumerate(self.blocks):
            h = block(h, s.e0, s.seg - s.start, s.freqs, s.context)  # (1, n, D)
            inj = self.audio_injector.block_to_injector.get(idx)
            if inj is not None:
                h = self.inject(inj, h, s)  # (1, n, D)
        out = self.head(h[:, :s.local_seg], s.e_head)  # (1, local noisy, prod(patch)·C)
        return out if shard is not None else self.unpatchify(out[0], s.grid)  # (C, F, h, w)

    def inject(self, i: int, h: torch.Tensor, s: S2VSequence) -> torch.Tensor:
        """Audio injector i on the noisy tokens among h's rows (whole-sequence tokens [s.start, s.start + n)).

        A token's injection depends only on the token and its latent frame (AdaIN normalises each token; the frame
        picks the scale, shift and audio keys), so rows that start or end inside a frame are injected as a partial
        frame of their own: the noisy rows are cut at frame boundaries into a partial first frame, whole frames and a
        partial last frame. Unsharded that is one piece, the whole frames. h (1, n, D) -> (1, n, D)."""
        per_frame = s.seg // s.audio_local.shape[0]  # noisy tokens per latent frame
        a, b = s.start, s.start + s.local_seg  # the noisy tokens held, as whole-sequence indices
        first = min(b, -(-a // per_frame) * per_frame)  # end of a partial first frame
        last = max(first, b // per_frame * per_frame)  # start of a partial last frame
        pieces = []
        for u, v in ((a, first), (first, last), (last, b)):
            if u < v:
                f = slice(u // per_frame, (v - 1) // per_frame + 1)  # the latent frames the piece covers
                pieces.append(self.audio_injector(i, h[:, u - a:v - a], s.audio_local[f], s.audio_global[f]))
        return torch.cat([*pieces, h[:, b - a:]], dim=1)  # (1, n, D)

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """x (F·H·W, pt·ph·pw·C) -> (C, F·pt, H·ph, W·pw) float32."""
        (pt, ph, pw), c = self.params.patch_size, self.params.out_dim
        f, h, w = grid
        u = x.view(f, h, w, pt, ph, pw, c).permute(6, 0, 3, 1, 4, 2, 5)  # (C, F, pt, H, ph, W, pw)
        return u.reshape(c, f * pt, h * ph, w * pw).float()  # (C, F, h, w)
