"""LiveAvatar's block-causal streaming forward of the Wan2.2-S2V DiT (their `CausalWanModel_S2V`, same weights).

The video is made in blocks of FRAMES_PER_BLOCK = 3 latent frames (12 video frames), each denoised by 4 Euler steps
(timesteps [1000, 857.6923, 602.1506, 8.9286], shift 3, no guidance). The token sequence of a forward is only the
block's noisy tokens; everything else comes from caches (their `CausalWanS2VSelfAttention.forward`,
liveavatar/models/wan/causal_model_s2v.py):

- Sink. The reference latent and the FramePack motion tokens [ref | post | 2x | 4x] run once through every layer at
  t = 0 (`prefill_sink`: self-attention among themselves, text cross-attention, FFN, no audio); each layer's un-roped
  keys and values are kept. After the first clip the caller prefills again with the rolled sink frame (the first
  latent of the first block's final latents) as the reference: that is their refresh, done once.
- Ring. Each denoising step s has its own key/value ring per layer, written during that step's forward at that
  step's noise level (no clean re-encoding pass). It holds the last RING_FRAMES = 12 latent frames (one LiveAvatar
  clip, their max_seq_len), keys stored roped at their absolute frame index. Block b writes its tokens at ring slot
  (b·3·P) mod ring (P tokens per latent frame); before the ring has wrapped only the slots written so far are keys,
  afterwards all of them: a block sees itself and the 9 latent frames before it.
- Attention. q of the block attends, without a mask, to [ring keys | RoPE(sink keys)], values [ring | sink].
- Sink RoPE offset. The sink keys are roped at every forward: motion at its fixed S2V positions (t -1, -3, -19..-4),
  the reference at t = 30 + max(0, f - (30 - offset)), f the block's first latent frame, i.e. `offset` frames ahead
  of the block once f is large. Their code draws offset = random.randint(4, 30) inside every forward; here it is an
  argument, one per step, so that the caller can draw it from the job seed and the block index.
- Per-frame timesteps: the modulation and the head take one timestep per latent frame (their `t` is [1, F]).

Numerics follow their code in float32: RoPE rotations are rounded to float16 as their tables are (`rope_precompute`
stores them in a complex32 tensor; about 3e-4 from float64), so this module matches theirs, not the official S2V
tables. Elsewhere the precision islands of `layers.py` apply (float32 LayerNorm, modulation and head); their bf16
copy rounds the residual stream to bf16 after each block and runs LayerNorm in bf16, which matters only in bf16.
Positions are computed, not looked up: their 45,000-row table ends after ~3.1 h of latent frames, this does not.

Memory, bf16, Wan2.2-S2V-14B (40 layers, 40 heads x 128) at 704x384 (P = 1056 tokens per latent frame):
- one step's ring: 40 layers x 12 x 1056 = 12,672 tokens x 5120 x 2 (k, v) x 2 B = 10.38 GB; 4 steps 41.5 GB;
- the sink: 40 x 2640 tokens (1056 ref + 1056 post + 264 2x + 264 4x) x 5120 x 2 x 2 B = 2.16 GB, shared by the
  steps (identical for all of them: the prefill does not depend on the step). Their TPP ranks each allocate 3000
  slots (2.46 GB; `_initialize_kv_cache` in causal_s2v_pipeline_tpp.py) and the single-GPU pipeline 2800.
A timestep-pipeline rank holds its own step's ring and the sink: 12.5 GB. `CausalCaches.empty(..., device="meta")`
gives these shapes without memory.

Sequence parallelism: `prefill_sink`, `causal_forward`, `euler_step` and `stream_block` take an optional `exchange`
(`HeadExchange`; live_parallel.py gives the Ulysses one and the class that holds it). With it a rank computes its
rows of the forward's tokens and attends with its share of the heads, which are all its caches hold; without it
(None) one rank does everything, as above.
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from avatar_cli.families.wan_s2v.dit import (REF_T_POSITION, S2VSequence, TokenShard, WanDiTParams, WanS2VBlock,
                                             WanS2VDiT, s2v_positions)
from avatar_cli.families.wan_s2v.layers import (
    apply_rope,
    as_weight_dtype,
    rope_freqs,
    sequential_f32,
    sinusoidal_embedding,
)
from avatar_cli.families.wan_s2v.sampler import euler_schedule

FRAMES_PER_BLOCK = 3  # latent frames per block (12 video frames), their num_frames_per_block
RING_FRAMES = 12  # latent frames a step's ring holds: one LiveAvatar clip (infer_frames 48), their max_seq_len
STEPS = 4
SINK_OFFSET_RANGE = (4, 30)  # their random.randint(4, 30), inclusive

# zeros(shape, dtype) -> a zero tensor wherever the caller keeps its rings (runtime/rings.py RingStore.zeros: on the
# device, in host memory, in a scratch file): the memory comes from the runtime, not from this file.
Zeros = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass
class CausalCaches:
    """The rolling state of the streaming model: per-step rings and the shared sink, plain tensors.

    k, v: (steps, layers, ring tokens, heads, head_dim), keys roped at their absolute positions;
    sink_k, sink_v: (layers, sink tokens, heads, head_dim), keys un-roped (0 sink tokens before `prefill_sink`).
    The rings are written in place; their shapes never change."""

    k: torch.Tensor
    v: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor

    NAMES = ("k", "v", "sink_k", "sink_v")

    @classmethod
    def empty(cls, p: WanDiTParams, lat_h: int, lat_w: int, steps: int = STEPS, ring_frames: int = RING_FRAMES,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              heads: int | None = None, zeros: Zeros | None = None) -> "CausalCaches":
        """Zero rings of ring_frames latent frames at latent size lat_h x lat_w, and an empty sink; `heads` of the
        model's heads (all of them by default; a sequence-parallel rank holds num_heads / W). zeros: allocates the
        rings (default: torch.zeros on `device`); the empty sink goes beside them."""
        ring = ring_frames * frame_tokens(p, lat_h, lat_w)
        if ring_frames % FRAMES_PER_BLOCK:
            raise ValueError(f"CausalCaches: ring_frames={ring_frames} is not a whole number of "
                             f"{FRAMES_PER_BLOCK}-frame blocks")
        heads = p.num_heads if heads is None else heads
        shape = (steps, p.num_layers, ring, heads, p.head_dim)
        sink = (p.num_layers, 0, heads, p.head_dim)
        if zeros is None:
            k, v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        else:
            k, v = zeros(shape, dtype), zeros(shape, dtype)
        z = dict(dtype=dtype, device=k.device)  # no elements: prefill_sink replaces it beside the rings (_beside)
        return cls(k, v, torch.zeros(sink, **z), torch.zeros(sink, **z))

    @property
    def steps(self) -> int:
        return self.k.shape[0]

    @property
    def ring_tokens(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self.NAMES}

    @classmethod
    def from_tensors(cls, d: dict[str, torch.Tensor]) -> "CausalCaches":
        """Inverse of `tensors`; a missing or extra name or inconsistent shapes are a ValueError naming them."""
        if set(d) != set(cls.NAMES):
            raise ValueError(f"CausalCaches: tensors {sorted(d)}, expected {sorted(cls.NAMES)}")
        c = cls(**{n: d[n] for n in cls.NAMES})
        if c.k.ndim != 5 or c.v.shape != c.k.shape:
            raise ValueError(f"CausalCaches: ring k {tuple(c.k.shape)} and v {tuple(c.v.shape)} must be equal "
                             "(steps, layers, tokens, heads, head_dim)")
        if c.sink_k.ndim != 4 or c.sink_v.shape != c.sink_k.shape or c.sink_k.shape[0] != c.k.shape[1] \
                or c.sink_k.shape[2:] != c.k.shape[3:]:
            raise ValueError(f"CausalCaches: sink k {tuple(c.sink_k.shape)} and v {tuple(c.sink_v.shape)} do not "
                             f"match the rings {tuple(c.k.shape)}")
        return c


class HeadExchange(Protocol):
    """What a sequence-parallel rank does around self-attention (live_parallel.UlyssesExchange, over a process
    group of `world` ranks). The rank computes rows [rank·n, (rank + 1)·n) of a forward's N tokens, n = ceil(N /
    world), zero rows past N; the attention runs on all N tokens and heads [rank·H/W, (rank + 1)·H/W), the heads its
    caches hold. `exchange=None` in this module: one rank, every row and every head."""

    world: int
    rank: int

    def to_heads(self, qkv: torch.Tensor, tokens: int) -> torch.Tensor:
        """(3, 1, H, n, Dh) this rank's rows, all heads -> (3, 1, H/W, tokens, Dh) every real row, its heads."""

    def to_rows(self, a: torch.Tensor, tokens: int) -> torch.Tensor:
        """(1, H/W, tokens, Dh) every row, this rank's heads -> (1, H, n, Dh) its rows, all heads."""

    def gather_rows(self, out: torch.Tensor, tokens: int) -> torch.Tensor:
        """(m, C) this rank's real rows (m <= n) -> (tokens, C) every rank's, in order, on every rank."""


