"""A loaded job spec resolved once, before any model loads: what `render`, `validate`, `batch`, `launch` and
`prompts encode` take.

`resolve(job)` opens and checks every input and settles every choice the spec leaves open, each once:
- the model source: resolved by its family (families/registry.py), checked from headers, in the job's mode,
  with its LoRA (`resolve_source`, which `prompts encode` and the batch's skip check call alone);
- the family's checks of the job's settings, the decode setting, the text service;
- the runtime's device type and dtype (`auto` resolved), which decide `chunking.transitions: auto` (the spec
  then holds the bool: the resume fingerprint and the chunk plan see the same value) and `runtime.decode: auto`;
- `runtime.parallel` for the rank count the job runs with: the launcher's --nproc for its early check, else the
  rank count this process was started in (WORLD_SIZE);
- the output path and the frame size.

Known only at render time, and resolved there once: which CUDA device this rank drives (render.setup_runtime
refines `runtime` with it) and whether an interrupted render of the job is resumed (the disk check, `check_disk`,
runs only when it is not).
"""

import os
import shutil
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import numpy as np

from avatar_cli.errors import InputError, SpecError
from avatar_cli.families.base import Sampling, check_degree
from avatar_cli.families.registry import ModelSource, check_model, resolve_model, with_dit, with_lora, with_mode
from avatar_cli.media.audio import AudioInfo, probe_audio
from avatar_cli.media.image import load_image, small_image_warning
from avatar_cli.media.whip import check_available as check_whip
from avatar_cli.media.whip import is_whip_output, read_bearer_token
from avatar_cli.pipeline.schedule import choose_transitions, num_frames
from avatar_cli.pipeline.steps import check_family, choose_parallel
from avatar_cli.prompts import cache as prompt_cache
from avatar_cli.runtime.device import Runtime, job_threads, resolve_runtime
from avatar_cli.runtime.quantize import check_setting as check_weights_setting
from avatar_cli.spec import MAX_SIDE, Decode, Job, Parallel, is_stream_input
from avatar_cli.stages import decode_worker
from avatar_cli.stages.sr import SRPlan, resolve_plan

# Bits per pixel that H.264 at a given crf rarely exceeds on this content; only sizes the disk check.
_BPP_AT_CRF20 = 0.3


class Split(str, Enum):
    """How the ranks split the work, `runtime.parallel` resolved for a rank count (pipeline/steps.py)."""

    single = "single"  # one rank
    sequence = "sequence"  # every rank works on every chunk (Ulysses over heads)
    steps = "steps"  # the timestep pipeline: rank 0 decodes, rank 1 + s runs denoising step s


@dataclass(frozen=True)
class ResolvedJob:
    """A job whose inputs are open and checked and whose open choices are made (see the module docstring)."""

    job: Job  # its spec holds chunking.transitions resolved to a bool
    image: np.ndarray  # (H, W, 3) uint8, as decoded
    audio: AudioInfo | None  # None: a live input, whose length is known when it ends
    model: ModelSource  # in the job's mode, with its LoRA, checked
    frames: int  # 0: a live input's (unknown until it ends)
    size: tuple[int, int]  # output (width, height)
    gen_size: tuple[int, int]  # (width, height) the family generates at (the reference is fitted to it)
    runtime: Runtime  # device type and dtype; setup_runtime adds the CUDA device index at render time
    world_size: int = 1  # the ranks the job runs on
    parallel: Split = Split.single  # how the ranks split the work
    parallel_why: str = "one rank"
    decode: Decode = Decode.inline  # where the VAE decode and the MP4 encoder run: inline or worker
    decode_why: str = "asked for"
    transitions_why: str = ""  # why `auto` chose chunking.transitions ("" when the job set it)
    sr: SRPlan | None = None  # frame super-resolution (sr.model): its directory, checked, and its sizes

    @property
    def duration_s(self) -> float:
        return self.frames / self.job.spec.video.fps

    @property
    def warnings(self) -> list[str]:
        """Input that renders, but not well: said before rendering (and by validate)."""
        notes = [small_image_warning(self.image, self.job.reference, min(self.gen_size))]
        over = self.model.family.prompt_overflow(self.job.spec.prompt)
        if over is not None:
            notes.append(f"warning: prompt: {over[0]} tokens; the {self.model.family.name} family's text encoder "
                         f"reads the first {over[1]} and ignores the rest")
        return [n for n in notes if n]

    def estimated_bytes(self) -> int:
        """A generous estimate of the output's size, from the bitrate the quality setting implies."""
        w, h = self.size
        bpp = _BPP_AT_CRF20 * 2 ** ((20 - self.job.spec.video.crf) / 6)  # x264: +6 crf halves the bitrate
        video = w * h * self.job.spec.video.fps * bpp * self.duration_s / 8
        audio = 128_000 * self.duration_s / 8
        return int(video + audio) + (1 << 20)


