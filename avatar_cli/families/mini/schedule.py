"""The chunk schedule: N0 -> N1 -> I0 -> N2 -> I1 -> ...

N chunks carry the timeline, F new frames each; N(k) for k >= 1 is conditioned on the last M frames
of N(k-1). I(k-1) runs right after N(k): it regenerates the frames just after the seam, between
two clean anchors (the last frame of N(k-1) and an early frame of N(k)), so the seam is smoothed
without touching anything the next N chunk is conditioned on (validation ensures M + a <= F).

A stretch of the timeline is published as soon as no later chunk can change it.
"""

from avatar_cli.families.base import Chunk


def plan(total: int, frames: int, motion: int, transitions: bool, transition_frames: int) -> list[Chunk]:
    """The whole schedule for a video of `total` frames. Pure: no tensors, no I/O."""
    if not isinstance(transitions, bool):  # `auto` is resolved for the device before a plan is made
        raise TypeError(f"transitions must be True or False here, got {transitions!r}")
    chunks: list[Chunk] = []
    n_count = -(-total // frames)  # ceil
    published = 0
    for k in range(n_count):
        new_start, new_end = k * frames, min((k + 1) * frames, total)
        m = motion if k > 0 else 0
        # The I chunk after this N chunk regenerates `a` frames after the seam; it needs an anchor
        # inside this chunk, so a short final chunk gets a shorter transition (or none).
        a = min(transition_frames, new_end - new_start - 1) if (transitions and k > 0) else 0
        keep = (new_start + a, new_end)
        if a == 0:
            published = new_end
        chunks.append(Chunk("N", k, new_start - m, m + new_end - new_start, tuple(range(m)), keep, published))
        if a > 0:
            published = new_end
            chunks.append(Chunk("I", k - 1, new_start - 1, a + 2, (0, a + 1), (new_start, new_start + a), published))
    return chunks