def _rows(tokens: int, exchange: HeadExchange | None) -> TokenShard:
    """The rows of a forward's `tokens` tokens that this rank computes."""
    if exchange is None:
        return TokenShard(0, tokens)
    n = -(-tokens // exchange.world)  # the last rank(s) padded
    return TokenShard(exchange.rank * n, n)


def _heads(p: WanDiTParams, exchange: HeadExchange | None) -> slice:
    """The heads this rank attends with and caches."""
    if exchange is None:
        return slice(0, p.num_heads)
    hs = p.num_heads // exchange.world
    return slice(exchange.rank * hs, (exchange.rank + 1) * hs)


def _self_attention(block: WanS2VBlock, u: torch.Tensor, tokens: int, exchange: HeadExchange | None,
                    attend) -> torch.Tensor:
    """Self-attention of the modulated rows u (1, n, D) of a `tokens`-token sequence. attend(q, k, v) -> a on
    (1, h, tokens, Dh) un-roped tensors, h the rank's heads (all of them unsharded). -> (1, n, D)."""
    q, k, v = _qkv(block, u)  # (1, H, n, Dh)
    if exchange is not None:
        q, k, v = exchange.to_heads(torch.stack([q, k, v]), tokens)  # (1, H/W, tokens, Dh) each
    a = attend(q, k, v)  # (1, h, tokens, Dh)
    if exchange is not None:
        a = exchange.to_rows(a, tokens)  # (1, H, n, Dh)
    return block.self_attn.o(a.transpose(1, 2).flatten(2))  # (1, n, D)


@dataclass
class BlockInputs:
    """What a block's 4 forwards share: the embedded text and the block's audio tokens."""

    context: torch.Tensor  # (1, text_len, D) embedded, zero-padded text
    audio_local: torch.Tensor  # (F, num_audio_token + 1, D) fp32 per-frame audio tokens
    audio_global: torch.Tensor  # (F, D) fp32 per-frame global audio token


def frame_tokens(p: WanDiTParams, lat_h: int, lat_w: int) -> int:
    """Tokens per latent frame (P): 1056 at 704x384 (latent 48x88)."""
    return (lat_h // p.patch_size[1]) * (lat_w // p.patch_size[2])


def sink_tokens(p: WanDiTParams, lat_h: int, lat_w: int) -> int:
    """Tokens in the sink [ref | post | 2x | 4x]: 2640 at 704x384, 80 at the tiny 8x16 latent."""
    return _positions(p, 1, lat_h, lat_w)[1].shape[0]


def sink_ref_shift(first_frame: int, offset: int) -> int:
    """How far the reference's RoPE time moves from 30 for a block starting at latent frame `first_frame`: their
    max(0, f - (30 - offset)), so the reference sits `offset` frames ahead of the block once f > 30 - offset."""
    lo, hi = SINK_OFFSET_RANGE
    if not lo <= offset <= hi:
        raise ValueError(f"sink offset {offset} outside LiveAvatar's range [{lo}, {hi}]")
    return max(0, first_frame - (REF_T_POSITION - offset))


def _rope_f16(positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """rope_freqs rounded to float16 real and imaginary parts, as LiveAvatar's complex32 tables hold them.
    positions (N, 3) -> (N, head_dim / 2) complex128."""
    f = rope_freqs(positions, head_dim)  # (N, Dh/2) complex128
    return torch.complex(f.real.half().double(), f.imag.half().double())  # (N, Dh/2)


def _positions(p: WanDiTParams, frames: int, lat_h: int, lat_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """S2V positions split into the block's noisy tokens (t 0..frames-1) and the sink [ref (t 30) | motion].
    frames >= 1. -> (frames·P, 3), (N_sink, 3) int64."""
    pos = s2v_positions(p, frames, lat_h, lat_w, with_motion=True)  # (frames·P + N_sink, 3)
    n = frames * frame_tokens(p, lat_h, lat_w)
    return pos[:n], pos[n:]


def _time(model: WanS2VDiT, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame timesteps t (F,) -> head embedding e (F, D) and modulation e0 (F, 6, D), fp32."""
    e = sequential_f32(model.time_embedding, sinusoidal_embedding(t, model.params.freq_dim).float())  # (F, D)
    return e, sequential_f32(model.time_projection, e).unflatten(1, (6, model.params.dim))  # (F, D), (F, 6, D)


def _qkv(block: WanS2VBlock, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Self-attention projections of the modulated input h (1, L, D) -> q, k, v (1, H, L, Dh), un-roped."""
    a = block.self_attn
    h = as_weight_dtype(h, a.q)  # (1, L, D)
    q = a.norm_q(a.q(h)).unflatten(2, (a.num_heads, -1)).transpose(1, 2)  # (1, H, L, Dh)
    k = a.norm_k(a.k(h)).unflatten(2, (a.num_heads, -1)).transpose(1, 2)  # (1, H, L, Dh)
    v = a.v(h).unflatten(2, (a.num_heads, -1)).transpose(1, 2)  # (1, H, L, Dh)
    return q, k, v


def _embed_text(model: WanS2VDiT, context: torch.Tensor) -> torch.Tensor:
    """context (L, text_dim) -> (1, text_len, D): zero-padded to text_len, no mask, as the official model."""
    p = model.params
    if context.shape[0] > p.text_len:
        raise ValueError(f"causal: {context.shape[0]} text tokens, the model takes at most text_len={p.text_len}")
    ctx = F.pad(context, (0, 0, 0, p.text_len - context.shape[0]))[None]  # (1, text_len, C_t)
    return model.text_embedding(as_weight_dtype(ctx, model.text_embedding[0]))  # (1, text_len, D)


def block_inputs(model: WanS2VDiT, context: torch.Tensor, audio: torch.Tensor,
                 frames: int = FRAMES_PER_BLOCK) -> BlockInputs:
    """context (L, text_dim) trimmed T5 output; audio (1, 25, C_a, 4·frames) the block's own wav2vec2 frames (their
    73-frame history is the block's first frame repeated, so no audio crosses blocks)."""
    loc, glob = model.audio_tokens(audio, frames)  # (F, n+1, D), (F, D)
    return BlockInputs(_embed_text(model, context), loc, glob)


@torch.no_grad()
def prefill_sink(model: WanS2VDiT, caches: CausalCaches, ref: torch.Tensor, motion: torch.Tensor,
                 context: torch.Tensor, exchange: HeadExchange | None = None) -> None:
    """Their sink prefill (`sink_flag=True`): fill caches.sink_k / sink_v with every layer's un-roped keys and values
    of [ref | FramePack(motion)] at t = 0. ref (16, 1, h, w) the reference latent, or the rolled sink frame for the
    refresh after the first clip; motion (16, 19, h, w) motion latents (LiveAvatar: the reference repeated 73 frames,
    encoded); context (L, text_dim). With an exchange the rank computes its rows and keeps its heads' keys."""
    p = model.params
    dt = model.patch_embedding.weight.dtype
    kind = model.trainable_cond_mask.weight  # (3, D) token type: 0 noisy, 1 reference, 2 motion
    ref_tok = model.patch_embedding(ref[None].to(dt)).flatten(2).transpose(1, 2)  # (1, P, D)
    mot = model.frame_packer(motion, p.add_last_motion_level, p.framepack_drop_mode)  # (1, N_m, D)
    x = torch.cat([ref_tok + kind[1].to(dt), mot + kind[2].to(dt)], dim=1)  # (1, N, D)
    N = x.shape[1]
    x = _rows(N, exchange).rows(x[0])[None]  # (1, n, D) this rank's rows
    freqs = _rope_f16(_positions(p, 1, ref.shape[-2], ref.shape[-1])[1].to(x.device), p.head_dim)  # (N, Dh/2)
    e0 = _time(model, torch.zeros(1, device=x.device))[1]  # (1, 6, D) t = 0
    ctx = _embed_text(model, context)  # (1, text_len, D)
    ks, vs = [], []

    def keep(q, k, v):  # (1, h, N, Dh) the rank's heads
        ks.append(k[0].transpose(0, 1))  # (N, h, Dh) un-roped, as their cond_k
        vs.append(v[0].transpose(0, 1))  # (N, h, Dh)
        return F.scaled_dot_product_attention(apply_rope(q, freqs), apply_rope(k, freqs), v)  # (1, h, N, Dh)

    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        # Called, so that what wraps the blocks from outside (offload, FSDP2) sees each one run; the last layer
        # runs only its self-attention: its keys and values are all the sink needs.
        attend = functools.partial(_self_attention, block, tokens=N, exchange=exchange, attend=keep)
        x = block(x, None, 0, None, ctx, frame_e0=e0, attend=attend, attention_only=i == last)  # (1, n, D)
    caches.sink_k = _beside(torch.stack(ks).to(caches.k.dtype), caches.k)  # (layers, N, h, Dh)
    caches.sink_v = _beside(torch.stack(vs).to(caches.v.dtype), caches.v)  # (layers, N, h, Dh)


def _beside(x: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """x where the rings are: on their device, or in (pinned) host memory with them."""
    if x.device == ring.device:
        return x
    return x.to(ring.device).pin_memory() if ring.is_pinned() else x.to(ring.device)


def _check_caches(p: WanDiTParams, caches: CausalCaches, step: int, L: int, lat_h: int, lat_w: int,
                  exchange: HeadExchange | None) -> None:
    """ValueError naming what does not fit: the caches' heads against this rank's, an empty or mis-sized sink, a
    block of L tokens that does not tile the ring, a step the caches do not hold."""
    heads = _heads(p, exchange)
    if caches.k.shape[3] != heads.stop - heads.start:
        raise ValueError(f"causal_forward: the caches hold {caches.k.shape[3]} heads, this rank attends with "
                         f"{heads.stop - heads.start} of the model's {p.num_heads}")
    if caches.sink_k.shape[1] == 0:
        raise ValueError("causal_forward: the sink is empty (call prefill_sink first)")
    if caches.sink_k.shape[1] != sink_tokens(p, lat_h, lat_w):
        raise ValueError(f"causal_forward: the sink holds {caches.sink_k.shape[1]} tokens, a {lat_h}x{lat_w} latent "
                         f"has {sink_tokens(p, lat_h, lat_w)}")
    if caches.ring_tokens % L:
        raise ValueError(f"causal_forward: a block of {L} tokens does not tile the ring of {caches.ring_tokens} "
                         "tokens")
    if not 0 <= step < caches.steps:
        raise ValueError(f"causal_forward: step {step} outside the caches' {caches.steps} steps")


@torch.no_grad()
def causal_forward(model: WanS2VDiT, caches: CausalCaches, step: int, x: torch.Tensor, t: torch.Tensor,
                   block_index: int, inputs: BlockInputs, sink_offset: int,
                   cond: torch.Tensor | None = None, exchange: HeadExchange | None = None) -> torch.Tensor:
    """One streaming forward (their `_forward_inference`): the velocity of block `block_index` (counted from the
    start of the stream, across clips) at denoising step `step`, writing the block's keys and values into that
    step's ring.

    x (16, F, h, w) the block's latent; t (F,) per-frame float timesteps; cond (16, F, h, w) pose latents, None for
    zeros (LiveAvatar has no pose input). -> (16, F, h, w) float32.

    With an exchange (sequence parallelism, the same inputs on every rank): the rank runs its rows of the block's
    tokens through the per-token parts (modulation, cross-attention, FFN, audio injection, head), the attention on
    its heads of every token against its heads' ring and sink; every rank returns the whole velocity."""
    p = model.params
    C, frames, lat_h, lat_w = x.shape
    P = frame_tokens(p, lat_h, lat_w)
    L = frames * P
    ring = caches.ring_tokens
    _check_caches(p, caches, step, L, lat_h, lat_w, exchange)
    first = block_index * frames  # absolute latent frame of the block's first frame
    start = first * P
    slot = start % ring  # their current_start, folded once it passes the ring
    active = ring if start >= ring else start + L  # ring slots that hold keys

    dt = model.patch_embedding.weight.dtype
    if cond is None:
        cond = x.new_zeros(p.cond_dim, frames, lat_h, lat_w)
    h = model.patch_embedding(x[None].to(dt)) + model.cond_encoder(cond[None].to(dt))  # (1, D, F, H, W)
    grid = tuple(h.shape[2:])
    h = h.flatten(2).transpose(1, 2) + model.trainable_cond_mask.weight[0].to(dt)  # (1, L, D)
    rows = _rows(L, exchange)
    h = rows.rows(h[0])[None]  # (1, n, D) this rank's rows
    frame_of = rows.rows(torch.arange(L, device=x.device) // P)  # (n,) each row's latent frame (padding: 0)

    noisy_pos, sink_pos = _positions(p, frames, lat_h, lat_w)  # (L, 3), (N_sink, 3)
    noisy_pos[:, 0] += first
    sink_pos[:P, 0] += sink_ref_shift(first, sink_offset)  # the reference's rows come first
    freqs = _rope_f16(noisy_pos.to(x.device), p.head_dim)  # (L, Dh/2)
    sink_freqs = _rope_f16(sink_pos.to(x.device), p.head_dim)  # (N_sink, Dh/2)

    e, e0 = _time(model, t.to(x.device))  # (F, D), (F, 6, D)
    # dit.inject cuts the rows at latent-frame boundaries (a rank's rows may start or end inside a frame); it reads
    # only the row count, seg, start and the audio tokens of this sequence description.
    seq = S2VSequence(h, L, rows.start, freqs, e0, e, inputs.context, inputs.audio_local, inputs.audio_global, grid)
    for i, block in enumerate(model.blocks):
        ring_k, ring_v = caches.k[step, i], caches.v[step, i]  # (ring, h, Dh) the rank's heads

        def ring_attention(q, k, v):  # (1, h, L, Dh) every token, the rank's heads
            q, k = apply_rope(q, freqs), apply_rope(k, freqs)  # (1, h, L, Dh)
            ring_k[slot:slot + L] = k[0].transpose(0, 1)  # roped, at the absolute position
            ring_v[slot:slot + L] = v[0].transpose(0, 1)
            # Rings off the device (runtime.rings: host | disk): this layer's come in for its attention, as they are.
            dev = q.device
            ks, vs = ring_k[:active].to(dev), ring_v[:active].to(dev)  # (active, h, Dh)
            sink_k = apply_rope(caches.sink_k[i].to(dev).transpose(0, 1)[None], sink_freqs)  # (1, h, N_sink, Dh)
            keys = torch.cat([ks.transpose(0, 1)[None], sink_k], dim=2)  # (1, h, active + N_sink, Dh)
            vals = torch.cat([vs, caches.sink_v[i].to(dev)]).transpose(0, 1)[None]  # (1, h, active + N_sink, Dh)
            return F.scaled_dot_product_attention(q, keys.to(q.dtype), vals.to(q.dtype))  # (1, h, L, Dh)

        attend = functools.partial(_self_attention, block, tokens=L, exchange=exchange, attend=ring_attention)
        h = block(h, None, 0, None, inputs.context, frame_e0=e0, row_frames=frame_of, attend=attend)  # (1, n, D)
        inj = model.audio_injector.block_to_injector.get(i)
        if inj is not None:
            h = model.inject(inj, h, seq)  # (1, n, D)
    m = min(max(0, L - rows.start), rows.length)  # the rank's real rows
    out = model.head(h[0, :m, None], e[frame_of[:m]])[:, 0]  # (m, prod(patch)·C) per-frame head modulation
    if exchange is not None:
        out = exchange.gather_rows(out, L)  # (L, prod(patch)·C)
    return model.unpatchify(out, grid)  # (16, F, h, w)


@torch.no_grad()
def stream_block(model: WanS2VDiT, caches: CausalCaches, noise: torch.Tensor, block_index: int,
                 context: torch.Tensor, audio: torch.Tensor, sink_offsets: int | Sequence[int],
                 cond: torch.Tensor | None = None, shift: float = 3.0,
                 exchange: HeadExchange | None = None) -> torch.Tensor:
    """Denoise one block: their Euler steps from `noise` (16, 3, h, w), step i through caches' ring i, every frame
    at timestep t_i, no guidance. context (L, text_dim); audio (1, 25, C_a, 12) the block's wav2vec2 frames;
    sink_offsets one per step (an int: the same for all); shift the schedule's (theirs hard-codes 3). The sink must
    be prefilled. exchange: see causal_forward (every rank runs the Euler update on the whole block alike).
    -> latents (16, 3, h, w) in the noise's dtype."""
    offsets = [sink_offsets] * caches.steps if isinstance(sink_offsets, int) else list(sink_offsets)
    if len(offsets) != caches.steps:
        raise ValueError(f"stream_block: {len(offsets)} sink offsets for {caches.steps} steps")
    inputs = block_inputs(model, context, audio, noise.shape[1])
    x = noise
    for i in range(caches.steps):
        x = euler_step(model, caches, i, caches.steps, x, block_index, inputs, offsets[i], cond, shift,
                       exchange=exchange)
    return x


@torch.no_grad()
def euler_step(model: WanS2VDiT, caches: CausalCaches, step: int, steps: int, x: torch.Tensor, block_index: int,
               inputs: BlockInputs, sink_offset: int, cond: torch.Tensor | None = None, shift: float = 3.0,
               ring: int | None = None, exchange: HeadExchange | None = None) -> torch.Tensor:
    """Step `step` of the `steps`-step schedule on block `block_index`: one forward at t_step through ring `ring`
    (default: `step`; a timestep-pipeline rank holds its own step's ring only, ring 0), then the Euler update.
    x (16, F, h, w) -> (16, F, h, w) in x's dtype."""
    timesteps, sigmas = euler_schedule(steps, shift)
    sig = torch.tensor(sigmas, dtype=torch.float32, device=x.device)  # (steps + 1,)
    t_frames = torch.full((x.shape[1],), timesteps[step], dtype=torch.float32, device=x.device)  # (F,)
    v = causal_forward(model, caches, step if ring is None else ring, x, t_frames, block_index, inputs, sink_offset,
                       cond, exchange)  # (16, F, h, w)
    # Euler in fp32 as diffusers' step, the result in x's dtype: theirs casts to the model output's dtype, bf16 in
    # their runs (our head returns fp32, as the official S2V head does).
    return (x.float() + (sig[step + 1] - sig[step]) * v).to(x.dtype)  # (16, F, h, w)
