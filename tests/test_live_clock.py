"""A live session on the frame clock (avatar_cli/pipeline/live.py `growing_plan`, media/pacing.py `FramePacer`),
simulated on a fake clock: a source that pauses or trickles, a renderer faster than real time, and a writer that
sends each frame when it is ready, on the clock. Nothing here takes wall time."""

from collections import deque

import pytest

from avatar_cli.families.mini.schedule import plan as mini_plan
from avatar_cli.media.pacing import FramePacer
from avatar_cli.pipeline.live import Stall, growing_plan
from avatar_cli.pipeline.schedule import num_frames

RATE, FPS, LOOKAHEAD_S, PIECE_S = 16000, 25.0, 0.04, 0.02


def plan(total: int):
    return mini_plan(total, 28, 4, True, 4)


class FakeSource:
    """A live source on a fake clock: `arrivals` are (time, samples) pieces, the input ends at `end_at`. Waiting
    (wait_for) advances the clock to the next arrival or the timeout; `resume_at` fills as StreamAudio's does."""

    rate = RATE

    def __init__(self, arrivals: list[tuple[float, int]], end_at: float):
        self.t, self.arrived, self.ended = 0.0, 0, False
        self.pending = deque(arrivals)
        self.end_at = end_at
        self.resume = None

    def now(self) -> float:
        return self.t

    def advance(self, to: float) -> None:
        """The clock goes to `to`, delivering what arrives on the way."""
        while self.pending and self.pending[0][0] <= to:
            t, n = self.pending.popleft()
            self.t = max(self.t, t)
            if self.resume is not None:
                position, on_fill = self.resume
                self.resume, at = None, self.arrived
                if position() > at:
                    self.arrived = position()
                    on_fill(at, self.arrived - at)
            self.arrived += n
        self.t = max(self.t, to)
        self.ended = not self.pending and self.t >= self.end_at

    def wait_for(self, n: int, timeout: float | None) -> bool:
        limit = self.t + timeout
        while self.arrived < n and not self.ended:
            nxt = self.pending[0][0] if self.pending else self.end_at
            if nxt > limit:
                self.advance(limit)
                return self.arrived >= n or self.ended
            self.advance(nxt)
        return True

    def pad_to(self, n: int) -> int:
        add = max(0, n - self.arrived)
        self.arrived += add
        return add

    def resume_at(self, position, on_fill) -> None:
        self.resume = (position, on_fill) if position is not None else None


def speech(at: float, seconds: float, pace: float = 1.0) -> list[tuple[float, int]]:
    """`seconds` of audio in PIECE_S pieces from time `at`, at `pace` times the speaker's (each piece arrives when
    its last sample has been spoken, at that pace)."""
    n = round(seconds / PIECE_S)
    return [(at + (i + 1) * PIECE_S / pace, int(PIECE_S * RATE)) for i in range(n)]


def session(arrivals, stall_s: float = 1.0, speed: float = 2.0):
    """Run the plan over the source with a renderer `speed` times faster than real time; the writer sends frame k
    when it is ready, on the frame clock. Returns (departure time per frame, stalls, the source)."""
    end_at = arrivals[-1][0]
    src = FakeSource(arrivals, end_at)
    start = arrivals[0][0]
    src.advance(start)  # the session waits for its first audio
    stalls: list[tuple[float, Stall]] = []
    ready: list[float] = []
    for chunk in growing_plan(plan, src, FPS, lookahead_s=LOOKAHEAD_S, stall_s=stall_s, now=src.now, start=start,
                              on_stall=lambda s: stalls.append((src.t, s))):
        src.advance(src.t + chunk.length / FPS / speed)  # rendering it
        ready += [src.t] * (chunk.publish_to - len(ready))
    out = FakeSource([], 0.0)  # the writer's thread: its own clock
    pacer = FramePacer(FPS, now=out.now, sleep=lambda s: out.advance(out.t + s))
    left = []
    for k, t in enumerate(ready):
        out.advance(t)
        left.append(pacer.wait(k))
    return left, [s for _, s in stalls], src, stalls


def lateness(left: list[float]) -> list[float]:
    """How late each frame left against the frame clock (its first frame's time + k / fps)."""
    return [t - (left[0] + k / FPS) for k, t in enumerate(left)]


def largest_gap(left: list[float]) -> float:
    return max(b - a for a, b in zip(left, left[1:]))


