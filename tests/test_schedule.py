"""The N/I chunk plan: order, frame bookkeeping, I-chunk replacement, audio alignment."""

import pytest
import torch

from avatar_cli.families.mini.audio import AudioParams, frame_window_starts
from avatar_cli.families.mini.schedule import plan
from avatar_cli.pipeline.schedule import num_frames


def covered(chunks):
    frames = []
    for c in chunks:
        frames.extend(range(*c.keep))
    return frames


def test_order_is_n0_n1_i0_n2_i1():
    names = [c.name for c in plan(100, 24, 4, True, 6)]
    assert names == ["N0", "N1", "I0", "N2", "I1", "N3", "I2", "N4", "I3"]


@pytest.mark.parametrize("total", [1, 5, 23, 24, 25, 47, 48, 49, 73, 100, 241])
@pytest.mark.parametrize("transitions", [True, False])
def test_every_frame_kept_exactly_once(total, transitions):
    chunks = plan(total, 24, 4, transitions, 6)
    assert sorted(covered(chunks)) == list(range(total))


def test_i_chunk_anchors_and_replacement():
    chunks = {c.name: c for c in plan(72, 24, 4, True, 6)}
    n1, i0 = chunks["N1"], chunks["I0"]
    # N1 continues from the last 4 frames of N0 and keeps only what I0 does not regenerate.
    assert (n1.start, n1.length, n1.cond) == (20, 28, (0, 1, 2, 3))
    assert n1.keep == (30, 48)
    # I0: anchor 0 = last frame of N0 (23), anchor 1 = an early frame of N1 (30); regenerates 24..29.
    assert i0.start == 23 and i0.start + i0.cond[1] == 30
    assert i0.keep == (24, 30)
    assert i0.cond == (0, i0.length - 1)


def test_publish_as_soon_as_final():
    chunks = plan(72, 24, 4, True, 6)
    published = {c.name: c.publish_to for c in chunks}
    assert published["N0"] == 24  # N0 goes out at once: no later chunk changes it
    assert published["N1"] == 24  # N1's frames wait for I0
    assert published["I0"] == 48
    assert chunks[-1].publish_to == 72
    # Never goes backwards and never past what was generated.
    seen = 0
    for c in chunks:
        assert c.publish_to >= seen
        seen = c.publish_to


def test_short_last_chunk_gets_a_shorter_transition():
    chunks = plan(50, 24, 4, True, 6)  # N2 has only 2 frames: 48, 49
    n2 = [c for c in chunks if c.name == "N2"][0]
    i1 = [c for c in chunks if c.name == "I1"][0]
    assert i1.keep == (48, 49) and i1.start + i1.cond[1] == 49  # anchor 1 is N2's last frame
    assert n2.keep == (49, 50)
    single = plan(49, 24, 4, True, 6)  # N2 has a single frame: no room for a transition
    assert [c.name for c in single][-1] == "N2"


def test_motion_frames_never_rewritten_by_transitions():
    for c in plan(240, 24, 4, True, 6):
        if c.kind == "I":
            continue
        if c.index > 0:
            prev_tail = range(c.start, c.start + len(c.cond))
            rewritten = [f for i in plan(240, 24, 4, True, 6) if i.kind == "I" for f in range(*i.keep)]
            assert not set(prev_tail) & set(rewritten)


@pytest.mark.parametrize("duration,fps,expected", [(2.3, 25, 58), (1.0, 25, 25), (0.019, 25, 0), (0.021, 25, 1),
                                                   (10.01, 29.97, 300), (3.333, 24, 80)])
def test_frame_count_is_rounded_duration(duration, fps, expected):
    rate = 48_000
    assert num_frames(round(duration * rate), rate, fps) == expected


@pytest.mark.parametrize("fps", [25.0, 24.0, 29.97])
def test_audio_window_centred_on_each_frame(fps):
    p = AudioParams()
    starts = frame_window_starts(0, 1000, fps, p)
    centres = (starts + p.window_samples // 2).double() / p.sample_rate  # seconds
    expected = (torch.arange(1000, dtype=torch.float64) + 0.5) / fps
    assert (centres - expected).abs().max() < 1.0 / p.sample_rate
    # A window for a chunk starting mid-video equals the same frames' windows from the start.
    assert torch.equal(frame_window_starts(517, 30, fps, p), starts[517:547])


def test_last_frames_audio_windows_reach_past_the_end():
    p = AudioParams()
    total = num_frames(2.3 * 16_000, 16_000, 25)  # 58 frames; the audio ends at 2.3 s
    starts = frame_window_starts(total - 1, 1, 25, p)
    end_s = (starts[0] + p.window_samples) / p.sample_rate
    assert end_s > 2.3  # the last window hangs past the audio; the reader zero-pads it


def test_a_plan_needs_transitions_resolved_and_so_does_the_pipeline():
    """`auto` must never reach the plan as a truthy string (it did, through make bench's direct Pipeline): job.resolve
    resolves it once, and Pipeline.schedule takes the bool."""
    from avatar_cli.families.mini.config import SIZES
    from avatar_cli.families.mini.family import MiniFamily
    from avatar_cli.pipeline.run import Pipeline
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.spec import JobSpec

    with pytest.raises(TypeError, match="transitions"):
        plan(100, 24, 4, "auto", 6)
    family = MiniFamily(SIZES["tiny"])
    pipeline = Pipeline({}, family, Runtime(torch.device("cpu"), torch.float32), absent=family.components)
    spec = JobSpec(reference="r.png", audio="a.wav", output="o.mp4")
    assert spec.chunking.transitions == "auto"
    with pytest.raises(TypeError, match="transitions"):
        pipeline.schedule(spec, 100)
    spec.chunking.transitions = False
    assert {c.kind for c in pipeline.schedule(spec, 100)} == {"N"}
    spec.chunking.transitions = True
    assert {c.kind for c in pipeline.schedule(spec, 100)} == {"N", "I"}
