"""LiveAvatar's streaming mode of the wan-s2v family: the same Wan2.2-S2V weights (plus their LoRA, merged at load),
generated in blocks of 3 latent frames with 4 Euler steps, per-step key/value rings and an attention sink
(causal.py; their liveavatar/models/wan/causal_model_s2v.py `CausalWanModel_S2V`). A chunk is one block.

Blocks, frames and audio (their TPP pipeline, liveavatar/models/wan/causal_s2v_pipeline_tpp.py `generate`):
- Their decoder is primed once with the first PRIME_LATENTS = 7 motion latents (the reference picture repeated 73
  frames, encoded), output discarded: a timeline's first latent decodes to 1 frame, the next 6 to 4 each, so 25
  frames. After that every block's 3 latents decode to 12 frames. They drop the first 3 of block 0, so block 0
  yields 9 frames and block g >= 1 yields 12: 48 n - 3 frames for n clips of 4 blocks.
- Their decoded frame i (0..11) of block g is made with the audio of frame 12 g + i and published as output frame
  12 g + i - 3: the video leads the audio by 3 frames (187.5 ms), as in the official clip loop.
- Ours (the renderer's rule: output frame k shows audio time k / fps, no lead): block g's window starts 3 frames
  earlier, at 12 g - 3 (the plan of WanS2VFamily with 12-frame chunks): decoded frame i is timeline frame
  12 g - 3 + i and reads the audio of that same frame (zero features before the start and past the end). Block 0
  drops its first 3 frames as theirs does (timeline -3..-1), so it keeps 9: [0, 9), then block g keeps
  [12 g - 3, 12 g + 9) up to the video's end, round(duration x fps) frames in all. Only the last block's surplus
  is not published.
- Noise: clip r (4 blocks, their infer_frames 48) draws randn(16, 12, h, w) from a CPU Generator(seed + r) in
  float32 (theirs draws in bf16 on the GPU); block g = 4 r + b takes latent frames [3 b, 3 b + 3).
- The sink: prefilled once at block 0 with [reference latent | FramePack(motion latents)], and once more at
  block 4 (their clip 1) with the rolled sink frame, the first latent of block 0's final latents (their VAE rank's
  `block_latents[:, :, 0:1]`); the motion latents stay the job's. Videos of at most 4 blocks never refresh.
- The sink's RoPE offset: theirs is Python's random.randint(4, 30) on every forward; here step s of block g uses
  `sink_offset(seed, g, s)`, from sha256 (the same job renders the same frames, whatever ran before in the process).
- Guidance: none. The mode's model samples with one forward per step (their scripts pass guide scale 0, which their
  pipeline never reads); a job asking for sampling.guidance != 1 is refused rather than silently ignored.
- Decode: the decoder cache carries from block to block (`vae.*`, kept contiguous as WanS2VFamily keeps it, for a
  bit-identical resume), one latent at a time, each latent's 4 frames handed to the encoder as soon as they exist:
  the first frame is out after block 0's first latent. Before it come the reference's two encodes (1 frame, and
  the 73 repeated frames of the motion latents), the sink prefill, block 0's steps and the 7 priming latents'
  decode: on the tiny CPU model the VAE work dominates, at full size the DiT's.

Rolling state (RollingState.tensors), all of it saved at every resume point, so a resumed render is bit-identical
(tests/test_wan_live.py kills a render with SIGKILL and resumes it):
- `kv.k`, `kv.v`: the per-step rings (steps, layers, 12 latent frames of tokens, heads, head_dim) in the DiT's dtype;
- `kv.sink_k`, `kv.sink_v`: the sink (layers, sink tokens, heads, head_dim);
- `vae.*`: the decoder cache, float32;
- `sink_frame` (16, 1, h, w): block 0's first latent, from block 0 until block 4 prefills the sink with it.
Nothing grows with the video: after block 4 the state's bytes are constant (tested).

Its size at full size (Wan2.2-S2V-14B, 704x384, latent 48x88, bf16 DiT): 4 rings 41.52 GB (10.38 GB a step; their
TPP ranks allocate 3000 sink slots per step on top, causal.py's docstring), the sink 2.16 GB (2640 tokens, shared by
the steps), the decoder cache 2.56 GB float32: 46.2 GB per resume point. Points that large are paced
(pipeline/checkpoint.py: writing them takes at most BUDGET of the render's time, and only the newest 2 are kept), so
a crash redoes more blocks; still, 46 GB a point is a design for tests and tiny models, not for full size. The
alternative, not implemented here: keep only the last 9 final latents (the ring's other 3 blocks: 1.2 MB bf16), the
sink frame and ~21 latents for the decoder (its causal receptive field in time; 2.8 MB), and on resume re-prefill:
one sink prefill, per step s one forward over those 9 latents re-noised to sigma_s with their own (seeded) noise to
refill ring s, and a decode of the 21 latents to re-prime the decoder: about 3 blocks' work, 12 block-sized forwards
(~3 s on one GPU at their 45 fps, i.e. ~0.27 s a block-forward; ~0.8 s with their 4 step ranks each refilling its
own ring) and a 21-latent decode, for a few MB a point. It is not bit-identical: the rings then hold keys of
re-noised final latents, where the originals hold the keys of each step's actual input, which depended on rings
reaching back to the first block; a resumed video would differ after the resume point (the motion continues; the
pixels do not match the uninterrupted render).

Several ranks (runtime.parallel): `sequence` splits every block's forward over the ranks (Ulysses over heads,
live_parallel.py, wired through StreamingSequenceParallel as the plan's sp_wrap): each rank keeps its heads of the
rings and the sink, and after every block the caches are gathered whole into rank 0's state for its resume point
(so a checkpoint does not depend on the rank count; a resumed render cuts them again). `steps` is the timestep
pipeline (pipeline/steps.py): block_noise, denoise_step and block_latents run on separate ranks.
"""

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from avatar_cli.families.base import (AudioSource, Chunk, Family, Final, Geometry, Models, ParallelPlan, RollingState,
                                      Sampling)
