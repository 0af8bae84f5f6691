"""What the chunk loop reports: a chunk done, a published stretch, where a resumed render continues, the stats.

The loop (pipeline/run.py), the timestep driver (pipeline/steps.py) and the publishers (stages/publish.py,
stages/decode_worker.py) all speak these; the module imports nothing but the families' shared types.
"""

from dataclasses import dataclass, field

from avatar_cli.families.base import Chunk, RollingState


@dataclass
class ChunkDone:
    chunk: Chunk
    elapsed_s: float  # since the render started
    published: int  # frames handed to the encoder so far


@dataclass
class Stretch:
    """A published stretch of the timeline: frames [start, end) and the sha256 of their uint8 pixels."""

    next_chunk: int  # schedule index of the first chunk still to run
    start: int
    end: int
    digest: str
    state: RollingState  # the rolling state at this point: enough to resume from here (where resumable)
    resumable: bool = True  # False: `state` is not whole here (the timestep pipeline copied no rings after it)


@dataclass
class ResumeFrom:
    next_chunk: int
    state: RollingState


@dataclass
class RenderStats:
    frames: int
    wall_s: float  # render start (models loaded) to the last frame published
    ttff_s: float  # render start to the first frame handed to the encoder
    compute_s: dict[str, float] = field(default_factory=dict)
    flops: dict[str, int] | None = None  # per stage, when the pipeline counts them (count_flops)
