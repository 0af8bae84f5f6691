"""SwiftVR streaming inference, equal to the official `SwiftVRPipeline.restore_video(clip_len=24, dit_overlap=0)`
(swiftvr/pipeline.py, runner.py:run_pipeline's gpu_worker, streaming/chunk.py:build_chunk_specs), fed frames as they
come instead of a whole file.

Per frame: the low-quality frame is cropped top-left to a multiple of 8 (`io.py:get_video_info`), scaled up on
0..255 with bilinear interpolation (align_corners=False, no antialias) to `scale` times that, divided by 255, and
padded bottom/right with zeros to a multiple of 32 (`io.py:preprocess_clip_uint8`, `pipeline.py:_aligned_pad`); the
restored frame is clamped to [0, 1] and the padding cropped off. uint8 frames are taken as they are (the official
input); float frames in [0, 1] are multiplied by 255 first.

Chunks of a clip of t = 4a + 1 frames: t <= 28 is one LAST chunk; otherwise FIRST is 28 frames, MIDDLE 24 while
more than 24 remain, and LAST the rest, r = 4b + 1 frames. Each chunk is encoded by the ReAE (its causal state
carried), restored by one DiT pass at t = 1000 with the time positions offset by the latents so far, and decoded
(state carried; the first decode drops 3 frames). LAST appends 3 copies of its last frame before encoding (b + 1
latents) and runs the DiT on 7 latents: the 6 - b before it are the previous chunk's last pre-DiT encoder latents
(zeros when there is none), placed at their own positions (t_off = max(0, offset - pad)); only the last b + 1 are
kept. Frames out: FIRST 25, MIDDLE 24, LAST 4b + 4 (4b + 1 when it is the only chunk), t in all.

Streaming: a group of frames can only be run once it is known not to be the LAST chunk, so `push` holds FIRST until
its 29th frame arrives and each MIDDLE until the frame after it; `finish` runs what is left.

Frame counts that are not 4a + 1 (the official code drops the tail to the largest 4a + 1; avatar keeps every frame):
the clip is padded with copies of its last frame to the next 4a + 1 and the outputs of the padding frames are
dropped. The result is the official output of the padded clip, cut to the frames given. Padding can lengthen the
clip past a chunk boundary (22 to 24 frames left become 25): the official chunking of the padded clip then runs a
further MIDDLE (or FIRST) and a LAST of one frame, as `build_chunk_specs` does.

`overlap` is the official `dit_overlap` (0 in `restore_video`'s default, up to 6 here): a MIDDLE chunk's DiT pass then
sees the previous chunk's last `overlap` encoder latents before its own, at their own positions (t_off = offset -
overlap), and their outputs are dropped (`StreamingDiT.denoise`, whose blend only touches the part it drops). FIRST
has no previous chunk and LAST pads as above either way, so only MIDDLE chunks change.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from avatar_cli.errors import InputError
from avatar_cli.modules.loading import materialize
from avatar_cli.modules.module import build_meta
from avatar_cli.sr.swiftvr.dit import SwiftVRDiT
from avatar_cli.sr.swiftvr.model_dir import PROMPT_KEY, read_release
from avatar_cli.sr.swiftvr.reae import ReAE

CLIP = 24  # official clip_len: MIDDLE frames
FIRST = CLIP + 4  # FIRST chunk frames
LATENTS = CLIP // 4  # n_lat: LAST runs the DiT on LATENTS + 1 latents
LAST_PAD_FRAMES = 3  # copies of the last frame LAST appends before encoding
LQ_MULTIPLE = 8  # the official input crop
PAD_MULTIPLE = 32  # the model's input: ReAE x16, DiT patch x2


@dataclass
class SRModels:
    """The loaded models, placed where they run."""

    reae: ReAE
    dit: SwiftVRDiT
    prompt: torch.Tensor  # (L, text_dim) prompt_emb[0]


def load_sr(model_dir: Path, device: torch.device | str, dtype: torch.dtype) -> SRModels:
    """Read a release directory: checked from its headers, built on the meta device, tensors assigned strictly
    (safetensors only), floats converted to dtype."""
    rel = read_release(Path(model_dir))
    reae = build_meta(ReAE, rel.reae)
    materialize(reae, rel.reae_index, device, dtype)
    dit = build_meta(SwiftVRDiT, rel.dit)
    materialize(dit, rel.dit_index, device, dtype)
    with safe_open(str(rel.prompt.file), framework="pt", device="cpu") as f:
        prompt = f.get_tensor(PROMPT_KEY)[0]  # (L, text_dim) the official pipeline's prompt_emb[0]
    return SRModels(reae.eval().requires_grad_(False), dit.eval().requires_grad_(False),
                    prompt.to(device=device, dtype=dtype))


def output_size(lq_hw: tuple[int, int], scale: int) -> tuple[int, int]:
    """The restored frame size for low-quality frames of lq_hw: each side cropped down to a multiple of 8, times
    scale (a positive integer). InputError for a frame under 8 pixels or a bad scale."""
    h, w = lq_hw
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise InputError(f"swiftvr: scale {scale!r}: must be a positive integer")
    if h < LQ_MULTIPLE or w < LQ_MULTIPLE:
        raise InputError(f"swiftvr: frames of {h}x{w}: each side must be at least {LQ_MULTIPLE} pixels")
    return h // LQ_MULTIPLE * LQ_MULTIPLE * scale, w // LQ_MULTIPLE * LQ_MULTIPLE * scale


def _pad_to(n: int, multiple: int) -> int:
    return -n % multiple


class SRStream:
    """One clip's restoration, fed frames in order (see the module docstring). Everything carried between chunks
    is in `state_dict()`."""

    def __init__(self, models: SRModels, lq_hw: tuple[int, int], scale: int, device: torch.device | str,
                 dtype: torch.dtype, overlap: int = 0):
        if not 0 <= overlap <= LATENTS:
            raise ValueError(f"SRStream: overlap {overlap}: must be 0 to {LATENTS} latents")
        self.models, self.device, self.dtype = models, torch.device(device), dtype
        self.overlap = overlap
        self.lq_hw = tuple(lq_hw)
        self.scale = scale
        self.out_hw = output_size(self.lq_hw, scale)
        self._crop = (self.lq_hw[0] // LQ_MULTIPLE * LQ_MULTIPLE, self.lq_hw[1] // LQ_MULTIPLE * LQ_MULTIPLE)
        self._pad = (_pad_to(self.out_hw[0], PAD_MULTIPLE), _pad_to(self.out_hw[1], PAD_MULTIPLE))
        with torch.no_grad():
            self._cond = models.dit.conditioning(models.prompt.to(self.device, dtype))  # t = 1000, once
        self._pending = torch.empty(0, 3, *self._crop, dtype=dtype, device=self.device)  # (P, 3, h8, w8) 0..255
        self._enc: dict[str, torch.Tensor] = {}
        self._dec: dict[str, torch.Tensor] = {}
        self._prev_z: torch.Tensor | None = None  # (C, 6, h, w) the last chunk's last pre-DiT latents
        self._chunks = 0
        self._offset = 0  # latents so far: the next chunk's first RoPE time position
        self._pushed = 0
        self._emitted = 0
        self._finished = False

    @property
    def held(self) -> int:
        """Input frames pushed but not yet output."""
        return self._pushed - self._emitted

    # --- feeding ---------------------------------------------------------------------------------------------

    def push(self, frames: torch.Tensor) -> torch.Tensor:
        """frames (T, 3, h, w) at lq_hw, float in [0, 1] or uint8 -> the frames now final (T', 3, H, W) float32
        in [0, 1], T' possibly 0."""
        if self._finished:
            raise RuntimeError("SRStream: push after finish")
        if frames.dim() != 4 or frames.shape[1] != 3 or tuple(frames.shape[2:]) != self.lq_hw:
            raise ValueError(f"SRStream: frames {list(frames.shape)}, expected (T, 3, {self.lq_hw[0]}, "
                             f"{self.lq_hw[1]})")
        x = frames[:, :, :self._crop[0], :self._crop[1]].to(self.device)  # (T, 3, h8, w8) top-left crop
        x = x.to(self.dtype) if x.dtype == torch.uint8 else x.to(self.dtype) * 255  # (T, 3, h8, w8) on 0..255
        x = x.contiguous()  # as the official preprocessing: a strided or channels-last input picks other kernels
        self._pending = torch.cat([self._pending, x])
        self._pushed += frames.shape[0]
        out = []
        with torch.no_grad():
            while self._pending.shape[0] > self._next_full():  # more follows: this group is not LAST
                out.append(self._run(self._next_full(), last=False))
        return self._emit(out)

    def finish(self) -> torch.Tensor:
        """Run the rest as the LAST chunk (after any chunk the padding to 4a + 1 adds). -> (T', 3, H, W)."""
        if self._finished:
            raise RuntimeError("SRStream: finish called twice")
        self._finished = True
        n = self._pending.shape[0]
        out = []
        if n:
            padded = 4 * (-(-(n - 1) // 4)) + 1
            self._pending = torch.cat([self._pending, self._pending[-1:].expand(padded - n, -1, -1, -1)])
            with torch.no_grad():
                while self._pending.shape[0] > self._next_full():
                    out.append(self._run(self._next_full(), last=False))
                out.append(self._run(self._pending.shape[0], last=True))
        return self._emit(out)

    def _next_full(self) -> int:
        return FIRST if self._chunks == 0 else CLIP

    def _emit(self, out: list[torch.Tensor]) -> torch.Tensor:
        """Concatenate the chunks' frames, dropping those past the frames pushed (the padding's)."""
        H, W = self.out_hw
        y = torch.cat(out) if out else torch.empty(0, 3, H, W, device=self.device)
        y = y[:max(0, self._pushed - self._emitted)].float()  # (T', 3, H, W)
        self._emitted += y.shape[0]
        return y

    # --- one chunk -------------------------------------------------------------------------------------------

    def _upscale(self, x: torch.Tensor) -> torch.Tensor:
        """(T, 3, h8, w8) on 0..255 -> (T, 3, H + pad, W + pad) in [0, 1] (official preprocess_clip_uint8)."""
        if tuple(x.shape[2:]) != self.out_hw:
            x = F.interpolate(x, size=self.out_hw, mode="bilinear", align_corners=False)  # (T, 3, H, W)
        x = x / 255.0
        return F.pad(x, (0, self._pad[1], 0, self._pad[0]))  # (T, 3, H', W')

    def _run(self, n: int, last: bool) -> torch.Tensor:
        """The next chunk of the pending frames' first n (LAST: all of them). -> its output frames (T', 3, H, W)."""
        m = self.models
        x = self._upscale(self._pending[:n])  # (n, 3, H', W')
        self._pending = self._pending[n:]
        if last:
            x = torch.cat([x, x[-1:].expand(LAST_PAD_FRAMES, -1, -1, -1)])  # (n + 3, 3, H', W')
        z, self._enc = m.reae.encode(x, self._enc)  # (L, C, h, w)
        z = z.transpose(0, 1)  # (C, L, h, w)
        L = z.shape[1]
        if last:
            pad = LATENTS + 1 - L
            if self._prev_z is not None:
                before = self._prev_z[:, LATENTS - pad:]  # (C, pad, h, w)
            else:
                before = z.new_zeros(z.shape[0], pad, *z.shape[2:])  # (C, pad, h, w)
            zz = torch.cat([before, z], dim=1)  # (C, 7, h, w)
            den = (zz - m.dit(zz, self._cond, max(0, self._offset - pad)))[:, pad:]  # (C, L, h, w)
        else:
            k = self.overlap if self._prev_z is not None else 0  # the official overlap: MIDDLE chunks only
            zz = torch.cat([self._prev_z[:, LATENTS - k:], z], dim=1) if k else z  # (C, k + L, h, w)
            den = (zz - m.dit(zz, self._cond, self._offset - k))[:, k:]  # (C, L, h, w)
            self._prev_z = z[:, -LATENTS:].clone()  # (C, 6, h, w) pre-DiT, as the official LAST pads with
        self._offset += L
        y, self._dec = m.reae.decode(den.transpose(0, 1), self._dec)  # (4L, 3, H', W')
        if self._chunks == 0:
            y = y[m.reae.params.trim_frames:]  # the first decode's causal padding
        self._chunks += 1
        return y[:, :, :self.out_hw[0], :self.out_hw[1]]  # (T', 3, H, W)

    # --- resume ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything carried, tensors only: the held-back input frames, the ReAE states, the previous chunk's
        latents, the counters and the stream's shape (checked on load)."""
        d = {"pending": self._pending,
             "counters": torch.tensor([self._chunks, self._offset, self._pushed, self._emitted, int(self._finished)]),
             "shape": torch.tensor([*self.lq_hw, self.scale, self.overlap])}
        d.update({f"reae.{k}": v for k, v in {**self._enc, **self._dec}.items()})
        if self._prev_z is not None:
            d["prev_z"] = self._prev_z
        # Contiguous copies: a safetensors checkpoint refuses strided tensors, and the stream goes on changing its own.
        return {k: v.clone(memory_format=torch.contiguous_format) for k, v in d.items()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        """Continue from a `state_dict()` of a stream of the same models, frame size and scale."""
        shape = [int(v) for v in d["shape"]]
        if shape != [*self.lq_hw, self.scale, self.overlap]:
            raise ValueError(f"SRStream: state of frames {shape[:2]} at x{shape[2]} overlap {shape[3]}, this stream "
                             f"is {list(self.lq_hw)} at x{self.scale} overlap {self.overlap}")
        self._chunks, self._offset, self._pushed, self._emitted, finished = (int(v) for v in d["counters"])
        self._finished = bool(finished)
        self._pending = d["pending"].to(self.device, self.dtype).clone()
        self._enc = {k[5:]: v.to(self.device).clone() for k, v in d.items() if k.startswith("reae.enc.")}
        self._dec = {k[5:]: v.to(self.device).clone() for k, v in d.items() if k.startswith("reae.dec.")}
        self._prev_z = d["prev_z"].to(self.device).clone() if "prev_z" in d else None
