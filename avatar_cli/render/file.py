"""Render one resolved job to a finished MP4: open it, find where an interrupted render stopped, build, run the
pipeline into the file, commit it.

Everything that can be checked without loading a model is checked first (avatar_cli/job.py `resolve`), so bad
input fails in well under a second, with exit code 2 and nothing written at the output path.
"""

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from avatar_cli.errors import InputError, RenderError
from avatar_cli.job import ResolvedJob, check_disk
from avatar_cli.media.audio import AudioWindowReader
from avatar_cli.media.sink import now
from avatar_cli.media.writer import Mp4Writer, resolve_codec
from avatar_cli.pipeline import checkpoint as ckpt
from avatar_cli.pipeline.events import ChunkDone, ResumeFrom, Stretch
from avatar_cli.pipeline.fingerprint import describe_change, job_fingerprint
from avatar_cli.render.setup import Built, ModelCache, Opened, build, fit_decode, opened
from avatar_cli.render.summary import Summary
from avatar_cli.report import Reporter, peak_rss_mb
from avatar_cli.runtime.device import Runtime, cpu_info, dtype_name
from avatar_cli.runtime.distributed import Dist
from avatar_cli.spec import Decode
from avatar_cli.stages.decode_worker import DecodeWorker
from avatar_cli.stages.publish import Publisher

__all__ = ["Resume", "output_tag", "render", "summarize"]


class Resume(str, Enum):
    """What render does with an interrupted render of the same job."""

    never = "never"  # start over (--force)
    auto = "auto"  # continue it if its checkpoint is there, else start over (a plain rerun)
    strict = "strict"  # continue it, and refuse to discard a checkpoint of a changed job (--resume)


@dataclass
class Continue:
    """Where this render starts: a fresh checkpoint, or an interrupted render's with the point to resume from, the
    partial file it left and the frames copied from it."""

    checkpoint: ckpt.Checkpoint
    resume_from: ResumeFrom | None = None
    source: Path | None = None
    copy_to: int = 0

    @property
    def first_put(self) -> int:
        """The first frame this render generates and encodes (read before it runs: the state grows as it does)."""
        return self.resume_from.state.published if self.resume_from else 0


def render(p: ResolvedJob, reporter: Reporter, models: ModelCache | None = None,
           resume: Resume | str = Resume.never) -> Summary:
    """Render a resolved job to `p.job.output`; returns the summary the `done` event carries.

    resume: auto continues an interrupted render of this same job if its checkpoint is there (else starts
    over), strict (--resume) also refuses to discard a checkpoint of a changed job, never starts over.
    Under torchrun every rank runs the same schedule; rank 0 alone writes the file and the checkpoint.
    """
    t_start = now()
    resume = Resume(resume)
    fingerprint = job_fingerprint(p.job, p.model)
    with opened(p, reporter) as job:
        p = fit_decode(p, job, models)
        start = _start_point(p, job, fingerprint, reporter, resume)
        built = build(p, job, reporter, models)
        return _render(p, job, built, start, fingerprint, reporter, t_start)


def _start_point(p: ResolvedJob, job: Opened, fingerprint: dict[str, str], reporter: Reporter,
                 resume: Resume) -> Continue:
    """Rank 0 reads the checkpoint an interrupted render left (or clears the way for a new one); every rank
    continues from the same point and state."""
    start = Continue(ckpt.Checkpoint(fingerprint, job.frames, p.job.spec.seed))
    found = _resume_point(p, fingerprint, reporter, resume == Resume.strict) \
        if job.main and resume != Resume.never else None
    if found is not None:
        start = found
    elif job.main:
        check_disk(p)
        ckpt.discard_partial(p.job.partial_output)
    start.resume_from = _share_resume(job.dist, start.resume_from, job.runtime)
    return start


