"""The resume sidecar: a small checkpoint beside the partial output, updated after each published stretch.

Layout, next to `<name>.partial.mp4`:
  <name>.partial.ckpt.json                 the commit point: fingerprints, digests, a ring of resume points
  <name>.partial.ckpt-<seq>.safetensors    the rolling state at each resume point in the ring

A resume point is the state between two chunks: the motion/anchor latents, the held stretches, the decoder
cache and the count of frames published. Noise needs no saved RNG state: it is drawn from a generator
seeded by (job seed, chunk) alone, so the checkpoint records the seed and the index of the next chunk.

Frames handed to the encoder reach the disk a little later (encoder queue, one fragment per second), so the
ring keeps several resume points: `--resume` picks the newest whose frames are all decodable on disk.
Every write is atomic (temporary file + rename); the JSON is written last, so it never names a state file
that isn't complete.

How often: after every published stretch while resume points are cheap (mini: kilobytes, milliseconds). A big
rolling state makes them expensive (LiveAvatar's rings and sink at full size: ~46 GB a point, a stretch every 12
frames), so a point that took over QUICK_S to write is followed by the next only once writing them has taken at
most BUDGET of the render's time since the first; and beyond the newest 2, older points are kept only while all
the kept ones fit in KEEP_BYTES. Fewer points change nothing in what a resume renders (the frames after any point
are bit-identical to an uninterrupted render's); a crash just redoes more of them.

Where a point's state must be copied before it can be written (the timestep pipeline's rings live on the step
ranks; a decode worker acknowledges a stretch after the render process has moved on), the copy is made only after
the blocks `resume_schedule` names: one block in every ceil(state bytes / POINT_BYTES_PER_BLOCK), a rule every
process computes alike from the job, so the step ranks know when to send without being told. Small states (mini,
the clip mode, tiny models): every block, as before. LiveAvatar at full size (41.5 GB of rings): one block in 39,
so its rings cross to the decode rank at ~1 GiB per block on average instead of 41.5 GB, and a decode worker holds
no snapshot for the 38 stretches in between.
"""

import errno
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from avatar_cli.families.base import RollingState
from avatar_cli.files import atomic_path, atomic_write
from avatar_cli.media.writer import count_video_frames, scan_video
from avatar_cli.modules.module import save_safetensors

VERSION = 2  # 2: held stretches saved as [start, end) spans (a latent may make several frames)
RING = 8  # resume points kept; covers the encoder queue plus the open fragment several times over
BUDGET = 0.1  # the share of the render's wall time that writing expensive resume points may take
QUICK_S = 0.05  # a point written faster than this is never a reason to skip the next
KEEP_BYTES = 1 << 30  # older points (beyond the newest 2) are kept while all kept points' files fit in this


@dataclass
class ResumePoint:
    next_chunk: int  # index in the schedule of the first chunk still to run
    published: int  # frames handed to the encoder before that chunk
    state_file: str
    held: list[list[int]]  # [start, end) frames of each held stretch
    digests: int  # how many published stretches (counted from the start of the video) this point covers


@dataclass
class Checkpoint:
    fingerprint: dict[str, str]  # what must not change for a resume to be valid
    total_frames: int
    seed: int
    # [start, end, sha256 of the uint8 frames] of the stretches since the oldest resume point; the ones before
    # are folded into `chain` (`folded` of them), so neither this object nor its JSON grows with the video.
    stretches: list[list] = field(default_factory=list)
    chain: str = ""
    folded: int = 0
    points: list[ResumePoint] = field(default_factory=list)
    bytes_written: int = 0
    seq: int = 0
    version: int = VERSION
    # On resume only, not saved: digests the interrupted render published past the resume point.
    expected: dict = field(default_factory=dict, repr=False)

    @property
    def frames_digest(self) -> str:
        return chain_digest(self.stretches, self.chain)

    @property
    def published_stretches(self) -> int:
        return self.folded + len(self.stretches)

    def since(self, count: int) -> list[list]:
        """The stretches after the first `count` of the video (count >= folded)."""
        return self.stretches[count - self.folded:]

    def truncate(self, count: int) -> None:
        """Forget the stretches after the first `count` (a resume regenerates them)."""
        self.stretches = self.stretches[: count - self.folded]

    def fold(self, upto: int) -> None:
        """Fold the stretches before the first `upto` of the video into the chain (no resume point needs them)."""
        n = upto - self.folded
        if n > 0:
            self.chain = chain_digest(self.stretches[:n], self.chain)
            self.stretches, self.folded = self.stretches[n:], upto


