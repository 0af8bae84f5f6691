"""A live session's plan (avatar_cli/pipeline/live.py): it grows with the audio, waits for it, and goes on over
silence where it stalls; the chunks are those of the file's plan of the same audio."""

import threading
import time

import pytest

from avatar_cli.families.mini.schedule import plan as mini_plan
from avatar_cli.pipeline.live import Stall, growing_plan
from avatar_cli.pipeline.schedule import num_frames

RATE, FPS = 16000, 25.0  # a float, as the job spec gives it


class FakeAudio:
    """A live source driven by the test: `arrive(n)` adds samples; `end()` closes it; pad_to inserts silence. Its
    clock `t` moves only when a wait for audio times out (nothing else feeds it then), so a stall takes no time."""

    rate = RATE

    def __init__(self):
        self.arrived, self.ended, self.pads, self.t, self.resume = 0, False, [], 0.0, None
        self.cond = threading.Condition()

    def now(self) -> float:
        return self.t

    def arrive(self, n: int) -> None:
        with self.cond:
            self.arrived += n
            self.cond.notify_all()

    def end(self) -> None:
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float | None) -> bool:
        with self.cond:
            ok = self.cond.wait_for(lambda: self.arrived >= n or self.ended, min(timeout, 1.0))
            if not ok:
                self.t += timeout
            return ok

    def pad_to(self, n: int) -> int:
        with self.cond:
            add = max(0, n - self.arrived)
            self.arrived += add
            self.pads.append((n - add, add))
            return add

    def resume_at(self, position, on_fill) -> None:
        self.resume = position


def plan_of(transitions: bool):
    return lambda total: mini_plan(total, 28, 4, transitions, 4)


@pytest.mark.parametrize("transitions", [False, True])
@pytest.mark.parametrize("seconds", [0.3, 1.12, 3.0, 7.77])
def test_the_grown_plan_is_the_files_plan(transitions: bool, seconds: float):
    """Audio arriving in uneven pieces, then ending: the chunks handed out are exactly the plan of the whole audio,
    and each was handed out only once its audio (and lookahead) had arrived."""
    audio = FakeAudio()
    total = int(seconds * RATE)
    pieces = [1000, 7000, 333, 16000, 4000] * 100
    got, arrived_at_yield = [], []

    def feed():
        sent = 0
        for n in pieces:
            n = min(n, total - sent)
            if n <= 0:
                break
            time.sleep(0.001)
            audio.arrive(n)
            sent += n
        audio.end()

    threading.Thread(target=feed, daemon=True).start()
    for chunk in growing_plan(plan_of(transitions), audio, FPS, lookahead_s=0.05, stall_s=30):
        got.append(chunk)
        arrived_at_yield.append((audio.arrived, audio.ended))
    assert got == plan_of(transitions)(num_frames(total, RATE, FPS))
    assert not audio.pads
    for chunk, (arrived, ended) in zip(got, arrived_at_yield):
        assert ended or arrived >= chunk.end * RATE // FPS + 0.05 * RATE


def test_a_stall_renders_on_silence_and_the_audio_continues_after_it():
    audio = FakeAudio()
    stalls: list[Stall] = []
    gen = growing_plan(plan_of(False), audio, FPS, stall_s=0.2, on_stall=stalls.append, now=audio.now, start=0.0)
    audio.arrive(RATE * 2)  # 2 s: the first chunk (28 frames = 1.12 s) can go
    first = next(gen)
    assert first.end == 28 and not stalls
    second = next(gen)  # needs audio to frame 56 (2.24 s): nothing more comes, so silence once 0.2 s past due
    assert audio.t == pytest.approx(28 / FPS + 0.2)  # due 28 frames after the first chunk set out, on the clock
    assert second.end == 56 and len(stalls) == 1
    assert stalls[0].at == 2 * RATE and stalls[0].samples == 56 * RATE // FPS - 2 * RATE
    assert audio.resume is not None and audio.resume() == int(56 * RATE // FPS + 0.2 * RATE)  # where the clock is
    audio.arrive(RATE)  # late audio continues after the inserted silence
    audio.end()
    rest = list(gen)
    total = num_frames(56 * RATE // FPS + RATE, RATE, FPS)
    assert [first, second, *rest] == plan_of(False)(total)


class QueueWire:
    """Ranks in one process, as runtime/wire.py's Wire: what rank 0 sends to rank r lands in queue r, named."""

    def __init__(self, world: int):
        import queue

        self.boxes = {r: queue.Queue() for r in range(1, world)}

    def send(self, dst, name, t):
        self.boxes[dst].put((name, t.clone()))

    def recv(self, src, name):  # noqa: ARG002 -- only rank 0 sends
        got, t = self.boxes[self.rank].get(timeout=10)
        assert got == name
        return t

    def flush(self):
        pass


def test_the_relay_reads_only_what_rank_0_still_holds():
    """Rank 0 sends a chunk's samples from no earlier than what its source still holds (its features released the
    rest), each other rank gets every chunk (fields and kinds intact) and reads the same values back, and rank 0's
    source is released behind the chunks it relayed."""
    import numpy as np

    from avatar_cli.pipeline.live import ChunkRelay, RelayedAudio
    from avatar_cli.families.base import Chunk

    class Source:
        rate = 16000
        held_from = 25000  # above the span's start (23600): the relay must not read below it
        released = 0

        def read(self, a, b):
            assert a >= self.held_from
            return np.arange(a, b, dtype=np.float32)

        def release(self, before, reader):
            assert reader == "relay"
            self.released = before

    chunks = [Chunk("N", 0, 40, 24, (), (40, 64), 64), Chunk("I", 1, 60, 10, (0, 9), (62, 66), 66)]
    wire = QueueWire(3)
    span = lambda c: (c.start * 640 - 2000, c.end * 640)  # noqa: E731
    source = Source()
    sent = list(ChunkRelay(wire, 3, span, 25.0).send(chunks, source))
    assert sent == chunks
    assert source.released == 60 * 640 - 2000 - 640  # the last chunk's span, less a frame (an I chunk's anchor)
    for rank in (1, 2):
        wire.rank = rank
        relayed = RelayedAudio(16000)
        got = list(ChunkRelay(wire, 3, span, 25.0).receive(relayed))
        assert got == chunks
        np.testing.assert_array_equal(relayed.read(60 * 640, 60 * 640 + 10),
                                      np.arange(60 * 640, 60 * 640 + 10, dtype=np.float32))
        with pytest.raises(Exception, match="not relayed"):
            relayed.read(20000, 20010)  # below what rank 0 held: never sent


def test_a_failure_in_rank_0s_plan_reaches_its_loop():
    from avatar_cli.pipeline.live import ChunkRelay

    def plan():
        raise RuntimeError("audio: the input broke")
        yield  # noqa: unreachable -- a generator

    with pytest.raises(RuntimeError, match="the input broke"):
        list(ChunkRelay(QueueWire(2), 2, lambda c: (0, 1), 25.0).send(plan(), type("Audio", (), {"rate": 16000})))
