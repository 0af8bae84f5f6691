"""Audio of unknown length (avatar_cli/media/live_audio.py): formats on a pipe, raw PCM, a FIFO, stalls, bad input."""

import io
import os
import threading
import time
from pathlib import Path

import av
import numpy as np
import pytest

from avatar_cli.errors import InputError, RenderError
from avatar_cli.media.live_audio import RawPCM, StreamAudio, _PcmFrames
from avatar_cli.spec import is_stream_input as is_stream

RATE = 16000


def tone(seconds: float, rate: int = RATE, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def encode(samples: np.ndarray, fmt: str, codec: str, rate: int = RATE, channels: int = 1) -> bytes:
    """samples (n,) mono float32 -> a whole file in `fmt`, as a TTS engine or ffmpeg would pipe it."""
    buf = io.BytesIO()
    layout = "mono" if channels == 1 else "stereo"
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate, layout=layout)
        frame_size = s.codec_context.frame_size or 1024
        data = np.repeat(samples[None], channels, axis=0)  # (C, n)
        for i in range(0, data.shape[1], frame_size):
            part = np.ascontiguousarray(data[:, i:i + frame_size])
            f = av.AudioFrame.from_ndarray(part, format="fltp", layout=layout)
            f.sample_rate, f.pts = rate, i
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def piped(data: bytes, pieces: int = 8, pause: float = 0.0) -> io.BufferedReader:
    """A real pipe whose writer sends `data` in pieces, as a live producer would."""
    r, w = os.pipe()

    def feed():
        with os.fdopen(w, "wb") as f:
            step = -(-len(data) // pieces)
            for i in range(0, len(data), step):
                f.write(data[i:i + step])
                f.flush()
                time.sleep(pause)

    threading.Thread(target=feed, daemon=True).start()
    return os.fdopen(r, "rb", buffering=0)


def read_all(audio: StreamAudio) -> np.ndarray:
    assert audio.wait_for(10**12, timeout=60)  # until the input ends
    return audio.read(0, audio.arrived)


def pitch(x: np.ndarray) -> float:
    seg = x[RATE // 4:RATE // 4 + RATE]
    return float(np.argmax(np.abs(np.fft.rfft(seg))) * RATE / seg.size)


def test_is_stream(tmp_path: Path):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    assert is_stream("-") and is_stream("rtmp://0.0.0.0/live/in") and is_stream(str(fifo))
    assert not is_stream(str(tmp_path / "speech.wav"))


def test_wav_with_an_unknown_length_header_is_exact():
    x = tone(1.5)
    wav = bytearray(encode(x, "wav", "pcm_s16le"))
    data = wav.index(b"data") + 4
    wav[4:8] = wav[data:data + 4] = b"\xff\xff\xff\xff"  # RIFF and data sizes unknown, as a live producer writes
    got = read_all(StreamAudio.open("-", rate=RATE, stdin=piped(bytes(wav))))
    assert got.size == x.size
    assert np.abs(got - x).max() <= 1 / 32768  # 16-bit rounding, nothing else


@pytest.mark.parametrize("fmt, codec", [("ogg", "libopus"), ("mp3", "libmp3lame"), ("adts", "aac"),
                                        ("flac", "flac")])
def test_compressed_streams_on_a_pipe(fmt: str, codec: str):
    try:
        data = encode(tone(2.0, rate=48000), fmt, codec, rate=48000)
    except (av.error.FFmpegError, ValueError) as e:
        pytest.fail(f"PyAV cannot write {fmt}/{codec} here: {e}")
    got = read_all(StreamAudio.open("-", rate=RATE, stdin=piped(data)))
    assert abs(got.size / RATE - 2.0) < 0.1  # encoder padding and priming: a few codec frames at most
    assert abs(pitch(got) - 440) <= 2


def test_raw_pcm_needs_its_format_and_is_resampled():
    x = tone(1.0, rate=48000)
    stereo = np.stack([x, x], axis=1)  # (n, 2) interleaved
    data = (stereo * 32767).astype("<i2").tobytes()
    got = read_all(StreamAudio.open("-", rate=RATE, raw=RawPCM("s16le", 48000, 2), stdin=piped(data)))
    assert abs(got.size - RATE) <= 64 and abs(pitch(got) - 440) <= 2
    with pytest.raises(InputError, match="raw sample format"):
        RawPCM("s24", 48000, 1)


def test_a_named_pipe(tmp_path: Path):
    fifo = tmp_path / "speech.fifo"
    os.mkfifo(fifo)
    x = tone(1.0)
    data = encode(x, "wav", "pcm_s16le")
    threading.Thread(target=lambda: fifo.write_bytes(data), daemon=True).start()
    got = read_all(StreamAudio.open(str(fifo), rate=RATE))
    assert got.size == x.size


def test_garbage_is_bad_input():
    audio = StreamAudio.open("-", rate=RATE, stdin=piped(os.urandom(1 << 16)))
    with pytest.raises(InputError, match="audio: stdin: not audio FFmpeg can read"):
        audio.wait_for(RATE, timeout=30)


def test_nothing_arrives():
    r, w = os.pipe()  # held open, never written
    audio = StreamAudio.open("-", rate=RATE, stdin=os.fdopen(r, "rb", buffering=0))
    with pytest.raises(RenderError, match="no audio arrived in 0.3 s"):
        audio.wait_started(0.3)
    os.close(w)


def test_a_stall_inserts_silence_and_later_audio_follows_it():
    r, w = os.pipe()
    raw = RawPCM("f32le", RATE, 1)
    audio = StreamAudio.open("-", rate=RATE, raw=raw, stdin=os.fdopen(r, "rb", buffering=0))
    # Whole raw packets (1024 samples): the demuxer hands over a packet once all of it has arrived.
    first, second = tone(8192 / RATE), tone(0.5, freq=880)
    os.write(w, first.tobytes())
    assert audio.wait_for(first.size, timeout=30)
    assert not audio.wait_for(first.size + RATE, timeout=0.2)  # stalled: nothing more comes
    assert audio.pad_to(first.size + RATE // 4) == RATE // 4  # the chunk goes on with silence
    os.write(w, second.tobytes())
    os.close(w)
    got = read_all(audio)
    assert got.size == first.size + RATE // 4 + second.size
    np.testing.assert_array_equal(got[:first.size], first)
    assert not got[first.size:first.size + RATE // 4].any()
    np.testing.assert_array_equal(got[first.size + RATE // 4:], second)


def test_a_source_that_resumes_goes_where_the_clock_is():
    """resume_at: the next audio to arrive goes at the position the clock gives as it arrives, silence filling up
    to it (reported), and the audio after it follows on; once only."""
    r, w = os.pipe()
    audio = StreamAudio.open("-", rate=RATE, raw=RawPCM("f32le", RATE, 1), stdin=os.fdopen(r, "rb", buffering=0))
    first, second = tone(8192 / RATE), tone(0.5, freq=880)
    os.write(w, first.tobytes())
    assert audio.wait_for(first.size, timeout=30)
    fills = []
    audio.resume_at(lambda: first.size + RATE // 2, lambda at, n: fills.append((at, n)))
    os.write(w, second.tobytes())
    os.close(w)
    got = read_all(audio)
    assert fills == [(first.size, RATE // 2)]
    assert got.size == first.size + RATE // 2 + second.size
    assert not got[first.size:first.size + RATE // 2].any()
    np.testing.assert_array_equal(got[first.size + RATE // 2:], second)  # every later piece follows on


def test_memory_is_bounded_by_release():
    x = tone(4.0)
    audio = StreamAudio.open("-", rate=RATE, raw=RawPCM("f32le", RATE, 1), stdin=piped(x.tobytes(), pieces=32),
                             max_buffer_s=1.0)
    assert audio.wait_for(RATE, timeout=30)
    time.sleep(0.2)
    assert audio.arrived <= RATE + _PcmFrames.READ // 4  # the reader waits: a second held, and one read past it
    pos = 0
    while not audio.ended or pos < audio.arrived:
        audio.wait_for(pos + RATE // 2, timeout=30)
        end = min(audio.arrived, pos + RATE // 2)
        np.testing.assert_array_equal(audio.read(pos, end), x[pos:end])
        audio.release(end)
        pos = end
        if audio.ended and pos >= audio.arrived:
            break
    assert pos == x.size
    with pytest.raises(IndexError):
        audio.read(0, 10)


def test_wav_is_handed_over_as_it_arrives():
    """A TTS engine's WAV on a pipe that stays open: what has arrived is readable before more comes, give or take
    one raw packet (FFmpeg's WAV demuxer would wait for 64 KB of data, two seconds of this audio)."""
    wav = bytearray(encode(tone(2.0), "wav", "pcm_s16le"))
    data = wav.index(b"data") + 4
    wav[4:8] = wav[data:data + 4] = b"\xff\xff\xff\xff"
    r, w = os.pipe()
    os.write(w, bytes(wav[:data + 4 + RATE]))  # the header and 0.5 s of samples
    audio = StreamAudio.open("-", rate=RATE, stdin=os.fdopen(r, "rb", buffering=0))
    assert audio.wait_for(RATE // 2 - 1024, timeout=30) and not audio.ended
    os.close(w)


def test_the_output_reads_the_timeline_with_its_own_cursor():
    """The renderer releases what its features have read; the output's audio track, which lags it, still gets every
    sample (and the inserted silence) until it releases them too."""
    x = tone(1.0)
    audio = StreamAudio.open("-", rate=RATE, raw=RawPCM("f32le", RATE, 1), stdin=piped(x.tobytes()))
    feed = audio.feed()
    assert audio.wait_for(x.size, timeout=30)
    audio.pad_to(x.size + 800)
    audio.release(x.size + 800)  # the renderer is done with all of it
    got = np.concatenate([feed.take(1000)[0] for _ in range(18)])
    np.testing.assert_array_equal(got[:x.size], x)
    assert not got[x.size:].any()
    with pytest.raises(IndexError):
        audio.read(0, 10)  # both readers are past it: freed
