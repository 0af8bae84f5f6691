"""Render one resolved job to a finished MP4: runtime, resume, load and place, run the pipeline, commit the file.

Everything that can be checked without loading a model is checked first (avatar_cli/job.py `resolve`, which this
module also exports as `prepare`), so bad input fails in well under a second, with exit code 2 and nothing
written at the output path.
"""

import errno
import logging
import hashlib
import json
import os
import time
from collections.abc import Collection, Iterator, MutableMapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from avatar_cli.errors import InputError, RenderError
from avatar_cli.families.registry import ModelSource, load_modules
from avatar_cli.job import ResolvedJob, Split, check_disk, check_output, resolve
from avatar_cli.media.audio import AudioWindowReader
from avatar_cli.media.writer import Mp4Writer, resolve_codec
from avatar_cli.modules.module import Module
from avatar_cli.pipeline import checkpoint as ckpt
from avatar_cli.pipeline.fingerprint import describe_change, job_fingerprint
from avatar_cli.pipeline.events import ChunkDone, ResumeFrom, Stretch
from avatar_cli.pipeline.run import Pipeline
from avatar_cli.pipeline.steps import rank_skips
from avatar_cli.plan import render_rings, render_working_bytes
from avatar_cli.prompts import cache as prompt_cache
from avatar_cli.report import Reporter, peak_rss_mb
from avatar_cli.runtime.device import Runtime, cpu_info, dtype_name, resolve_runtime, set_cpu_threads
from avatar_cli.runtime.distributed import Dist, current_dist, launched_by_torchrun
from avatar_cli.runtime.numa import bind_to_gpu_node
from avatar_cli.runtime.offload import Transfer, host_available
from avatar_cli.runtime.placement import Placement, place, plan_for
from avatar_cli.runtime.rings import RingStore
from avatar_cli.stages.decode_worker import DecodeWorker
from avatar_cli.spec import Decode
from avatar_cli.stages.publish import Publisher

log = logging.getLogger(__name__)

__all__ = ["ModelCache", "RenderSummary", "ResolvedJob", "Resume", "check_output", "prepare", "render", "setup_runtime"]

# What the tests, the bench and the batch call: a job resolved once (avatar_cli/job.py), then rendered.
prepare = resolve


class Resume(str, Enum):
    """What render does with an interrupted render of the same job."""

    never = "never"  # start over (--force)
    auto = "auto"  # continue it if its checkpoint is there, else start over (a plain rerun)
    strict = "strict"  # continue it, and refuse to discard a checkpoint of a changed job (--resume)


@dataclass(eq=False)
class RenderSummary(MutableMapping):
    """What a finished render reports: the `done` event's fields, in its order. Read and written as a mapping too
    (`summary["frames"]`, `{**summary}`), as the event's JSON object; keys a caller adds (a benchmark's own
    figures) go to `extra` and follow the fields."""

    output: str
    frames: int
    video_fps: float
    duration_s: float  # the video's length
    wall_s: float  # render() start to the committed file
    ttff_s: float  # render start (models loaded) to the first frame handed to the encoder
    render_fps: float  # frames generated per second of generation (a resumed render's copied frames excluded)
    rtf: float  # video seconds generated per second of generation
    peak_rss_mb: float
    load_s: float  # render() start to the first chunk: runtime, resume, load and place
    generate_s: float
    compute_s: dict[str, float]  # seconds per step (families.base.Step names; decode_wait with a decode worker)
    resumed_at: int  # the frame generation continued from (0: from the start)
    frames_digest: str  # sha256 over every frame's pixels, in order: equal renders have equal digests
    ranks: int
    text_cache: str  # hit | service | miss | off
    dtype: str
    dtype_reason: str
    cpu_capability: str
    transitions: bool  # chunking.transitions as resolved
    decode_worker_peak_rss_mb: float | None = None  # runtime.decode=worker only (absent from the event otherwise)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        if out["decode_worker_peak_rss_mb"] is None:
            del out["decode_worker_peak_rss_mb"]
        return {**out, **self.extra}

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _SUMMARY_FIELDS:
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in _SUMMARY_FIELDS:
            raise KeyError(f"{key}: a field of the render summary")
        del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