POINT_BYTES_PER_BLOCK = 1 << 30  # what copying states for resume points may cost per block, on average


def resume_schedule(state_bytes: int) -> Callable[[int], bool]:
    """block -> whether a resume point may follow it (module docstring): every block for a small state."""
    every = max(1, -(-state_bytes // POINT_BYTES_PER_BLOCK))
    return lambda block: (block + 1) % every == 0


def chain_digest(stretches: list[list], chain: str = "") -> str:
    """One digest over every published stretch in order, each folded into the digest of those before it:
    equal iff every frame is bit-identical (and the same stretches were published)."""
    for start, end, digest in stretches:
        chain = hashlib.sha256(f"{chain}|{start}:{end}:{digest}".encode()).hexdigest()
    return chain


def paths(partial: Path) -> tuple[Path, str]:
    """(the JSON path, the prefix of state files) for a partial output path."""
    base = partial.with_suffix("")
    return base.with_name(base.name + ".ckpt.json"), base.name + ".ckpt-"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _size(path: Path) -> int:
    """A state file's size; 0 for one already gone (a resumed checkpoint's older points need not all exist)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def state_tensors(state: RollingState) -> dict[str, torch.Tensor]:
    """Everything a resume needs: the held stretches and the family's own tensors (by their names)."""
    tensors = {f"held{i}": z for i, (_, _, z) in enumerate(state.held)}
    for name, value in state.tensors.items():
        if value is not None:
            tensors[name] = value
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


class CheckpointWriter:
    def __init__(self, partial: Path, ckpt: Checkpoint, clock: Callable[[], float] = time.perf_counter):
        self.partial = partial
        self.json_path, self.prefix = paths(partial)
        self.ckpt = ckpt
        self.clock = clock
        self.started: float | None = None  # when the first point was written
        self.spent = 0.0  # seconds spent writing points since then
        self.last_s = 0.0  # how long the last point took

    def due(self) -> bool:
        """Whether the next published stretch gets a resume point (see the module docstring)."""
        if self.started is None or self.last_s < QUICK_S:
            return True
        return self.spent <= BUDGET * (self.clock() - self.started)

    def add_stretch(self, start: int, end: int, digest: str) -> None:
        self.ckpt.stretches.append([start, end, digest])

    def save(self, next_chunk: int, state: RollingState) -> None:
        t0 = self.clock()
        self._save(next_chunk, state)
        self.last_s = self.clock() - t0
        self.spent += self.last_s
        if self.started is None:
            self.started = t0

    def _save(self, next_chunk: int, state: RollingState) -> None:
        c = self.ckpt
        c.seq += 1
        name = f"{self.prefix}{c.seq:08d}.safetensors"
        with atomic_path(self.partial.parent / name) as tmp:
            try:
                save_safetensors(state_tensors(state), tmp)
            except Exception as e:  # safetensors reports a full disk as its own error type
                code = errno.ENOSPC if "No space left" in str(e) else errno.EIO
                raise OSError(code, os.strerror(code)) from e
        c.points.append(ResumePoint(next_chunk, state.published, name, held_spans(state),
                                    c.published_stretches))
        keep = min(len(c.points), RING)
        sizes = [_size(self.partial.parent / pt.state_file) for pt in c.points[-keep:]]
        while keep > 2 and sum(sizes[-keep:]) > KEEP_BYTES:
            keep -= 1
        dropped, c.points = c.points[:-keep], c.points[-keep:]
        c.fold(c.points[0].digests)
        c.bytes_written = self.partial.stat().st_size if self.partial.exists() else 0
        record = {k: v for k, v in asdict(c).items() if k != "expected"}
        atomic_write(self.json_path, json.dumps(record).encode())  # a full disk or Ctrl-C keeps the previous one
        for point in dropped:  # only after the JSON no longer names them
            (self.partial.parent / point.state_file).unlink(missing_ok=True)

    def remove(self) -> None:
        """After a successful render: the checkpoint has done its job."""
        remove_checkpoint(self.partial)


def remove_checkpoint(partial: Path) -> None:
    json_path, prefix = paths(partial)
    json_path.unlink(missing_ok=True)
    for f in partial.parent.glob(prefix + "*.safetensors*"):
        f.unlink(missing_ok=True)


def copyable_frames(video: Path) -> tuple[int, int]:
    """(frames that decode from a possibly cut-off file, K): a resume copies frames [0, K), K its last
    keyframe with everything before it on disk, so the new encoder starts a GOP where the old one did."""
    on_disk, keys = scan_video(video)
    return on_disk, max([k for k in keys if k <= on_disk] or [0])


def resumable(partial: Path, ckpt: Checkpoint, fps: float) -> bool:
    """Whether a rerun can continue this render: a saved point whose frames are on disk up to a keyframe.

    Early on (the first checkpoint comes before the first keyframe after frame 0) that is checked on the
    file itself, which is then a few seconds long; later a usable point is certain (the ring of points
    reaches back several fragments) and decoding an hour of video to confirm it would hold up the exit.
    """
    files = [f for f in (partial, resume_path(partial)) if f.exists()]
    if not (ckpt.points and paths(partial)[0].is_file() and files):
        return False
    if max(pt.published for pt in ckpt.points) >= 4 * fps:
        return True
    first = min(pt.published for pt in ckpt.points)
    return any(copyable_frames(f)[1] >= first for f in files)


def load_checkpoint(partial: Path) -> Checkpoint | None:
    json_path, _ = paths(partial)
    if not json_path.is_file():
        return None
    d = json.loads(json_path.read_text())
    if d.get("version") != VERSION:
        raise ValueError(f"checkpoint version {d.get('version')} is not {VERSION}")
    d["points"] = [ResumePoint(**p) for p in d["points"]]
    d.pop("expected", None)
    return Checkpoint(**d)


def held_spans(state: RollingState) -> list[list[int]]:
    """The timeline frames [start, end) each held stretch becomes (its tensor is saved as held{i})."""
    return [[s, e] for s, e, _ in state.held]


def load_state(partial: Path, point: ResumePoint, device: torch.device) -> RollingState:
    tensors = load_file(str(partial.parent / point.state_file))
    return state_from_tensors(tensors, point.held, point.published, device)


def state_from_tensors(t: dict[str, torch.Tensor], held: list[list[int]], published: int,
                       device: torch.device) -> RollingState:
    """Each tensor comes back in the dtype it was saved in: a family may keep some (a decoder cache, audio
    statistics) in float32 while the models run in bf16."""
    held_names = {f"held{i}" for i in range(len(held))}
    spans = [(s, e, t[f"held{i}"].to(device)) for i, (s, e) in enumerate(held)]
    own = {name: v.to(device) for name, v in t.items() if name not in held_names}
    return RollingState(tensors=own, held=spans, published=published)


class OutputLock:
    """One render per output at a time: an exclusive flock on `<name>.partial.lock`, held while rendering.

    Two renders of one output (overlapping cron runs, a Slurm requeue while the old task lives) would move
    each other's partial file and checkpoint away and publish a cut-short video as finished. The lock dies
    with its process (kill -9 included), so a stale lock file never blocks a rerun.
    """

    def __init__(self, partial: Path):
        self.path = partial.with_name(partial.name + ".lock")
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; None, or why not (another process holds it)."""
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                return f"another avatar process (pid {holder}) is rendering it now"
            try:  # the holder may have removed the file between our open and our lock: lock the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
                self.fd = fd
                return None
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while still held: a waiter re-checks the inode (above)
            os.close(self.fd)
            self.fd = None


def resume_path(partial: Path) -> Path:
    """Where the interrupted render's file waits while a resumed render copies its frames."""
    return partial.with_name(partial.stem + ".resume-src" + partial.suffix)


def discard_partial(partial: Path) -> None:
    """A fresh render: drop what an earlier, interrupted render of the same output left behind."""
    remove_checkpoint(partial)
    partial.unlink(missing_ok=True)
    resume_path(partial).unlink(missing_ok=True)


def resume_source(partial: Path) -> Path | None:
    """Move the interrupted render's file aside as the source of its frames, and return that path.

    If an earlier resume was itself interrupted, both files may exist: keep the one with more frames.
    """
    src = resume_path(partial)
    if partial.exists() and src.exists():
        if count_video_frames(partial) > count_video_frames(src):
            os.replace(partial, src)
        else:
            partial.unlink()
    elif partial.exists():
        os.replace(partial, src)
    return src if src.exists() else None