def check_output(output: Path, force: bool) -> None:
    if output.is_dir():
        raise InputError(f"output: {output} is a folder; give a .mp4 file path")
    if output.exists() and not force:
        raise InputError(f"output: {output} already exists; pass --force to replace it")
    # The folder may not exist yet (render creates it): check the nearest existing ancestor instead.
    folder = output.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"output: cannot create a folder under {folder}: it is a file")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"output: folder {folder} is not writable")


def check_live(job: Job, force: bool) -> None:
    """A live session's outputs: an HLS playlist or a recording that exists is replaced only with --force (a stream
    URL is opened, and refused if it does not answer, when the session starts); a WHIP output's bearer token file
    must hold a token."""
    out = str(job.output)
    if out.lower().endswith(".m3u8"):
        check_output(Path(out), force)
    if is_whip_output(out):
        check_whip(out)
    if job.bearer_token_file is not None:
        read_bearer_token(job.bearer_token_file)
    if job.record is not None:
        check_output(job.record, force)


def check_disk(r: ResolvedJob) -> None:
    folder = r.job.output.parent
    while not folder.exists():
        folder = folder.parent
    need, free = 2 * r.estimated_bytes(), shutil.disk_usage(folder).free
    if free < need:
        raise InputError(f"output: not enough disk space in {folder}: {free / 2**20:.1f} MB free, "
                         f"this {r.duration_s:.0f} s video needs about {need / 2**20:.1f} MB")


def resolve_source(job: Job) -> ModelSource:
    """The job's model: resolved by its family (once: load_job resolved it for the family's defaults already), checked
    from headers, in the job's mode, with its LoRA (its headers against the DiT built on meta: a wrong file is exit
    2 before any load)."""
    source = job.source if job.source is not None else resolve_model(job.model, job.path.parent)
    if job.dit is not None:
        source = with_dit(source, job.dit, job.spec.runtime.weights.value)
    check_model(source)
    source = with_mode(source, job.spec.mode)
    if job.lora is not None:
        source = with_lora(source, job.lora, job.spec.lora_rank, job.spec.lora_scale)
    return source


def job_runtime(job: Job) -> Runtime:
    """The job's device type and dtype (`auto` resolved on this host)."""
    rt = job.spec.runtime
    return resolve_runtime(rt.device.value, rt.dtype.value, rt.threads)