_SUMMARY_FIELDS = {f.name for f in fields(RenderSummary)} - {"extra"}


def make_output_folder(output: Path) -> None:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"output: cannot create folder {output.parent} ({e.strerror})") from None


@dataclass
class ModelCache:
    """Jobs of a batch that share a model load (and place) it once.

    transfer, free_bytes: the device behind offload, when not CUDA's (tests: the CPU standing in).
    """

    loaded: dict[tuple, tuple[dict[str, Module], Placement]] = field(default_factory=dict)
    transfer: Transfer | None = None
    free_bytes: int | None = None

    def get(self, source: ModelSource, runtime: Runtime, dist: Dist, rt_spec, reporter: Reporter,
            skip: Collection[str] = (), working_bytes: int | None = None,
            rings: RingStore = RingStore()) -> tuple[dict[str, Module], Placement]:
        """skip: components this job does not need loaded (its prompt is in the text cache). A set that lacks
        what a later job needs gets just those loaded and placed beside it. working_bytes: device memory the
        layout keeps free for state and activations (None: placement's default reserve). rings: where the
        family's key/value rings live (place_rings), held by the placement."""
        key = (source.fingerprint, str(runtime.device), str(runtime.dtype), rt_spec.offload.value,
               rt_spec.reshard.value, rt_spec.shard.value, rt_spec.weights.value, rt_spec.vae_dtype.value,
               rt_spec.offload_host.value, rings)
        if key not in self.loaded:
            if not source.trained:
                reporter.info(f"note: model '{source.name}' has no trained weights yet: a seeded random init stands "
                              "in, so the video shows noise, not a face")
            self.loaded.clear()  # keep one model set resident, not one per model ever used
            self.loaded[key] = ({}, Placement(rings=rings))
        modules, placement = self.loaded[key]
        wanted = [n for n in source.family.components if n not in skip and n not in modules]
        if wanted:
            unwanted = [n for n in source.family.components if n not in wanted]
            more = load_modules(source, skip=unwanted) if unwanted else load_modules(source)
            added = place(more, runtime, dist, rt_spec.offload.value, rt_spec.reshard.value, transfer=self.transfer,
                          free_bytes=self.free_bytes,
                          plan=plan_for(source.family.parallel.with_dtype("vae", rt_spec.vae_dtype.value), more),
                          shard=rt_spec.shard.value, weights=rt_spec.weights.value,
                          offload_host=rt_spec.offload_host.value, rings=rings,
                          **({} if working_bytes is None else {"working_bytes": working_bytes}))
            if modules:  # beside a placed set: the stages look each component up by name in either
                placement.offloaders.update(added.offloaders)
                placement.sharded.update(added.sharded)
            else:
                placement = added
            modules.update(more)
            self.loaded[key] = (modules, placement)
        return modules, placement


def _working_bytes(p: ResolvedJob, runtime: Runtime, dist: Dist, models: ModelCache,
                   rings: RingStore) -> int | None:
    """Where placement chooses from free device memory (a GPU, or the CPU standing in for one), the state and
    activations it keeps free: counted on the meta device for this job, as `avatar plan` counts them (plan.py), so
    a render and its plan choose the same layout. None: the family has no budget (placement's default reserve)."""
    rt = p.job.spec.runtime
    if not (runtime.is_cuda or models.transfer is not None) or "auto" not in (rt.offload.value, rt.shard.value):
        return None
    working = render_working_bytes(p, runtime, dist.rank, not rings.on_device)
    if working is not None:
        log.info("placement: %.1f GB kept free for state and activations (counted on the meta device)",
                 working / 1e9)
    return working


