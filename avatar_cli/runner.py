"""What the CLI commands run: check a job's inputs, then render it to a finished MP4.

Everything that can be checked without loading a model is checked first (`prepare`), so bad
input fails in well under a second, with exit code 2 and nothing written at the output path.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from avatar_cli.errors import InputError
from avatar_cli.media.audio import AudioInfo, AudioWindowReader, probe_audio
from avatar_cli.media.image import fit_square, load_image
from avatar_cli.media.writer import Mp4Writer, resolve_codec
from avatar_cli.modules.registry import ModelSource, check_model, load_modules, resolve_model
from avatar_cli.pipeline.run import ChunkDone, Pipeline
from avatar_cli.pipeline.schedule import num_frames
from avatar_cli.report import Reporter, peak_rss_mb
from avatar_cli.runtime.device import resolve_runtime
from avatar_cli.spec import Job


@dataclass
class Prepared:
    job: Job
    image: np.ndarray  # (H, W, 3) uint8, as decoded
    audio: AudioInfo
    model: ModelSource
    frames: int
    size: tuple[int, int]  # output (width, height)

    @property
    def duration_s(self) -> float:
        return self.frames / self.job.spec.video.fps


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


def make_output_folder(output: Path) -> None:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"output: cannot create folder {output.parent} ({e.strerror})") from None


def prepare(job: Job, force: bool = False) -> Prepared:
    """Open and check every input without loading models."""
    image = load_image(job.reference, "reference")
    audio = probe_audio(job.audio, "audio")
    fps = job.spec.video.fps
    frames = num_frames(audio.samples, audio.sample_rate, fps)
    if frames == 0:
        raise InputError(f"audio: {job.audio}: {audio.duration_s * 1000:.1f} ms is shorter than one frame at {fps:g} fps")
    model = resolve_model(job.model, job.path.parent)
    check_model(model)
    check_output(job.output, force)
    native = model.config.image_size
    v = job.spec.video
    size = (v.width or native, v.height or native)
    return Prepared(job, image, audio, model, frames, size)


def render(p: Prepared, reporter: Reporter) -> dict:
    """Render a prepared job to `p.job.output`; returns the summary the `done` event carries."""
    t_start = time.perf_counter()
    spec = p.job.spec
    runtime = resolve_runtime(spec.runtime)
    if not p.model.trained:
        reporter.info(f"note: model '{p.model.name}' has no trained weights yet: a seeded random init stands in, "
                      "so the video shows noise, not a face")
    modules = load_modules(p.model)
    for module in modules.values():
        module.to(runtime.device, runtime.dtype)
    pipeline = Pipeline(modules, p.model.config, runtime)
    image = fit_square(p.image, p.model.config.image_size)  # (3, S, S) in [-1, 1]
    chunks = pipeline.schedule(spec, p.frames)

    partial = p.job.partial_output
    make_output_folder(p.job.output)
    writer = Mp4Writer(partial, width=p.size[0], height=p.size[1], fps=spec.video.fps, total_frames=p.frames,
                       audio_path=str(p.job.audio), codec=resolve_codec(spec.video.codec.value, str(runtime.device)),
                       crf=spec.video.crf, preset=spec.video.preset)
    reader = AudioWindowReader(p.job.audio, sample_rate=p.model.config.audio.sample_rate, info=p.audio)
    reporter.start(output=str(p.job.output), frames=p.frames, chunks=len(chunks), fps=spec.video.fps)
    done_chunks = 0

    def on_chunk(d: ChunkDone) -> None:
        nonlocal done_chunks
        done_chunks += 1
        reporter.chunk(kind=d.chunk.kind, index=d.chunk.index, start=d.chunk.keep[0], end=d.chunk.keep[1],
                       elapsed_s=d.elapsed_s, done_chunks=done_chunks, published=d.published)

    try:
        t_render = time.perf_counter()
        stats = pipeline.run(spec, image, reader, p.frames, writer, p.size, on_chunk)
        writer.close()
        gen_s = time.perf_counter() - t_render
    except BaseException:
        # Keep what was written: the fragmented MP4 stays playable, and nothing appears at the output path.
        writer.abort()
        raise
    finally:
        reader.close()
    os.replace(partial, p.job.output)

    duration = p.frames / spec.video.fps
    return {
        "output": str(p.job.output), "frames": stats.frames, "video_fps": spec.video.fps,
        "duration_s": round(duration, 4), "wall_s": round(time.perf_counter() - t_start, 4),
        "ttff_s": round(stats.ttff_s, 4), "render_fps": round(stats.frames / gen_s, 3),
        "rtf": round(duration / gen_s, 4), "peak_rss_mb": round(peak_rss_mb(), 1),
        "load_s": round(t_render - t_start, 4), "generate_s": round(gen_s, 4),
        "compute_s": {k: round(v, 4) for k, v in stats.compute_s.items()},
    }