from avatar_cli.families.wan_s2v.audio import SAMPLE_RATE
from avatar_cli.families.wan_s2v.causal import (FRAMES_PER_BLOCK, RING_FRAMES, SINK_OFFSET_RANGE, CausalCaches,
                                                block_inputs, euler_step, prefill_sink)
from avatar_cli.families.wan_s2v.family import (LEAD, NATIVE_FPS, QUANTIZED, WanS2VFamily, _cache_from, _cache_to,
                                                size_less_than_area)
from avatar_cli.families.wan_s2v.live_parallel import SequenceParallelStream
from avatar_cli.families.wan_s2v.model_dir import WanS2VConfig
from avatar_cli.runtime.rings import RingStore

BLOCK_FRAMES = 4 * FRAMES_PER_BLOCK  # 12 video frames a block
BLOCKS_PER_CLIP = RING_FRAMES // FRAMES_PER_BLOCK  # 4: their clip (infer_frames 48) = one ring
PRIME_LATENTS = 7  # motion latents their VAE rank decodes (and discards) before block 0
PRIME_FRAMES = 1 + 4 * (PRIME_LATENTS - 1)  # 25: a timeline's first latent makes 1 frame
LIVE_AREA = 720 * 400  # their --size "720*400": 704x384 for 16:9
MODES = ("clip", "streaming")
CACHE_PREFIX = "kv."
SINK_FRAME = "sink_frame"


def sink_offset(seed: int, block: int, step: int) -> int:
    """The sink RoPE offset of step `step` of block `block` (counted from the stream's start), in LiveAvatar's range
    [4, 30]: from sha256 of the job seed, the block and the step, so it never depends on what else ran."""
    lo, hi = SINK_OFFSET_RANGE
    digest = hashlib.sha256(f"liveavatar-sink-offset:{seed}:{block}:{step}".encode()).digest()
    return lo + int.from_bytes(digest[:8], "little") % (hi - lo + 1)


def clip_noise(seed: int, clip: int, z_dim: int, lat_h: int, lat_w: int) -> torch.Tensor:
    """Their clip r's noise: randn(16, 12, h, w) from Generator(seed + r), drawn on the CPU in float32."""
    gen = torch.Generator().manual_seed(seed + clip)
    return torch.randn((z_dim, RING_FRAMES, lat_h, lat_w), generator=gen)  # (16, 12, h, w)