def _writer(p: ResolvedJob, job: Opened, built: Built, start: Continue, fingerprint: dict[str, str],
            copies, reporter: Reporter) -> tuple[Publisher, DecodeWorker | None]:
    """Where the final latents go: on rank 0 the MP4 writer, fed inline or by a decode worker; a rank other than 0
    computes but writes nothing (and decodes only what the family's later chunks need)."""
    spec, pipeline = p.job.spec, built.pipeline
    if not job.main:
        return pipeline.publish_to(None, p.size), None
    args = dict(width=p.size[0], height=p.size[1], fps=spec.video.fps, total_frames=job.frames,
                audio_path=str(p.job.audio), codec=resolve_codec(spec.video.codec.value, str(job.runtime.device)),
                crf=spec.video.crf, preset=spec.video.preset, metadata={"comment": output_tag(fingerprint)},
                resume_from=start.source, resume_frames=start.copy_to, first_put=start.first_put)
    if p.decode == Decode.worker:  # it decodes and owns the MP4 writer; its startup overlaps the first chunk
        worker = DecodeWorker(p.model, job.runtime, job.dist.world_size, str(p.job.partial_output), args, p.size,
                              resume_at=copies, vae_dtype=spec.runtime.vae_dtype.value, sr=p.sr,
                              weights=spec.runtime.weights.value)
        reporter.info(f"decode: worker ({p.decode_why}), pid {worker.pid} on {worker.device}")
        return worker, worker
    if p.decode == Decode.thread:
        reporter.info(f"decode: thread ({p.decode_why})")
        return pipeline.publish_on_thread(Mp4Writer(p.job.partial_output, **args), p.size, copies), None
    if p.decode_why != "asked for":  # auto chose it, or the timestep pipeline
        reporter.info(f"decode: inline ({p.decode_why})")
    return pipeline.publish_to(Mp4Writer(p.job.partial_output, **args), p.size), None


def _render(p: ResolvedJob, job: Opened, built: Built, start: Continue, fingerprint: dict[str, str],
            reporter: Reporter, t_start: float) -> Summary:
    spec, main, partial, pipeline = p.job.spec, job.main, p.job.partial_output, built.pipeline
    first_put = start.first_put
    chunks = pipeline.schedule(spec, job.frames)
    # The blocks after which a resume point's state is copied where it is not at hand (pipeline/checkpoint.py).
    copies = ckpt.resume_schedule(p.model.family.resume_bytes(p.gen_size, spec.sampling.steps))
    out, worker = _writer(p, job, built, start, fingerprint, copies, reporter)
    saver = ckpt.CheckpointWriter(partial, start.checkpoint)
    reader = AudioWindowReader(p.job.audio, sample_rate=p.model.family.geometry.sample_rate, info=p.audio)
    reporter.start(output=str(p.job.output), frames=job.frames, chunks=len(chunks), fps=spec.video.fps)
    on_chunk = _progress(reporter, start.resume_from.next_chunk if start.resume_from else 0)
    on_stretch = _saving(saver, start.checkpoint, reporter, main, partial)
    try:
        t_render = now()
        stats = pipeline.run(spec, built.image, reader, job.frames, out, on_chunk, on_stretch, start.resume_from,
                             copies=copies)
        if main:
            out.close()
        gen_s = now() - t_render
    except BaseException as e:
        if main:
            _keep_partial(e, out, p, start.checkpoint)
        raise
    finally:
        reader.close()
    if main:
        os.replace(partial, p.job.output)
        saver.remove()
        if start.source is not None:
            start.source.unlink(missing_ok=True)
    summary = summarize(p, job, built, stats, start.checkpoint.frames_digest, t_start, t_render, gen_s, first_put)
    summary.decode_worker_peak_rss_mb = worker.peak_rss_mb if worker is not None else None
    return summary


def _progress(reporter: Reporter, done_chunks: int):
    def on_chunk(d: ChunkDone) -> None:
        nonlocal done_chunks
        done_chunks += 1
        reporter.chunk(kind=d.chunk.kind, index=d.chunk.index, start=d.chunk.keep[0], end=d.chunk.keep[1],
                       elapsed_s=d.elapsed_s, done_chunks=done_chunks, published=d.published)
    return on_chunk


