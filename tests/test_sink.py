"""The chunk loop's two plugs: frames go to a Sink (media/sink.py) through a Publisher (stages/publish.py), audio
comes from an AudioSource (media/source.py). Small fakes stand in for the MP4 writer and the decode stage."""

import hashlib
from types import SimpleNamespace

import numpy as np
import torch

from avatar_cli.families.base import Final, RollingState
from avatar_cli.media.audio import AudioWindowReader
from avatar_cli.media.sink import EMPTY_DIGEST, HashingSink, Sink
from avatar_cli.media.source import AudioSource
from avatar_cli.media.writer import Mp4Writer
from avatar_cli.stages.decode_worker import DecodeWorker
from avatar_cli.stages.publish import Publisher, PublishHere, PublishThread


class ListSink:
    def __init__(self):
        self.frames, self.closed, self.aborted = [], False, False

    def put(self, frames: np.ndarray) -> None:
        self.frames.append(frames)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


def frames(n: int, value: int) -> np.ndarray:
    return np.full((n, 4, 6, 3), value, dtype=np.uint8)  # (T, H, W, 3)


class FakeDecode:
    """The DecodePublish stage's surface PublishHere uses: one frame per latent, its value the latent's."""

    def __init__(self, feeds_back: bool = False):
        self.needs = ("vae",)
        self.family = SimpleNamespace(decode_feeds_back=feeds_back)
        self.calls = 0

    def run(self, final: Final, state: RollingState, sink, size, sr=None) -> int:
        self.calls += 1
        if sink is not None:
            for v in final.z.tolist():
                sink.put(frames(1, int(v)))
        return final.frames


def test_hashing_sink_digests_each_stretch_and_passes_everything_on():
    inner = ListSink()
    sink = HashingSink(inner)
    sink.put(frames(2, 7))
    assert sink.first_put is not None
    assert sink.take_digest() == hashlib.sha256(frames(2, 7).tobytes()).hexdigest()
    assert sink.take_digest() == EMPTY_DIGEST  # the next stretch starts empty
    sink.close()
    sink.abort()
    assert len(inner.frames) == 1 and inner.closed and inner.aborted


def test_publish_here_decodes_into_its_sink_and_reports_the_stretch():
    stage, inner = FakeDecode(), ListSink()
    out = PublishHere(stage, inner, (6, 4))
    assert out.needs == ("vae",)
    state = RollingState(published=3)
    [stretch] = out.publish(Final(3, 5, torch.tensor([1.0, 2.0])), 4, state)
    assert (stretch.next_chunk, stretch.start, stretch.end, stretch.state) == (4, 3, 5, state)
    assert state.published == 5 and out.first_put is not None and out.finish(state) == []
    assert stretch.digest == hashlib.sha256(frames(1, 1).tobytes() + frames(1, 2).tobytes()).hexdigest()
    out.close()
    assert inner.closed


def test_a_rank_that_writes_nothing_decodes_only_for_a_family_that_feeds_back():
    skip = PublishHere(FakeDecode(), None, (6, 4))
    state = RollingState()
    [stretch] = skip.publish(Final(0, 2, torch.zeros(2)), 1, state)
    assert (skip.needs, skip.stage.calls) == ((), 0)
    assert (stretch.digest, state.published) == (EMPTY_DIGEST, 2)

    feeds_back = PublishHere(FakeDecode(feeds_back=True), None, (6, 4))
    feeds_back.publish(Final(0, 2, torch.zeros(2)), 1, RollingState())
    assert (feeds_back.needs, feeds_back.stage.calls) == (("vae",), 1)


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def test_the_shipped_implementations_have_every_member_of_their_protocol():
    for cls, protocol in ((Mp4Writer, Sink), (HashingSink, Sink), (AudioWindowReader, AudioSource),
                          (PublishHere, Publisher), (DecodeWorker, Publisher),
                          (PublishThread, Publisher)):
        missing = {m for m in members(protocol) if not hasattr(cls, m)}
        if cls in (PublishHere, DecodeWorker, PublishThread):  # attributes set in __init__
            missing -= {"first_put", "seconds", "needs"}
        assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {protocol.__name__}"