@pytest.mark.parametrize("pause_s", [0.5, 4.0, 10.0, 60.0])
def test_a_pause_never_freezes_the_stream(pause_s: float):
    """3 s of speech at the speaker's pace, a pause, 3 s more: the largest gap between frames leaving stays within
    stall_s + 0.5 s, the silence inserted totals the pause less at most stall_s, every frame has its audio (speech
    plus silence), and once the speech is back its frames leave on the clock again."""
    stall_s = 1.0
    before = speech(0.0, 3.0)
    after = speech(before[-1][0] + pause_s, 3.0)
    left, stalls, src, _ = session(before + after, stall_s)
    assert largest_gap(left) <= stall_s + 0.5
    silence = sum(s.samples for s in stalls) / RATE
    assert pause_s - stall_s - PIECE_S <= silence <= pause_s + PIECE_S
    assert len(left) == num_frames(6 * RATE + sum(s.samples for s in stalls), RATE, FPS)
    assert src.arrived == 6 * RATE + sum(s.samples for s in stalls)
    late = lateness(left)
    if pause_s > stall_s:  # the source resumed where the clock is: the last chunks as on time as with no pause
        assert max(late[-2 * 28:]) <= max(lateness(session(speech(0.0, 6.0), stall_s)[0])) + PIECE_S
    assert max(late) <= stall_s + 0.5


def test_a_source_at_half_the_speakers_pace():
    """Audio that trickles at half the speaker's pace: the stream never stops for more than stall_s + 0.5 s, and
    what is missing is silence (the stream's length is the audio's plus the silences)."""
    stall_s = 1.0
    left, stalls, src, _ = session(speech(0.0, 5.0, pace=0.5), stall_s)
    assert stalls and largest_gap(left) <= stall_s + 0.5
    silence = sum(s.samples for s in stalls)
    assert len(left) == num_frames(5 * RATE + silence, RATE, FPS)
    assert silence / RATE <= 5.0 + stall_s  # no more silence than the 5 s the source fell behind, and a stall


def test_a_source_ahead_of_the_clock_is_the_files_plan():
    """A source faster than the speaker (a TTS engine) or at its pace needs no silence: the chunks are the file's
    plan of the same audio, whatever the pace."""
    for pace in (1.0, 3.0, 50.0):
        left, stalls, src, _ = session(speech(0.0, 4.0, pace=pace))
        assert not stalls and len(left) == num_frames(4 * RATE, RATE, FPS)


def test_the_deadline_is_the_clocks_time_plus_stall_s():
    """The first stall goes in when the chunk's audio is stall_s past due on the clock: due at the first chunk's
    hand-out plus the speaker's pace since, not stall_s after the loop began to wait."""
    stall_s = 0.6
    arrivals = speech(0.0, 2.0)
    arrivals.append((30.0, 320))  # then nothing for a long while
    _, stalls, _, timed = session(arrivals, stall_s, speed=20.0)  # a renderer far faster than real time
    (t, first), *rest = timed
    # The first chunk (28 frames and the lookahead) went out when its audio had arrived; the second needs audio to
    # frame 56 + the lookahead, due 28 frames later on the clock.
    first_out = (round((28 / FPS + LOOKAHEAD_S) / PIECE_S)) * PIECE_S
    assert t == pytest.approx(first_out + 28 / FPS + stall_s, abs=1e-6)
    assert first.at == 2 * RATE and first.waited_s == pytest.approx(t - 2.0, abs=1e-6)
    # While the source stays silent, each later chunk takes its silence when due: at the speaker's pace.
    times = [t for t, _ in rest if t < 30.0]
    assert times and all(b - a == pytest.approx(28 / FPS, abs=0.05) for a, b in zip(times, times[1:]))


def test_one_pause_is_one_stall_however_many_chunks_it_spans():
    """The session's watch (render/live.py) reports a pause once, when its silence first goes in; the silence of
    the chunks after it adds to that stall, and a later pause is a stall of its own."""
    from avatar_cli.pipeline.events import StallEvent
    from avatar_cli.render.live import Watch
    from avatar_cli.report import QuietReporter

    said = []

    class Events(QuietReporter):
        def live(self, event) -> None:
            said.append(event)

    watch = Watch(RATE, FPS, max_latency_s=5.0)
    n = RATE // 2
    for at in (RATE, RATE + n, RATE + 2 * n, 5 * RATE):  # three pieces of one pause, then another pause
        watch.on_stall(Stall(at=at, samples=n, waited_s=1.0), Events(0))
    assert [(e.at_s, e.silence_s) for e in said if isinstance(e, StallEvent)] == [(1.0, 0.5), (5.0, 0.5)]
    figures = watch.figures(None, None)
    assert figures.stalls == 2 and figures.silence_s == 2.0