def _saving(saver: ckpt.CheckpointWriter, checkpoint: ckpt.Checkpoint, reporter: Reporter, main: bool,
            partial: Path):
    """Each published stretch: into the checkpoint, checked against the interrupted render's, and (rank 0, when
    due) a resume point saved."""
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
    return on_stretch


def _keep_partial(e: BaseException, out: Publisher, p: ResolvedJob, checkpoint: ckpt.Checkpoint) -> None:
    """After a failure: keep what a rerun can continue from, the fragmented MP4 and its last valid checkpoint.
    Before the first checkpoint there is no such thing (and the file may hold no whole fragment): leave nothing.
    Nothing ever appears at the output path. A RenderError is raised again saying what was kept."""
    out.abort()
    kept = ckpt.resumable(p.job.partial_output, checkpoint, p.job.spec.video.fps)
    if not kept:
        ckpt.discard_partial(p.job.partial_output)
    if isinstance(e, RenderError):
        raise RenderError(f"{e}; {_after_failure(kept)}") from e.__cause__
    e.kept_partial = kept  # read by the CLI's interrupt message


def summarize(p: ResolvedJob, job: Opened, built: Built, stats, frames_digest: str, t_start: float, t_render: float,
              gen_s: float, first_put: int = 0) -> Summary:
    """The `done` event's summary of a render or a session that ran `stats` (pipeline/events.py RenderStats)."""
    fps = p.job.spec.video.fps
    made = stats.frames - first_put
    return Summary(
        output=str(p.job.output), frames=stats.frames, video_fps=fps, duration_s=round(stats.frames / fps, 4),
        wall_s=round(now() - t_start, 4), ttff_s=round(stats.ttff_s, 4),
        render_fps=round(made / gen_s, 3) if gen_s > 0 else 0.0,
        rtf=round(made / fps / gen_s, 4) if gen_s > 0 else 0.0,
        peak_rss_mb=round(peak_rss_mb(), 1), load_s=round(t_render - t_start, 4), generate_s=round(gen_s, 4),
        compute_s={k: round(v, 4) for k, v in stats.compute_s.items()}, resumed_at=first_put,
        frames_digest=frames_digest, ranks=job.dist.world_size,
        parallel=str(built.placement.split), text_cache=built.text_cache,
        dtype=dtype_name(job.runtime.dtype), dtype_reason=job.runtime.dtype_reason,
        cpu_capability=cpu_info().capability, transitions=p.job.spec.chunking.transitions)


def _resume_point(p: ResolvedJob, fingerprint: dict[str, str], reporter: Reporter, strict: bool) -> Continue | None:
    """Read the checkpoint an interrupted render left, and pick where to continue (None: start over).

    A checkpoint of another job (its spec, inputs or model changed since) is discarded with a note, or,
    with `strict` (--resume), refused: the user asked to continue that render, so nothing is thrown away.
    The old file's frames are copied up to its last keyframe K that is fully on disk, so the new encoder
    starts exactly where the uninterrupted one started a GOP; generation restarts at the newest saved
    point at or before K, and the few frames regenerated before K are checked against their digests
    but not encoded twice.
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
        return Continue(found, None, source, 0)
    point = usable[-1]
    # Stretches the interrupted render published after this point: what we generate again must match them.
    found.expected = {(a, b): d for a, b, d in found.since(point.digests)}
    found.truncate(point.digests)
    found.points = [pt for pt in found.points if pt.published <= point.published]
    reporter.info(f"resume: {on_disk} frames were on disk; copying {copy_to}, generating again from frame "
                  f"{point.published} of {p.frames}")
    state = ckpt.load_state(partial, point, p.runtime.device)
    return Continue(found, ResumeFrom(point.next_chunk, state), source, copy_to)


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


def _after_failure(kept: bool) -> str:
    if kept:
        return "the partial file and its checkpoint are kept: fix that, then render again to continue"
    return "nothing was kept (it stopped before the first checkpoint): fix that, then render again"


def output_tag(fingerprint: dict[str, str]) -> str:
    """Stored in the MP4's metadata: lets a rerun see that this exact job already produced this file."""
    return "avatar:" + hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:32]