def setup_runtime(spec, runtime: Runtime | None = None) -> tuple[Runtime, Dist]:
    """The job's runtime (resolved with the job; resolved here when not given) on this rank's device, and (under
    torchrun) the process group; on a GPU, bind to its NUMA node first. Which CUDA device a rank drives is known
    only now, in the process that renders.

    The binding comes before the process group: NCCL, initialized eagerly for our device, allocates its
    own pinned host buffers, and those too should sit on the GPU's node.
    """
    rt = spec.runtime
    if runtime is None:
        runtime = resolve_runtime(rt.device.value, rt.dtype.value, rt.threads)
    elif not runtime.is_cuda:
        set_cpu_threads(rt.threads)  # this job's count, whatever another job resolved since
    if runtime.is_cuda:
        index = int(os.environ["LOCAL_RANK"]) if launched_by_torchrun() else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise InputError(f"runtime: this worker is local rank {index} but only {torch.cuda.device_count()} "
                             "GPU(s) are visible: start at most one process per GPU (--nproc)")
        runtime = Runtime(torch.device("cuda", index), runtime.dtype, runtime.dtype_reason)
        cpus = bind_to_gpu_node(runtime.device)
        if cpus and spec.runtime.threads <= 0:
            torch.set_num_threads(min(torch.get_num_threads(), len(cpus)))  # no more threads than our CPUs
    dist = current_dist(runtime.device.type)
    return runtime, dist


def place_rings(p: ResolvedJob, runtime: Runtime, skip: Collection[str] = ()) -> tuple[RingStore, str | None]:
    """`runtime.rings` for this render, decided before placement as `avatar plan` decides it (plan.rings_on_host)
    -> (where the rings live, why; None: the family keeps no rings). Rings in host memory the host cannot hold
    are exit 2 now, not an allocation failure blocks later."""
    free = torch.cuda.mem_get_info(runtime.device)[0] if runtime.is_cuda else None
    avail = host_available()
    got = render_rings(p, runtime, free, avail, skip)
    at, folder = got[0] if got is not None else "device", None
    if at == "disk":  # a scratch file beside the output (a stream's: in the working folder), not a RAM-backed /tmp
        out = p.job.output
        folder = out.parent if isinstance(out, Path) and not p.job.live else Path.cwd()
    rings = RingStore(at, folder)
    if at == "host":
        need = p.model.family.resume_bytes(p.gen_size, p.job.spec.sampling.steps)
        if avail is not None and need > avail:
            raise InputError(f"runtime.rings: host: the key/value rings need {need / 1e9:.1f} GB of host memory, "
                             f"{avail / 1e9:.1f} GB is available (runtime.rings: disk keeps them in a file)")
    return rings, got[1] if got is not None else None


