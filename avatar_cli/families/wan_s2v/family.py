"""The wan-s2v family behind the renderer's interface: the official Wan2.2-S2V clip loop, chunk by chunk.

A chunk is one official clip: 80 frames (20 latents) at 16 fps, sampled with 40 UniPC steps, CFG 4.5 on the
negative prompt and zeroed audio. Clip 0 has no motion tokens; every later clip is conditioned on the last 73
frames decoded before it, re-encoded by the VAE into 19 motion latents exactly as the official code makes them.

Where we differ from the official loop, and why:
- Lip sync. The official pipeline keeps frames 3..79 of clip 0 (they follow the reference frame), but gives
  clip r the audio of frames 80r..80r+79, so its output leads the audio by 3 frames (187.5 ms; `WanS2V.generate`
  in wan/speech2video.py, `image[:, :, 3:]`).
  Here clip r's window starts 3 frames earlier, at 80r - 3 (clip 0: audio frames -3..76, zero features before
  the start, as past the end): output frame k is generated with the audio of frame k, i.e. shows audio time
  k / fps, for every k.
- Decoding. The official code decodes [19 motion latents + 20 new] from a cleared VAE cache for every clip and
  keeps the last 80 frames. Here the decoder's causal cache carries from clip to clip: one continuous decode of
  [ref latent, clip 0, clip 1, ...], which the streaming decode reproduces bit for bit
  (tests/test_wan_vae.py), and which costs 20 latents per clip instead of 39.
- Length. Exactly round(duration x fps) frames: the last clip's surplus is not published (the official code
  renders whole clips and cuts at the shorter stream when muxing).
- Noise is drawn on the CPU from Generator(seed + r), float32, as the official code draws it on its device: so
  it is the same on every device and rank count.
- Reference. Resized as the official code does (PIL, 8 bits, centre crop: fit_reference), except where its crop
  would pad with black: there the picture is scaled up to cover the frame.

Rolling state (all of it saved at every resume point, so a resumed render is bit-identical): the decoder
cache (`vae.*`) and the next clip's motion latents (`motion`). At 480p the decoder cache is ~3.5 GB in float32
(vae.py); the motion latents 7 MB.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from avatar_cli.families.base import (AudioSource, Chunk, Family, Final, Geometry, Models, ParallelPlan, RollingState,
                                      Sampling, Step)
from avatar_cli.families.wan_s2v.audio import SAMPLE_RATE, LiveAudioFeatures, WindowedAudioFeatures, normalization_stats
from avatar_cli.families.wan_s2v.components import UMT5Text, Wav2Vec2Audio
from avatar_cli.families.wan_s2v.dit import WanS2VDiT
from avatar_cli.families.wan_s2v.model_dir import WanS2VConfig
from avatar_cli.families.wan_s2v.parallel import SequenceParallelWanDiT
from avatar_cli.families.wan_s2v.sampler import sample_unipc
from avatar_cli.families.wan_s2v.text import S2V_NEGATIVE_PROMPT, clean_prompt, load_tokenizer, tokenize
from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAECache
from avatar_cli.media.image import fit_image_pil
from avatar_cli.runtime.rings import RingStore

NATIVE_FPS = 16
CLIP_FRAMES = 80  # official infer_frames
LEAD = 3  # frames the official clip 0 drops after the reference frame
DEFAULT_AREA = 480 * 832  # the official "480p" max_area
SIZE_DIVISOR = 64  # the official area rule pads sizes to multiples of 64
STRIDE = 16  # a size must be a multiple of VAE stride 8 x patch 2
MIN_SIDE = 64  # FramePack's 4x motion tokens pool 8 x 8 latents
PUT_LATENTS = 2  # latents decoded per hand-off to the encoder: 8 frames, a quick first frame
# What `runtime.weights: fp8 | int8` quantizes (runtime/quantize.py): the Linears of the DiT's 40 blocks and of its 12
# audio injectors' cross-attentions (15.3 of its 16.3 B parameters). Left in the runtime dtype: the embeddings, the
# time embedding and projection, the head and the audio encoder (the official fp32 islands), the injectors' AdaIN
# Linears (they scale and shift whole frames of tokens), the norms.
# And umT5's 24 blocks: their attention (q, k, v, o) and gated feed-forward (wi_0, wi_1, wo) Linears, 4.63 of its
# 5.68 B parameters. Left as loaded: the token embedding (a lookup, 1.05 B: a row's error would be that token's alone,
# but torchao quantizes Linears only), the per-layer relative-position bias tables (tiny, added to every attention
# score) and the RMS norms. Its encodings are cached and served (text cache, text service) under a key that names
# the format (prompts/identity.py: "bfloat16+int8"), so a quantized encoder's never stand in for a bf16 one's.
QUANTIZED = (("dit", ("blocks", "audio_injector.injector")), ("text", ("blocks",)))


def size_less_than_area(h: int, w: int, target_area: int, divisor: int = SIZE_DIVISOR) -> tuple[int, int]:
    """The official `get_size_less_than_area` (wan/speech2video.py): the largest scale of (h, w) whose size,
    rounded up to multiples of `divisor`, has an area <= target_area. -> (H, W), both multiples of divisor."""
    if h * w <= target_area:
        min_scale, max_scale = 0.1, 1.0
    else:
        d = divisor - 1
        b, a, c = d * (h + w), h * w, d ** 2 - target_area
        min_scale = (-b + math.sqrt(b ** 2 - 2 * a * c)) / (2 * a)
        max_scale = math.sqrt(target_area / (h * w))
    for i in range(100):
        scale = max_scale - (max_scale - min_scale) * i / 100
        nh, nw = int(h * scale), int(w * scale)
        ph, pw = nh + (divisor - nh % divisor) % divisor, nw + (divisor - nw % divisor) % divisor
        if ph * pw <= target_area:
            return ph, pw
    # The official fallback: the aspect ratio at the target area, rounded down to the divisor.
    ratio = w / h
    th = int(math.sqrt(target_area / ratio)) // divisor * divisor
    tw = int(th * ratio) // divisor * divisor
    return max(divisor, th), max(divisor, tw)


class WanS2VFamily(Family):
    name = "wan-s2v"
    needs = {Step.reference: ("vae",), Step.prompt: ("text",), Step.context: ("audio",), Step.a2v: ("dit",),
             Step.sr: (), Step.decode: ("vae",)}
    decode_feeds_back = True  # the next clip's motion latents are re-encoded decoded frames
    # 1: the last audio layer is wav2vec2's post-layer-norm output, as the official code reads it;
    # 2: the reference is resized as the official code resizes it (PIL, then 8 bits; fit_reference)
    revision = 2
    # Audio still arriving (a live session) has no whole to normalise over: audio.LiveAudioFeatures instead.
    LIVE_LOOKAHEAD_S = 0.5
    LIVE_WINDOW_S = 10.0

    def __init__(self, config: WanS2VConfig):
        self.config = config
        self._tokenizer = None
        self._audio: tuple[AudioSource, WindowedAudioFeatures] | None = None

    # --- what the family is ----------------------------------------------------------------------------

    @property
    def components(self) -> Mapping[str, tuple[type[nn.Module], Any]]:
        c = self.config
        return {"dit": (WanS2VDiT, c.dit), "vae": (WanVAE, c.vae), "text": (UMT5Text, c.t5),
                "audio": (Wav2Vec2Audio, None)}

    @property
    def geometry(self) -> Geometry:
        h, w = size_less_than_area(9, 16, DEFAULT_AREA)  # a 16:9 picture at the 480p area: 448 x 832
        return Geometry(kinds=("N",), native_size=(w, h), native_fps=NATIVE_FPS, sample_rate=SAMPLE_RATE)

    @property
    def parallel(self) -> ParallelPlan:
        # The VAE and wav2vec2 stay float32 as in the official code (its VAE wrapper and audio encoder never
        # leave float32); the DiT and umT5 take the runtime's dtype (bf16 on GPUs).
        return ParallelPlan(sharded=("dit", "text"), sequence_parallel="dit", sp_wrap=SequenceParallelWanDiT,
                            sp_heads=self.config.dit.num_heads, float32=("vae", "audio"), quantized=QUANTIZED)

    def job_defaults(self) -> dict[str, Any]:
        return {"video.fps": NATIVE_FPS, "sampling.steps": 40, "sampling.guidance": 4.5, "sampling.shift": 3.0,
                "chunking.frames": CLIP_FRAMES, "chunking.motion_frames": self.config.dit.motion_frames,
                "chunking.transitions": False,
                "live.chunk_frames": "null"}  # a session's clips are the render's (a clip's length is the model's)

    def frame_size(self, image_wh: tuple[int, int], requested: tuple[int, int] | None) -> tuple[int, int]:
        """The job's video.width/height when set (multiples of 16), else the official area rule at 480p."""
        if requested is not None:
            w, h = requested
            if min(w, h) < MIN_SIDE:
                raise ValueError(f"video.width/height {w}x{h}: the wan-s2v family generates at least {MIN_SIDE} "
                                 f"pixels a side (its coarsest motion tokens pool 8 x 8 latents)")
            if w % STRIDE or h % STRIDE:
                raise ValueError(f"video.width/height {w}x{h}: the wan-s2v family generates sizes that are "
                                 f"multiples of {STRIDE} (VAE stride 8 x patch 2); e.g. "
                                 f"{w // STRIDE * STRIDE or STRIDE}x{h // STRIDE * STRIDE or STRIDE}")
            return w, h
        h, w = size_less_than_area(image_wh[1], image_wh[0], DEFAULT_AREA)
        return w, h

    def fit_reference(self, image: np.ndarray, width: int, height: int) -> torch.Tensor:
        """The official reference preprocessing (wan/speech2video.py): the shorter side resized with PIL, rounded to
        8 bits, centre-cropped (media.image.fit_image_pil; it scales up instead of padding where the official crop
        would pad) -> (3, height, width) in [-1, 1]."""
        return fit_image_pil(image, width, height)

    def plan(self, chunking: Any, total_frames: int) -> list[Chunk]:
        """Clip r: window [F r - 3, F r - 3 + F), keeping its frames from 0 on, up to the video's end."""
        n = chunking.frames
        chunks, r = [], 0
        while True:
            start = n * r - LEAD
            s, e = max(0, start), min(start + n, total_frames)
            chunks.append(Chunk("N", r, start, n, (), (s, e), e))
            if e >= total_frames:
                return chunks
            r += 1

    def check_job(self, chunking: Any, sampling: Sampling) -> None:
        c = chunking
        if c.transitions is True:  # auto means none here
            raise ValueError("chunking.transitions: the wan-s2v family has no I chunks (each clip continues from "
                             "the re-encoded frames before it); set chunking.transitions: false")
        if c.motion_frames != self.config.dit.motion_frames:
            raise ValueError(f"chunking.motion_frames: {c.motion_frames}, but this model continues from "
                             f"{self.config.dit.motion_frames} frames (its config.json)")
        least = (c.motion_frames + LEAD + 3) // 4 * 4  # clip 0 must leave 73 frames after its drop
        if c.frames % 4 or c.frames < least:
            raise ValueError(f"chunking.frames: {c.frames}: a wan-s2v clip is a multiple of 4 frames (one latent "
                             f"per 4), at least {least} (the next clip continues from its last "
                             f"{c.motion_frames}); the release uses 80")

    # --- once per job ----------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.files["tokenizer"].root)
        return self._tokenizer

    def reference(self, models: Models, image: torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict:
        """image (3, H, W) in [-1, 1] -> the reference latent (16, 1, H/8, W/8)."""
        vae = models["vae"]
        return {"ref": vae.encode(image[None, :, None].to(device))[0]}  # (16, 1, h, w) float32

    def _encode_text(self, text: nn.Module, prompt: str, device: torch.device) -> torch.Tensor:
        ids, mask = tokenize(self.tokenizer, [prompt], self.config.dit.text_len)  # (1, L), (1, L)
        n = int(mask.sum())
        return text(ids.to(device), mask.to(device))[0, :n]  # (n, text_dim), trimmed as the official code does

    def prompt(self, models: Models, prompt: str, device: torch.device, dtype: torch.dtype) -> dict:
        """The prompt and the S2V negative prompt (the unconditional branch of CFG), each (L, text_dim)."""
        text = models["text"]
        return {"text": self._encode_text(text, prompt, device),
                "negative": self._encode_text(text, S2V_NEGATIVE_PROMPT, device)}

    def prompt_overflow(self, prompt: str) -> tuple[int, int] | None:
        limit = self.config.dit.text_len
        cleaned = clean_prompt(prompt)
        if 2 * len(cleaned) + 1 <= limit:  # a piece is at least a character or a word-start mark, + EOS
            return None  # (so a short prompt never loads the tokenizer)
        n = len(self.tokenizer(cleaned, add_special_tokens=True, verbose=False).input_ids)  # EOS included
        return (n, limit) if n > limit else None

    def prompt_tensors(self, out: dict) -> dict[str, torch.Tensor]:
        return {"text": out["text"], "negative": out["negative"]}  # (L, text_dim), (L', text_dim)

    def prompt_from_tensors(self, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict:
        return {"text": tensors["text"].to(device), "negative": tensors["negative"].to(device)}  # as encoded

    # --- per chunk ---------------------------------------------------------------------------------------

    def _features(self, models: Models, audio: AudioSource) -> WindowedAudioFeatures | LiveAudioFeatures:
        """The job's windowed wav2vec2 features (built once per audio source: one pass for the statistics); for
        audio of unknown length (a live session's, which has no `total`), the live features."""
        if self._audio is None or self._audio[0] is not audio:
            enc = models["audio"]
            if not hasattr(audio, "total"):
                feats = LiveAudioFeatures(enc.model, enc.extractor, audio.read, window_s=self.LIVE_WINDOW_S,
                                          lookahead_s=self.LIVE_LOOKAHEAD_S)
            else:
                mean, std = normalization_stats(audio.stream())
                feats = WindowedAudioFeatures(enc.model, enc.extractor, audio.read, audio.total, mean=mean, std=std)
            self._audio = (audio, feats)
        return self._audio[1]

    def audio_lookahead_s(self, models: Models) -> float:
        # The live features' window ends LIVE_LOOKAHEAD_S past a frame's position, plus two wav2vec2 frames and
        # one frame's receptive field (< 0.1 s): all of it must have arrived, or the features would depend on when.
        return self.LIVE_LOOKAHEAD_S + 0.1

    def audio_lookbehind_s(self, models: Models) -> float:
        return self.LIVE_WINDOW_S + 0.1  # the live features' window reaches that far back from its end

    def clip_audio(self, models: Models, audio: AudioSource, start: int, length: int, fps: float) -> torch.Tensor:
        """(1, 25, dim, length) features of video frames start .. start + length - 1; zeros outside the audio."""
        feats = self._features(models, audio)
        lo = max(0, start)
        inside = feats.clip(lo, start + length - lo, fps) if start + length > lo else None  # (1, 25, dim, n)
        if lo == start:
            return inside
        pad = torch.zeros(1, inside.shape[1], inside.shape[2], lo - start, device=inside.device)
        return torch.cat([pad, inside], dim=-1)  # (1, 25, dim, length)

    def release_audio(self, models: Models, audio: AudioSource, frame: int, fps: float) -> None:
        # The windowed features re-read at most one window (30 s) back from a frame's own samples.
        before = int(max(0, frame) / fps * SAMPLE_RATE) - 31 * SAMPLE_RATE
        if before > 0:
            audio.release(before)

    def context(self, models: Models, chunk: Chunk, audio: AudioSource, fps: float, text: dict,
                state: RollingState, seed: int, device: torch.device, dtype: torch.dtype) -> dict:
        """Audio features, the motion latents (None on clip 0) and the text of one clip."""
        return {"audio": self.clip_audio(models, audio, chunk.start, chunk.length, fps).to(device),
                "motion": None if chunk.index == 0 else state.tensors["motion"], "text": text["text"],
                "negative": text["negative"], "seed": seed + chunk.index, "latents": chunk.length // 4,
                "first": chunk.index == 0}

    def denoise(self, models: Models, inputs: dict, ref: dict, sampling: Sampling, state: RollingState,
                rings: RingStore = RingStore()) -> torch.Tensor:
        """UniPC steps with CFG on the negative prompt and zeroed audio -> the clip's latents (F, 16, h, w); on
        clip 0 preceded by the reference latent, where the decode timeline starts -> (1 + F, 16, h, w)."""
        dit, c, g = models["dit"], inputs, sampling.guidance
        r = ref["ref"]  # (16, 1, h, w) float32
        dtype = next(dit.parameters()).dtype
        gen = torch.Generator().manual_seed(c["seed"])  # the official per-clip seed (seed + r), drawn on the CPU
        noise = torch.randn((r.shape[0], c["latents"], *r.shape[-2:]), generator=gen)  # (16, F, h, w) float32
        noise = noise.to(r.device, dtype)
        motion = c["motion"]  # (16, 19, h, w) or None
        cond = torch.zeros_like(noise)  # (16, F, h, w): no pose video
        silent = torch.zeros_like(c["audio"])

        def flow(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # x (1, 16, F, h, w)
            v = dit(x[0], t, c["text"], r, motion, cond, c["audio"])  # (16, F, h, w) float32
            if g > 1:
                # What CFG changes in the official loop: only the text (negative prompt) and the audio (x 0).
                u = dit(x[0], t, c["negative"], r, motion, cond, silent)
                v = u + g * (v - u)
            return v[None]

        z = sample_unipc(flow, noise[None], sampling.steps, sampling.shift)[0]  # (16, F, h, w)
        if c["first"]:
            z = torch.cat([r.to(z.dtype), z], dim=1)  # (16, 1 + F, h, w)
        return z.transpose(0, 1)  # (F, 16, h, w): time first, as the pipeline holds latents

    def keep(self, chunk: Chunk, z: torch.Tensor, state: RollingState, chunking: Any) -> None:
        """Hold the whole clip's latents: its frames [keep) are decoded from all of them (a causal decode)."""
        s, e = chunk.keep
        state.held.append((s, e, z))

    # --- decode ------------------------------------------------------------------------------------------

    def is_decode_state(self, name: str) -> bool:
        """The decoder cache (`vae.*`), in both modes. The clip mode's `motion` is made by the decode too, but read by
        the next clip's context: that mode feeds back (decode_feeds_back) and never decodes in a worker."""
        return name.startswith("vae.")

    def decode(self, models: Models, final: Final, state: RollingState,
               put: Callable[[torch.Tensor], None]) -> int:
        """final.z: whole clips' latents in order, (n, 16, h, w); the first clip's start with the reference latent.
        Carries the decoder cache, puts frames [final.start, final.end), and makes the next clip's motion
        latents from the last 73 frames decoded."""
        vae, keep_last = models["vae"], self.config.dit.motion_frames
        cache = _cache_from(state)
        # A timeline's first latent (the reference) makes 1 frame, which is dropped with the LEAD after it.
        skip = 1 + LEAD if cache is None else 0
        z = final.z.transpose(0, 1)[None]  # (1, 16, n, h, w)
        # Fewer frames kept than the clip makes: the video's last clip. Decode only what is published and make
        # no motion latents: nothing follows it.
        n = z.shape[2]
        last = final.frames < (4 * (n - 1) - LEAD if skip else 4 * n)
        made, tail = 0, None
        for i in range(0, n, PUT_LATENTS):
            if last and made >= final.frames:
                break
            x, cache = vae.decode_stream(z[:, :, i:i + PUT_LATENTS], cache)  # (1, 3, T, H, W) float32
            x = x[0].transpose(0, 1)  # (T, 3, H, W)
            if not last:
                tail = x[-keep_last:] if tail is None else torch.cat([tail, x])[-keep_last:]  # (<=73, 3, H, W)
            x, skip = x[skip:], max(0, skip - x.shape[0])
            k = min(x.shape[0], final.frames - made)
            if k > 0:
                put(x[:k])
                made += k
        _cache_to(state, cache)
        if not last:
            # The official videos_last_frames: the last 73 frames (every clip has at least 73 after its drop),
            # re-encoded from a fresh encoder cache into the next clip's 19 motion latents.
            state.tensors["motion"] = vae.encode(tail.transpose(0, 1)[None])[0].contiguous()  # (16, 19, h, w)
        return made


def _cache_from(state: RollingState) -> WanVAECache | None:
    own = {k[4:]: v for k, v in state.tensors.items() if k.startswith("vae.")}
    return WanVAECache.from_tensors(own) if own else None


def _cache_to(state: RollingState, cache: WanVAECache) -> None:
    """Kept contiguous (a copy where a slot is a view or channels-last): a cache restored from a checkpoint is
    contiguous, and the convolutions pick their kernels, and so their roundings, by the input's memory layout;
    the live cache must be laid out exactly as the restored one for a resumed render to be bit-identical."""
    for k in [k for k in state.tensors if k.startswith("vae.")]:
        del state.tensors[k]
    state.tensors.update({f"vae.{k}": v.contiguous() for k, v in cache.tensors().items()})