class LiveAvatarFamily(WanS2VFamily):
    """The wan-s2v family's streaming mode (module docstring). Same components, prompt encoding (the text cache
    entries are shared with the clip mode), audio features, size rule and chunk plan as WanS2VFamily, with 12-frame
    chunks; its own defaults, reference conditioning, denoising and decode."""

    mode = "streaming"
    decode_feeds_back = False  # the rolled sink frame is a denoised latent, not a decoded frame

    @property
    def geometry(self) -> Geometry:
        h, w = size_less_than_area(9, 16, LIVE_AREA)  # a 16:9 picture at their area: 384 x 704
        return Geometry(kinds=("N",), native_size=(w, h), native_fps=NATIVE_FPS, sample_rate=SAMPLE_RATE)

    @property
    def parallel(self) -> ParallelPlan:
        # The DiT replicated and each block split over the ranks (Ulysses, live_parallel.py); umT5 sharded as in the
        # clip mode (its forward is whole), replicated like the DiT when runtime.weights quantizes both (QUANTIZED).
        # The timestep pipeline places nothing across ranks (pipeline/steps.py).
        heads = self.config.dit.num_heads if self.config is not None else 1
        return ParallelPlan(sharded=("text",), sequence_parallel="dit", sp_wrap=StreamingSequenceParallel,
                            sp_heads=heads, float32=("vae", "audio"), quantized=QUANTIZED)

    def job_defaults(self) -> dict[str, Any]:
        return {"video.fps": NATIVE_FPS, "sampling.steps": 4, "sampling.guidance": 1.0, "sampling.shift": 3.0,
                "chunking.frames": BLOCK_FRAMES, "chunking.motion_frames": 0, "chunking.transitions": False,
                "live.chunk_frames": "null"}  # a session's blocks are the render's (the block is fixed)

    def frame_size(self, image_wh: tuple[int, int], requested: tuple[int, int] | None) -> tuple[int, int]:
        """The job's video.width/height when set (WanS2VFamily's rules), else their area rule at 720x400."""
        if requested is not None:
            return super().frame_size(image_wh, requested)
        h, w = size_less_than_area(image_wh[1], image_wh[0], LIVE_AREA)
        return w, h

    def check_job(self, chunking: Any, sampling: Sampling) -> None:
        c = chunking
        if c.transitions is True:  # auto means none here
            raise ValueError("chunking.transitions: the wan-s2v streaming mode has no I chunks (each block continues "
                             "from the key/value caches); set chunking.transitions: false")
        if c.motion_frames:
            # Not the sink's 73 motion frames: those are the reference's, their count from config.json.
            raise ValueError(f"chunking.motion_frames: {c.motion_frames}: a wan-s2v streaming block continues from "
                             "the key/value caches, not from re-encoded frames; set chunking.motion_frames: 0")
        if c.frames != BLOCK_FRAMES:
            raise ValueError(f"chunking.frames: {c.frames}: a wan-s2v streaming block is {FRAMES_PER_BLOCK} latent "
                             f"frames = {BLOCK_FRAMES} frames; set chunking.frames: {BLOCK_FRAMES}")
        if sampling.guidance != 1.0:
            raise ValueError(f"sampling.guidance: {sampling.guidance:g}: the wan-s2v streaming mode samples without "
                             "guidance (one forward per step, as LiveAvatar); set sampling.guidance: 1.0")
        if sampling.steps < 1:
            raise ValueError(f"sampling.steps: {sampling.steps}: the streaming mode needs at least 1 step")

    # --- once per job ----------------------------------------------------------------------------------

    def reference(self, models: Models, image: torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict:
        """image (3, H, W) in [-1, 1] -> the reference latent (16, 1, h, w) (their TPP: a 1-frame encode) and the
        motion latents (16, 19, h, w): the picture repeated motion_frames times, encoded, as their pipeline makes
        them (the sink's FramePack input and the decoder's priming)."""
        vae = models["vae"]
        x = image[None, :, None].to(device)  # (1, 3, 1, H, W)
        ref = vae.encode(x)[0]  # (16, 1, h, w) float32
        motion = vae.encode(x.expand(-1, -1, self.config.dit.motion_frames, -1, -1))[0]  # (16, 19, h, w)
        return {"ref": ref, "motion": motion}

    # --- per chunk ---------------------------------------------------------------------------------------

    def context(self, models: Models, chunk: Chunk, audio: AudioSource, fps: float, text: dict,
                state: RollingState, seed: int, device: torch.device, dtype: torch.dtype) -> dict:
        """The block's audio features (its own 12 frames: no audio crosses blocks in their model), its text, seed
        and index. The rolling state, whose caches the block's denoising reads and writes, is passed to it."""
        return {"audio": self.clip_audio(models, audio, chunk.start, chunk.length, fps).to(device),
                "text": text["text"], "seed": seed, "block": chunk.index}

    def denoise(self, models: Models, inputs: dict, ref: dict, sampling: Sampling, state: RollingState,
                rings: RingStore = RingStore()) -> torch.Tensor:
        """One block: the sink prefilled (block 0) or refreshed with the rolled sink frame (block 4), then the Euler
        steps through the per-step rings -> the block's latents (3, 16, h, w); block 0's preceded by the 7 motion
        latents the decoder is primed with, where the decode timeline starts -> (10, 16, h, w). The same three
        pieces the timestep pipeline (pipeline/steps.py) runs on separate ranks."""
        dit = models["dit"]
        x = self.block_noise(inputs, ref, next(dit.parameters()).dtype)  # (16, 3, h, w)
        for step in range(sampling.steps):
            x = self.denoise_step(models, inputs, ref, x, step, sampling, state, rings=rings)  # (16, 3, h, w)
        sp = getattr(dit, "stream", None)
        if sp is not None:  # rank 0's state holds the whole caches, for its resume point; the others keep their heads
            whole = sp.gather_caches(self._caches(state, sp.model, sampling.steps, 0, 0, x.dtype, x.device, rings,
                                                  sp), device=x.device)
            if whole is not None:
                state.tensors.update({CACHE_PREFIX + n: t for n, t in whole.tensors().items()})
        return self.block_latents(inputs, ref, x)

    # --- a block in pieces: its noise, each denoising step, its latents --------------------------------------

    def block_noise(self, inputs: dict, ref: dict, dtype: torch.dtype) -> torch.Tensor:
        """Block g's noise (16, 3, h, w): frames [3 b, 3 b + 3) of its clip's noise (g = 4 clip + b)."""
        r = ref["ref"]  # (16, 1, h, w)
        clip, b = divmod(inputs["block"], BLOCKS_PER_CLIP)
        noise = clip_noise(inputs["seed"], clip, r.shape[0], r.shape[-2], r.shape[-1])  # (16, 12, h, w)
        return noise[:, FRAMES_PER_BLOCK * b:FRAMES_PER_BLOCK * (b + 1)].to(r.device, dtype)  # (16, 3, h, w)

    def denoise_step(self, models: Models, inputs: dict, ref: dict, x: torch.Tensor, step: int, sampling: Sampling,
                     state: RollingState, own_ring: bool = False, rings: RingStore = RingStore()) -> torch.Tensor:
        """Denoising step `step` of the block: x (16, 3, h, w) -> (16, 3, h, w). The sink is prefilled first when the
        state's is empty (block 0) or when the rolled sink frame waits in the state (block 4). own_ring: the state
        holds this step's ring alone (a timestep-pipeline rank), not one per step. rings: where the caches live."""
        g = inputs["block"]
        sp = getattr(models["dit"], "stream", None)  # the ranks split each block (StreamingSequenceParallel)
        dit = sp.model if sp is not None else models["dit"]
        r = ref["ref"]  # (16, 1, h, w) float32
        dtype = next(dit.parameters()).dtype
        caches = self._caches(state, dit, 1 if own_ring else sampling.steps, r.shape[-2], r.shape[-1], dtype, r.device,
                              rings, sp)
        prefill = functools.partial(sp.prefill_sink, caches) if sp is not None else functools.partial(prefill_sink, dit,
                                                                                                      caches)
        if caches.sink_k.shape[1] == 0:
            prefill(r, ref["motion"], inputs["text"])
        elif g == BLOCKS_PER_CLIP and SINK_FRAME in state.tensors:
            prefill(state.tensors.pop(SINK_FRAME), ref["motion"], inputs["text"])
        if "block_inputs" not in inputs:  # the text and audio tokens the block's steps share
            inputs["block_inputs"] = block_inputs(dit, inputs["text"], inputs["audio"], x.shape[1])
        offset = sink_offset(inputs["seed"], g, step)
        if sp is not None:
            x = sp.euler_step(caches, step, sampling.steps, x, g, inputs["block_inputs"], offset,
                              shift=sampling.shift)  # (16, 3, h, w)
        else:
            x = euler_step(dit, caches, step, sampling.steps, x, g, inputs["block_inputs"], offset,
                           shift=sampling.shift, ring=0 if own_ring else step)  # (16, 3, h, w)
        # The rings were written in place; the sink is new after a prefill.
        state.tensors.update({CACHE_PREFIX + n: t for n, t in caches.tensors().items()})
        return x

    def block_latents(self, inputs: dict, ref: dict, x: torch.Tensor) -> torch.Tensor:
        """The denoised block x (16, 3, h, w) -> (3, 16, h, w), time first as the pipeline holds latents; block 0's
        after the decoder's 7 priming latents -> (10, 16, h, w)."""
        if inputs["block"] == 0:
            x = torch.cat([ref["motion"][:, :PRIME_LATENTS].to(x.dtype), x], dim=1)  # (16, 7 + 3, h, w)
        return x.transpose(0, 1)

    # --- the timestep pipeline (pipeline/steps.py): rank 1 + s runs step s, rank 0 decodes -----------------

    step_pipeline = True
    sink_roll_block = 0  # rolled_sink_frame

    def resume_bytes(self, size: tuple[int, int], steps: int) -> int:
        """The per-step rings at this size (counted on meta), in the DiT's bf16: what a resume point copies."""
        if self.config is None:
            return 0
        w, h = size
        c = CausalCaches.empty(self.config.dit, h // 8, w // 8, steps=steps, dtype=torch.bfloat16, device="meta")
        return 2 * c.k.numel() * c.k.element_size()  # k and v

    @staticmethod
    def step_state(state: RollingState, step: int) -> RollingState:
        """A step rank's state: its own ring out of a state that holds every step's (a resumed one), the sink and
        the sink frame as they are."""
        own = dict(state.tensors)
        for n in ("k", "v"):
            ring = own.get(CACHE_PREFIX + n)
            if ring is not None and ring.shape[0] > 1:
                own[CACHE_PREFIX + n] = ring[step:step + 1].clone()  # (1, layers, ring, H, Dh)
        return RollingState(own, [], state.published)

    @staticmethod
    def step_tensor_names(step: int, block: int) -> list[str]:
        """What step `step`'s rank sends the decode rank after block `block`: its ring, and (step 0's rank) the
        sink at the blocks that prefill it."""
        names = [CACHE_PREFIX + "k", CACHE_PREFIX + "v"]
        if step == 0 and block in (0, BLOCKS_PER_CLIP):
            names += [CACHE_PREFIX + "sink_k", CACHE_PREFIX + "sink_v"]
        return names

    def step_tensors(self, state: RollingState, step: int, block: int) -> dict[str, torch.Tensor]:
        return {n: state.tensors[n] for n in self.step_tensor_names(step, block)}

    @staticmethod
    def merge_step_tensors(state: RollingState, per_step: list[dict[str, torch.Tensor]], block: int) -> None:
        """The decode rank's state after block `block`, as one rank's would be: the step ranks' rings stacked, the
        sink when it changed; the sink frame gone once block 4 used it."""
        for n in ("k", "v"):
            state.tensors[CACHE_PREFIX + n] = torch.cat([d[CACHE_PREFIX + n] for d in per_step])  # (steps, ...)
        state.tensors.update({n: t for n, t in per_step[0].items() if n.startswith(CACHE_PREFIX + "sink")})
        if block == BLOCKS_PER_CLIP:
            state.tensors.pop(SINK_FRAME, None)

    @staticmethod
    def rolled_sink_frame(block: int, z: torch.Tensor) -> torch.Tensor | None:
        """Block 0's final latents z (10, 16, h, w) -> the sink frame (16, 1, h, w) block 4 prefills with; None for
        other blocks. `keep` stores the same tensor."""
        return z[-FRAMES_PER_BLOCK][:, None].contiguous() if block == 0 else None

    def needs_sink_frame(self, block: int, state: RollingState) -> bool:
        return block == BLOCKS_PER_CLIP and SINK_FRAME not in state.tensors

    @staticmethod
    def put_sink_frame(state: RollingState, frame: torch.Tensor) -> None:
        state.tensors[SINK_FRAME] = frame

    @staticmethod
    def drop_rings(state: RollingState) -> None:
        for n in ("k", "v"):
            state.tensors.pop(CACHE_PREFIX + n, None)

    def _caches(self, state: RollingState, dit, steps: int, lat_h: int, lat_w: int, dtype: torch.dtype,
                device: torch.device, rings: RingStore, sp: SequenceParallelStream | None = None) -> CausalCaches:
        """The caches of the state (empty rings at block 0, or after a resume the saved ones). sp: this rank's heads
        of them; whole caches in the state (rank 0 after a block, every rank after a resume) are cut to them.
        rings: where they live (runtime/rings.py: on the device, in host memory, in a scratch file), which
        allocates them and takes in a resumed state's."""
        own = {k[len(CACHE_PREFIX):]: v for k, v in state.tensors.items() if k.startswith(CACHE_PREFIX)}
        if own and not rings.on_device:  # a resumed state's, read onto the device, go where the rings live
            own = {n: rings.adopt(t, ring=n in ("k", "v")) for n, t in own.items()}
            state.tensors.update({CACHE_PREFIX + n: t for n, t in own.items()})
        if own:
            caches = CausalCaches.from_tensors(own)
            if sp is not None and caches.k.shape[3] == dit.params.num_heads:
                caches = sp.shard_caches(caches)
                state.tensors.update({CACHE_PREFIX + n: t for n, t in caches.tensors().items()})
            return caches
        if sp is not None:
            return sp.empty_caches(lat_h, lat_w, steps=steps, dtype=dtype, device=device)
        return CausalCaches.empty(dit.params, lat_h, lat_w, steps=steps, dtype=dtype,
                                  zeros=functools.partial(rings.zeros, device=device))

    def keep(self, chunk: Chunk, z: torch.Tensor, state: RollingState, chunking: Any) -> None:
        """Hold the block's latents (all of them are decoded: the decode is causal); block 0 also gives the rolled
        sink frame, its first latent, for block 4's sink refresh."""
        s, e = chunk.keep
        state.held.append((s, e, z))
        if chunk.index == 0:
            state.tensors[SINK_FRAME] = self.rolled_sink_frame(0, z)  # (16, 1, h, w)

    # --- decode ------------------------------------------------------------------------------------------

    def decode(self, models: Models, final: Final, state: RollingState,
               put: Callable[[torch.Tensor], None]) -> int:
        """final.z: whole blocks' latents in order, (n, 16, h, w), block 0's after the 7 priming latents. Carries the
        decoder cache, puts frames [final.start, final.end) one latent (4 frames) at a time."""
        vae = models["vae"]
        cache = _cache_from(state)
        # A new timeline: the priming latents' 25 frames, then block 0's first LEAD frames (timeline -3..-1).
        skip = PRIME_FRAMES + LEAD if cache is None else 0
        z = final.z.transpose(0, 1)[None]  # (1, 16, n, h, w)
        made = 0
        for i in range(z.shape[2]):
            x, cache = vae.decode_stream(z[:, :, i:i + 1], cache)  # (1, 3, 1 or 4, H, W) float32
            x = x[0].transpose(0, 1)  # (T, 3, H, W)
            x, skip = x[skip:], max(0, skip - x.shape[0])
            n = min(x.shape[0], final.frames - made)
            if n > 0:
                put(x[:n])
                made += n
        _cache_to(state, cache)
        return made


class StreamingSequenceParallel(nn.Module):
    """The DiT of the streaming mode on several ranks: the model (replicated) and the SequenceParallelStream that
    splits each block's forward over the group (live_parallel.py). LiveAvatarFamily calls `stream`'s functions."""

    def __init__(self, model: nn.Module, group):
        super().__init__()
        self.stream = SequenceParallelStream(model, group)  # checks the head count before any collective
        self.dit = model
        self.params = model.params


def family_for_mode(config: WanS2VConfig, mode: str) -> Family:
    """The wan-s2v family object of a generation mode: "clip" (the official clip loop, WanS2VFamily) or
    "streaming" (LiveAvatar's, LiveAvatarFamily). ValueError naming the mode otherwise."""
    if mode == "clip":
        return WanS2VFamily(config)
    if mode == "streaming":
        return LiveAvatarFamily(config)
    raise ValueError(f"mode: '{mode}': the wan-s2v family renders in {' or '.join(MODES)} mode")