def _resume_point(p: ResolvedJob, fingerprint: dict[str, str], reporter: Reporter, strict: bool):
    """Read the checkpoint an interrupted render left, and pick where to continue (None: start over).

    A checkpoint of another job (its spec, inputs or model changed since) is discarded with a note, or,
    with `strict` (--resume), refused: the user asked to continue that render, so nothing is thrown away.
    The old file's frames are copied up to its last keyframe K that is fully on disk, so the new encoder
    starts exactly where the uninterrupted one started a GOP; generation restarts at the newest saved
    point at or before K, and the few frames regenerated before K are checked against their digests
    but not encoded twice.
    Returns (checkpoint, resume point or None, source file, K), or None when there is nothing to resume.
    """
    partial, output = p.job.partial_output, p.job.output
    try:
        found = ckpt.load_checkpoint(partial)
        change = describe_change(found.fingerprint, fingerprint) if found is not None else None
    except (ValueError, KeyError, TypeError) as e:
        found, change = None, f"its checkpoint is unreadable ({e})"
        if strict:
            raise InputError(f"--resume: the checkpoint beside {partial} is unreadable ({e})") from None
    if change and strict:
        raise InputError(f"--resume: {change} changed since the render was interrupted; "
                         "render with --force to start over")
    if change:
        reporter.info(f"note: starting {output} over: an interrupted render of it was left, but {change} "
                      "changed since (--resume refuses instead of discarding it)")
        return None
    if found is None:
        if strict:
            reporter.info(f"resume: nothing to resume for {output} (no checkpoint beside it); rendering it")
        return None
    source = ckpt.resume_source(partial)
    if source is None:
        reporter.info(f"resume: the partial file of {output} is gone; rendering it from the start")
        return None
    on_disk, copy_to = ckpt.copyable_frames(source)
    usable = [pt for pt in found.points if pt.published <= copy_to]
    if not usable:
        reporter.info(f"resume: the {on_disk} frames on disk end before the first point a render can continue from "
                      "(a keyframe with a saved state); starting from the first chunk")
        found.stretches, found.points, found.chain, found.folded = [], [], "", 0
        return found, None, source, 0
    point = usable[-1]
    # Stretches the interrupted render published after this point: what we generate again must match them.
    found.expected = {(a, b): d for a, b, d in found.since(point.digests)}
    found.truncate(point.digests)
    found.points = [pt for pt in found.points if pt.published <= point.published]
    reporter.info(f"resume: {on_disk} frames were on disk; copying {copy_to}, generating again from frame "
                  f"{point.published} of {p.frames}")
    state = ckpt.load_state(partial, point, p.runtime.device)
    return found, ResumeFrom(point.next_chunk, state), source, copy_to


def _share_resume(dist: Dist, resume_from: ResumeFrom | None, runtime: Runtime) -> ResumeFrom | None:
    """Rank 0 read the checkpoint; every rank continues from the same point and state."""
    if not dist.enabled:
        return resume_from
    payload = None
    if dist.is_main and resume_from is not None:
        st = resume_from.state
        payload = (resume_from.next_chunk, ckpt.state_tensors(st), ckpt.held_spans(st), st.published)
    payload = dist.broadcast_object(payload)
    if payload is None:
        return None
    next_chunk, tensors, held, published = payload
    return ResumeFrom(next_chunk, ckpt.state_from_tensors(tensors, held, published, runtime.device))


def render(p: ResolvedJob, reporter: Reporter, models: ModelCache | None = None,
           resume: Resume | str = Resume.never) -> RenderSummary:
    """Render a resolved job to `p.job.output`; returns the summary the `done` event carries.

    resume: auto continues an interrupted render of this same job if its checkpoint is there (else starts
    over), strict (--resume) also refuses to discard a checkpoint of a changed job, never starts over.
    Under torchrun every rank runs the same schedule; rank 0 alone writes the file and the checkpoint.
    """
    t_start = time.perf_counter()
    resume = Resume(resume)
    spec = p.job.spec
    runtime, dist = setup_runtime(spec, p.runtime)
    main = dist.is_main
    frames = dist.agree(p.frames, "the frame count")
    if dist.world_size != p.world_size:
        raise RenderError(f"the job was resolved for {p.world_size} rank(s) but runs on {dist.world_size}")
    if main and dist.enabled:
        reporter.info(f"parallel: {p.parallel.value} ({p.parallel_why})")
    if main and p.transitions_why:
        reporter.info(f"transitions: {'on' if spec.chunking.transitions else 'off'} ({p.transitions_why})")
    partial = p.job.partial_output
    fingerprint = job_fingerprint(p.job, p.model)
    if main:
        make_output_folder(p.job.output)  # the lock file lives beside the output
    lock = ckpt.OutputLock(partial)
    busy = dist.broadcast_object(lock.acquire() if main else None)  # every rank stops alike, before any work
    if busy:
        raise InputError(f"output: {p.job.output}: {busy}; wait for it to finish or stop it")
    try:
        return _render_locked(p, reporter, models, resume, runtime, dist, frames, fingerprint, t_start)
    finally:
        lock.release()