def ranks() -> int:
    """The rank count this process was started in (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_parallel(job: Job, source: ModelSource, world_size: int) -> tuple[Split, str]:
    """`runtime.parallel` for world_size ranks, and why; InputError when the family cannot split that way (the
    sequence-parallel degree must divide the DiT's heads)."""
    family = source.family
    try:
        how, why = choose_parallel(job.spec.runtime.parallel.value, family, job.spec.sampling.steps, world_size)
        if how == "sequence":  # the timestep pipeline splits no head
            check_degree(family.parallel.sp_heads, world_size)
    except ValueError as e:
        raise InputError(str(e)) from None
    return Split(how), why


def resolve_sr(job: Job, lq: tuple[int, int]) -> SRPlan | None:
    """`sr.model` and `sr.scale` for frames of size `lq` (width, height): the directory recognised as SwiftVR's and
    checked from its headers (a transformer of another model, a pickle: exit 2), the output size as the model rounds
    it. None: no super-resolution.

    Every family's output can take it: SR reads the decoded frames, whatever made them. mini's own latent SR is
    part of its model (its decoder reads refined latents at the family's 256 x 256); frame SR runs after the decode
    and upscales what the family put out, so the two compose."""
    if job.sr_model is None:
        return None
    folder, scale = job.sr_model, job.spec.sr.scale
    if not folder.is_dir():
        raise InputError(f"sr.model: {folder}: no such folder (a SwiftVR model directory)")
    plan = resolve_plan(folder, scale, lq)
    w, h = plan.out
    if max(w, h) > MAX_SIDE:
        raise InputError(f"sr.scale: {scale} makes {w} x {h} frames of {lq[0]} x {lq[1]}; the encoders take at most "
                         f"{MAX_SIDE} a side")
    return plan


def resolve_decode(job: Job, family, runtime: Runtime, parallel: Split) -> tuple[str, str]:
    """`runtime.decode` for this family, device and split of the ranks -> ("inline" | "worker" | "thread", why)."""
    decode, why = decode_worker.choose(job.spec.runtime.decode.value, family, runtime,
                                       job_threads(job.spec.runtime.threads))
    if parallel == Split.steps and decode in ("worker", "thread"):  # rank 0 already decodes while the others denoise
        return "inline", "the timestep pipeline's rank 0 is its decode process"
    if decode == "thread" and runtime.is_cuda:
        return "inline", "a CUDA device, whose decode does not compete with the DiT for CPU cores"
    if job.live and decode == "worker":
        return "inline", "a live session decodes in its own process"
    if job.live and decode == "thread":
        return "inline", "a live session reads each chunk's latency as its frames come out of the decode"
    if decode == "thread" and job.spec.sr.model is not None:
        return "inline", "frame super-resolution (sr.model) follows the decode in the render's own thread"
    return decode, why


def live_chunking(job: Job) -> Job:
    """A live session's job with `live.chunk_frames` as its chunking.frames (the session then renders the frames a
    file render with that chunking.frames renders); any other job as it is. SpecError where the chunk is too short
    for the job's other chunking keys."""
    n = job.spec.live.chunk_frames
    if not job.live or n is None or n == job.spec.chunking.frames:
        return job
    c = replace(job.spec.chunking, frames=n)
    if c.motion_frames >= n:
        raise SpecError(f"live.chunk_frames: {n} must be larger than chunking.motion_frames ({c.motion_frames})")
    if c.transitions is not False and c.motion_frames + c.transition_frames > n:
        raise SpecError(f"live.chunk_frames: {n} must be at least chunking.motion_frames + "
                        f"chunking.transition_frames ({c.motion_frames + c.transition_frames}) while transitions "
                        f"may be on (set chunking.transitions: false, or a longer live.chunk_frames)")
    return replace(job, spec=replace(job.spec, chunking=c))


def resolve(job: Job, force: bool = False, world_size: int | None = None) -> ResolvedJob:
    """Open and check every input and make every open choice, without loading models (module docstring).

    force: an existing output is allowed (it will be replaced). world_size: the rank count (default: this
    process's)."""
    image = load_image(job.reference, "reference")
    fps = job.spec.video.fps
    if is_stream_input(str(job.audio)):  # a live input: its length is known when it ends (avatar_cli/render/live.py)
        audio, frames = None, 0
    else:
        audio = probe_audio(job.audio, "audio")
        frames = num_frames(audio.samples, audio.sample_rate, fps)
        if frames == 0:
            raise InputError(f"audio: {job.audio}: {audio.duration_s * 1000:.1f} ms is shorter than one frame at "
                             f"{fps:g} fps")
    model = resolve_source(job)
    family = model.family
    job = live_chunking(job)
    sp = job.spec.sampling
    try:  # a setting this family cannot render is a spec error, before any model loads
        family.check_job(job.spec.chunking, Sampling(sp.steps, sp.guidance, sp.shift))
    except ValueError as e:
        raise InputError(f"{job.path}: {e}") from None
    decode_worker.check_setting(job.spec.runtime.decode.value, family)
    try:
        check_weights_setting(job.spec.runtime.weights.value, family.name, family.parallel.quantized)
    except ValueError as e:
        raise InputError(f"{job.path}: {e}") from None
    runtime = job_runtime(job)
    # A named text service: up and serving this model's encoder, else exit 2.
    prompt_cache.check_service(job, model, runtime)
    if job.spec.runtime.parallel == Parallel.steps:
        try:
            check_family(family)
        except ValueError as e:
            raise InputError(f"{job.path}: {e}") from None
    if job.live:
        check_live(job, force)
    else:
        check_output(job.output, force)
    v = job.spec.video
    requested = (v.width, v.height) if v.width else None
    try:
        gen_size = family.frame_size((image.shape[1], image.shape[0]), requested)
    except ValueError as e:
        raise InputError(f"{job.path}: {e}") from None

    world = world_size if world_size is not None else ranks()
    if job.spec.runtime.rings.value == "host" and world > 1:
        raise InputError("runtime.rings: host runs on one rank (several ranks share the rings out instead)")
    parallel, parallel_why = resolve_parallel(job, model, world)
    on, transitions_why = choose_transitions(job.spec.chunking.transitions, family.geometry.kinds,
                                             runtime.device.type)
    if on is not job.spec.chunking.transitions:  # auto, resolved before the fingerprint: a resume needs the same plan
        spec = replace(job.spec, chunking=replace(job.spec.chunking, transitions=on))
        job = replace(job, spec=spec)
    decode, decode_why = resolve_decode(job, family, runtime, parallel)
    sr = resolve_sr(job, requested or gen_size)
    size = sr.out if sr is not None else requested or gen_size
    return ResolvedJob(job, image, audio, model, frames, size, gen_size, runtime, world, parallel,
                       parallel_why, Decode(decode), decode_why, transitions_why, sr)