def _render_locked(p: ResolvedJob, reporter: Reporter, models: ModelCache | None, resume: Resume, runtime: Runtime,
                   dist: Dist, frames: int, fingerprint: dict[str, str], t_start: float) -> RenderSummary:
    spec, main, partial = p.job.spec, dist.is_main, p.job.partial_output
    checkpoint, resume_from, source, copy_to = ckpt.Checkpoint(fingerprint, frames, spec.seed), None, None, 0
    found = None
    if main and resume != Resume.never:
        found = _resume_point(p, fingerprint, reporter, resume == Resume.strict)
    if found is not None:
        checkpoint, resume_from, source, copy_to = found
    elif main:
        check_disk(p)
        ckpt.discard_partial(partial)
    resume_from = _share_resume(dist, resume_from, runtime)

    # A prompt found in the text cache: its encoder is neither loaded nor placed.
    prompts = prompt_cache.job_prompts(spec.runtime.text_cache, p.job.path.parent, p.model, runtime.dtype,
                                     reporter.info, write=main, service=spec.runtime.text_service,
                                     weights=spec.runtime.weights.value)
    cached = prompt_cache.ready(prompts, spec.prompt, runtime.device, dist)
    # The timestep pipeline: each rank loads what its role runs and places it alone (nothing is sharded).
    steps = p.parallel == Split.steps
    absent = rank_skips(p.model.family, dist.rank) if steps else set()
    skip = {*prompt_cache.skipped(prompts, spec.prompt), *absent}
    rings, rings_why = place_rings(p, runtime, skip)
    if main and rings_why is not None:
        reporter.info(f"rings: {rings.at} ({rings_why})")
    models = models or ModelCache()
    modules, placement = models.get(p.model, runtime, Dist() if steps else dist, spec.runtime, reporter,
                                    skip=skip, working_bytes=_working_bytes(p, runtime, dist, models, rings),
                                    rings=rings)
    pipeline = Pipeline(modules, p.model.family, runtime, placement, prompts=prompts,
                        steps_dist=dist if steps else None, absent=absent)
    image = p.model.family.fit_reference(p.image, *p.gen_size)  # (3, H, W) in [-1, 1]
    chunks = pipeline.schedule(spec, frames)
    # The blocks after which a resume point's state is copied where it is not at hand (pipeline/checkpoint.py).
    copies = ckpt.resume_schedule(p.model.family.resume_bytes(p.gen_size, spec.sampling.steps))

    first_put = resume_from.state.published if resume_from else 0
    # Ranks other than 0 compute, but write nothing (and decode only what the family's later chunks need).
    out: Publisher = pipeline.publish_to(None, p.size)
    worker: DecodeWorker | None = None
    if main:
        args = dict(width=p.size[0], height=p.size[1], fps=spec.video.fps, total_frames=frames,
                    audio_path=str(p.job.audio), codec=resolve_codec(spec.video.codec.value, str(runtime.device)),
                    crf=spec.video.crf, preset=spec.video.preset, metadata={"comment": output_tag(fingerprint)},
                    resume_from=source, resume_frames=copy_to, first_put=first_put)
        if p.decode == Decode.worker:  # it decodes and owns the MP4 writer; its startup overlaps the first chunk
            out = worker = DecodeWorker(p.model, runtime, dist.world_size, str(partial), args, p.size,
                                        resume_at=copies, vae_dtype=spec.runtime.vae_dtype.value)
            reporter.info(f"decode: worker ({p.decode_why}), pid {worker.pid} on {worker.device}")
        else:
            out = pipeline.publish_to(Mp4Writer(partial, **args), p.size)
            if p.decode_why != "asked for":  # auto chose it, or the timestep pipeline
                reporter.info(f"decode: inline ({p.decode_why})")
    saver = ckpt.CheckpointWriter(partial, checkpoint)
    reader = AudioWindowReader(p.job.audio, sample_rate=p.model.family.geometry.sample_rate, info=p.audio)
    for warning in p.warnings if main else []:
        reporter.info(warning)
    if main and spec.runtime.dtype.value == "auto":
        reporter.info(f"dtype: {dtype_name(runtime.dtype)} ({runtime.dtype_reason})")
    reporter.start(output=str(p.job.output), frames=frames, chunks=len(chunks), fps=spec.video.fps)
    done_chunks = resume_from.next_chunk if resume_from else 0

    def on_chunk(d: ChunkDone) -> None:
        nonlocal done_chunks
        done_chunks += 1
        reporter.chunk(kind=d.chunk.kind, index=d.chunk.index, start=d.chunk.keep[0], end=d.chunk.keep[1],
                       elapsed_s=d.elapsed_s, done_chunks=done_chunks, published=d.published)

    def on_stretch(s: Stretch) -> None:
        saver.add_stretch(s.start, s.end, s.digest)
        expected = checkpoint.expected.pop((s.start, s.end), None)
        if expected is not None and expected != s.digest:
            reporter.info(f"warning: frames {s.start}-{s.end} differ from the interrupted render's (another machine "
                          "or thread count?); the video stays valid but may show a seam there")
        if not main or not s.resumable or not saver.due():
            return
        try:
            saver.save(s.next_chunk, s.state)
        except OSError as e:
            what = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else f"cannot write ({e.strerror})"
            raise RenderError(f"{what} while updating the checkpoint beside {partial}") from None

    try:
        t_render = time.perf_counter()
        stats = pipeline.run(spec, image, reader, frames, out, on_chunk, on_stretch, resume_from, copies=copies)
        if main:
            out.close()
        gen_s = time.perf_counter() - t_render
    except BaseException as e:
        # Keep what a rerun can continue from: the fragmented MP4 and its last valid checkpoint. Before the
        # first checkpoint there is no such thing (and the file may hold no whole fragment): leave nothing.
        # Nothing ever appears at the output path.
        if not main:
            raise
        out.abort()
        kept = ckpt.resumable(partial, checkpoint, spec.video.fps)
        if not kept:
            ckpt.discard_partial(partial)
        if isinstance(e, RenderError):
            raise RenderError(f"{e}; {_after_failure(kept)}") from e.__cause__
        e.kept_partial = kept  # read by the CLI's interrupt message
        raise
    finally:
        reader.close()
    if main:
        os.replace(partial, p.job.output)
        saver.remove()
        if source is not None:
            source.unlink(missing_ok=True)

    duration = frames / spec.video.fps
    made = stats.frames - first_put
    return RenderSummary(
        output=str(p.job.output), frames=frames, video_fps=spec.video.fps, duration_s=round(duration, 4),
        wall_s=round(time.perf_counter() - t_start, 4), ttff_s=round(stats.ttff_s, 4),
        render_fps=round(made / gen_s, 3), rtf=round(made / spec.video.fps / gen_s, 4),
        peak_rss_mb=round(peak_rss_mb(), 1), load_s=round(t_render - t_start, 4), generate_s=round(gen_s, 4),
        compute_s={k: round(v, 4) for k, v in stats.compute_s.items()}, resumed_at=first_put,
        frames_digest=checkpoint.frames_digest, ranks=dist.world_size,
        text_cache=prompt_cache.outcome(prompts, cached), dtype=dtype_name(runtime.dtype),
        dtype_reason=runtime.dtype_reason, cpu_capability=cpu_info().capability,
        transitions=spec.chunking.transitions,
        decode_worker_peak_rss_mb=worker.peak_rss_mb if worker is not None else None)


def _after_failure(kept: bool) -> str:
    if kept:
        return "the partial file and its checkpoint are kept: fix that, then render again to continue"
    return "nothing was kept (it stopped before the first checkpoint): fix that, then render again"


def output_tag(fingerprint: dict[str, str]) -> str:
    """Stored in the MP4's metadata: lets a rerun see that this exact job already produced this file."""
    return "avatar:" + hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:32]
