"""The wan-s2v streaming mode (avatar_cli/families/wan_s2v/live.py): block and audio arithmetic; the family's block loop
against THEIR CausalWanModel_S2V goldens (tests/golden/make_liveavatar_goldens.py); determinism, bounded state and a
resume from a saved RollingState on the golden tiny DiT; a render through avatar_cli.render (the job's mode key
choosing the streaming family), kill -9 and --resume, and TTFF vs clip mode."""

import contextlib
import io
import json
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import av
import pytest
import torch

from avatar_cli.families.base import Final, RollingState, Sampling
from avatar_cli.families.wan_s2v import live
from avatar_cli.families.wan_s2v.family import WanS2VFamily
from avatar_cli.families.wan_s2v.live import LiveAvatarFamily
from avatar_cli.families.wan_s2v.vae import WanVAECache
from avatar_cli.families import registry
from avatar_cli.pipeline.checkpoint import state_from_tensors, state_tensors
from avatar_cli.pipeline.schedule import num_frames
from tests.conftest import avatar, start_avatar, write_reference, write_wav
from tests.test_wan_causal import golden, model, rel  # noqa: F401 (fixtures)
from tests.test_wan_family import events

REPO = Path(__file__).resolve().parent.parent
FPS = 16
CHUNKING = SimpleNamespace(frames=12, motion_frames=0, transitions=False)
SAMPLING = Sampling(4, 1.0, 3.0)
SECONDS = 4.3  # round(4.3 x 16) = 69 frames = 9 + 5 x 12: 6 blocks, across the sink refresh and the ring's wrap


def family() -> LiveAvatarFamily:
    return LiveAvatarFamily(None)  # plan, check_job, denoise and keep read nothing of the config


# --- arithmetic ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("total", [1, 9, 10, 21, 22, 45, 69, 1000])
def test_blocks_cover_the_timeline_once(total: int):
    chunks = family().plan(CHUNKING, total)
    assert [f for c in chunks for f in range(*c.keep)] == list(range(total))
    assert all(c.length == 12 and c.publish_to == c.keep[1] for c in chunks)
    assert chunks[0].keep == (0, min(9, total))  # the very first block yields 9 frames
    assert all(c.keep[1] - c.keep[0] == 12 for c in chunks[1:-1])
    assert len(chunks) == 1 + max(0, -(-(total - 9) // 12))


class TaggingVAE:
    """Stands in for the VAE: each decoded frame's value is its index on the decode timeline (a timeline's first
    latent makes 1 frame, every later one 4)."""

    def decode_stream(self, z, cache):
        n = 0 if cache is None else cache.latents
        first = 0 if n == 0 else 1 + 4 * (n - 1)
        count = 1 if n == 0 else 4
        frames = torch.arange(first, first + count, dtype=torch.float32)  # (T,)
        return frames[None, None, :, None, None].expand(1, 3, count, 2, 2), WanVAECache([], n + 1)


def test_lip_sync_arithmetic(monkeypatch):
    """Output frame k must be made with the audio of frame k, through the family's own context and decode.

    Block g's window position i (decoded frame i of the block, the 25 priming frames before block 0) reads the audio
    of frame start + i (context's window) and must be published as timeline frame start + i (decode's skip and
    count). Their pipeline gives decoded frame i of block g the audio of frame 12 g + i and publishes it as output
    frame 12 g + i - 3 (block 0 drops i < 3): a lead of 3 frames, which ours removes."""
    f = family()
    windows = []
    monkeypatch.setattr(f, "clip_audio", lambda models, audio, start, length, fps: windows.append((start, length))
                        or torch.zeros(1, 25, 4, length))
    total, state = 30, RollingState()
    published = []
    for c in f.plan(CHUNKING, total):
        f.context({}, c, None, FPS, {"text": None}, state, 0, torch.device("cpu"), torch.float32)
        start, length = windows[-1]
        latents = live.PRIME_LATENTS + 3 if c.index == 0 else 3
        final = Final(c.keep[0], c.keep[1], torch.zeros(latents, 16, 1, 1))
        got = []
        f.decode({"vae": TaggingVAE()}, final, state, lambda x: got.extend(x[:, 0, 0, 0].int().tolist()))
        for k, decoded in zip(range(*c.keep), got):
            i = decoded - live.PRIME_FRAMES - 12 * c.index  # window position
            assert 0 <= i < length and start + i == k, (c.index, k, i)  # made with the audio of frame k
            their_output, their_audio = 12 * c.index + i - 3, 12 * c.index + i
            assert their_output == k and their_audio - k == live.LEAD
        assert len(got) == c.keep[1] - c.keep[0]
        published += list(range(*c.keep))
    assert published == list(range(total)) and windows[0] == (-3, 12)


def test_sink_offsets_and_noise_are_seeded():
    offsets = [live.sink_offset(3, g, s) for g in range(200) for s in range(4)]
    assert set(offsets) == set(range(4, 31))  # their randint(4, 30), every value reached
    assert offsets == [live.sink_offset(3, g, s) for g in range(200) for s in range(4)]
    assert offsets != [live.sink_offset(4, g, s) for g in range(200) for s in range(4)]
    random.seed(1)  # Python's global generator plays no part
    assert live.sink_offset(3, 5, 2) == offsets[5 * 4 + 2]
    assert torch.equal(live.clip_noise(3, 1, 16, 8, 8), live.clip_noise(3, 1, 16, 8, 8))
    assert not torch.equal(live.clip_noise(3, 1, 16, 8, 8), live.clip_noise(3, 2, 16, 8, 8))


def test_check_job_and_modes():
    f = family()
    f.check_job(CHUNKING, SAMPLING)
    f.check_job(CHUNKING, Sampling(2, 1.0, 5.0))  # another schedule is the job's choice
    for chunking, sampling, words in (
            (SimpleNamespace(frames=80, motion_frames=0, transitions=False), SAMPLING, "chunking.frames: 80"),
            (SimpleNamespace(frames=12, motion_frames=73, transitions=False), SAMPLING, "motion_frames: 73"),
            (SimpleNamespace(frames=12, motion_frames=0, transitions=True), SAMPLING, "no I chunks"),
            (CHUNKING, Sampling(4, 4.5, 3.0), "without guidance")):
        with pytest.raises(ValueError, match=words):
            f.check_job(chunking, sampling)
    defaults = f.job_defaults()
    assert {k: defaults[k] for k in ("video.fps", "sampling.steps", "sampling.guidance", "sampling.shift",
                                     "chunking.frames", "chunking.transitions")} == {
        "video.fps": 16, "sampling.steps": 4, "sampling.guidance": 1.0, "sampling.shift": 3.0, "chunking.frames": 12,
        "chunking.transitions": False}
    assert f.frame_size((1920, 1080), None) == (704, 384)  # their --size 720*400
    assert type(live.family_for_mode(None, "clip")) is WanS2VFamily
    assert type(live.family_for_mode(None, "streaming")) is LiveAvatarFamily
    with pytest.raises(ValueError, match="clip or streaming"):
        live.family_for_mode(None, "live")


# --- the block loop on the golden tiny DiT -----------------------------------------------------------------------

def state_bytes(state: RollingState) -> int:
    return sum(t.numel() * t.element_size() for t in state.tensors.values())


def run_blocks(model, golden, seed: int, blocks: range, state: RollingState | None = None,
               saved: dict | None = None) -> tuple[list, list]:
    """The family's block loop as the Pipeline drives it on a rank that does not decode (denoise, keep, the held
    latents taken): block g's latents and the state's bytes after it. Audio: the recording's per-block slices.
    saved: block -> None, filled with checkpoint.py's state_tensors of the state after that block."""
    f, state = family(), state if state is not None else RollingState()
    ref = {"ref": golden["input.ref"], "motion": golden["input.motion"]}
    chunks = f.plan(CHUNKING, 12 * blocks.stop)
    out, nbytes = [], []
    for g in blocks:
        audio = golden[f"clip{(g // 4) % 2}.block{g % 4}.audio"]  # (1, 25, C_a, 12)
        inputs = {"audio": audio, "text": golden["input.context"], "seed": seed, "block": g}
        z = f.denoise({"dit": model}, inputs, ref, SAMPLING, state)  # (F, 16, h, w)
        f.keep(chunks[g], z, state, CHUNKING)
        assert state.take_final(chunks[g].publish_to) is not None
        out.append(z)
        nbytes.append(state_bytes(state))
        if saved is not None and g in saved:
            saved[g] = {k: v.clone() for k, v in state_tensors(state).items()}  # as written to the checkpoint
    return out, nbytes


def test_block_loop_matches_liveavatar(model, golden, monkeypatch):
    """The family's denoise over their 2 clips x 4 blocks, with their sink offsets and noise seed: the latents of
    every block within 1e-5 of THEIR pipeline's (the sink refreshed at block 4 with our own block 0's first latent,
    the noise sliced per block from Generator(420 + clip))."""
    for r in range(2):
        assert torch.equal(live.clip_noise(420, r, 16, 8, 16), golden[f"clip{r}.noise"])
    monkeypatch.setattr(live, "sink_offset",
                        lambda seed, g, s: int(golden[f"clip{g // 4}.block{g % 4}.sink_offset"][s]))
    out, _ = run_blocks(model, golden, 420, range(8))
    assert torch.equal(out[0][:live.PRIME_LATENTS], golden["input.motion"][:, :7].transpose(0, 1))  # the priming
    for g, z in enumerate(out):
        want = golden[f"clip{g // 4}.block{g % 4}.latents"].transpose(0, 1)  # (3, 16, h, w)
        assert rel(z[-3:], want) < 1e-5, (g, rel(z[-3:], want))


def test_state_is_bounded_and_resumes_bit_identically(model, golden):
    """8 blocks with the seeded offsets: the state's bytes stay constant once block 4 has refreshed the sink (the
    sink frame then leaves it; the rings are written in place). The state saved after block 3 (before the refresh)
    and after block 5, put through checkpoint.py's state_tensors / state_from_tensors, continues bit-identically.
    Same seed, same latents; another seed, others."""
    saved = {3: None, 5: None}
    out, nbytes = run_blocks(model, golden, 3, range(8), saved=saved)
    assert len(set(nbytes[4:])) == 1, nbytes
    assert nbytes[3] - nbytes[4] == 16 * 8 * 16 * 4  # the sink frame (16, 1, h, w) float32, gone after block 4
    for at, tensors in saved.items():
        restored = state_from_tensors(tensors, [], 0, torch.device("cpu"))
        again, _ = run_blocks(model, golden, 3, range(at + 1, 8), restored)
        assert all(torch.equal(a, b) for a, b in zip(again, out[at + 1:])), at
    first, _ = run_blocks(model, golden, 3, range(1))
    other, _ = run_blocks(model, golden, 4, range(1))
    assert torch.equal(first[0], out[0]) and not torch.equal(other[0][7:], out[0][7:])


# --- renders through avatar_cli.render ----------------------------------------------------------------------------------

@contextlib.contextmanager
def recording(family_class: type) -> Iterator[dict]:
    """Records, while in the block, what `family_class`'s own decode did: which class ran it ("family"), when it
    first handed frames to the encoder ("first_put") and, per decoded block, the rolling state's tensor bytes (held
    stretches included) and the decoder cache's. The job's mode key picks the family, as a user's job does."""
    log: dict = {}
    decode = family_class.decode

    def recorded(self, models, final, state, put):
        log.setdefault("family", type(self))

        def timed(x):
            log.setdefault("first_put", time.perf_counter())
            put(x)

        made = decode(self, models, final, state, timed)
        held = sum(z.numel() * z.element_size() for _, _, z in state.held)
        log.setdefault("bytes", []).append(state_bytes(state) + held)
        log.setdefault("vae_bytes", []).append(sum(t.numel() * t.element_size() for k, t in state.tensors.items()
                                                   if k.startswith("vae.")))
        return made

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(family_class, "decode", recorded)
        yield log


def cli(*args: str) -> subprocess.CompletedProcess:
    return avatar(*args, cwd=REPO)


def killed_after(chunks: int, *args: str) -> None:
    """Run the CLI in a process of its own and SIGKILL it as soon as it has reported `chunks` chunks."""
    proc = start_avatar(*args, cwd=REPO)
    try:
        reported = (line for line in proc.stdout if json.loads(line)["event"] == "chunk")
        for _ in range(chunks):
            next(reported)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wan_live") / "Wan2.2-S2V-tiny"
    registry.init_family_dir(directory, "tiny", seed=0, family="wan-s2v")
    return directory


def write_job(folder: Path, wan_dir: Path, seconds: float = SECONDS) -> Path:
    """A streaming job of the tiny model at 64x64, float32 (and lossless video: frames compare exactly)."""
    write_reference(folder / "ref.png")
    write_wav(folder / "speech.wav", seconds)
    (folder / "job.yaml").write_text(
        f"reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: {wan_dir}\nprompt: a person talking\n"
        "mode: streaming\nseed: 3\nvideo: {width: 64, height: 64, crf: 0}\n"
        "runtime: {dtype: float32, text_cache: off}\n")
    return folder / "job.yaml"


def render_in_process(job: Path, family_class: type, overrides: list[str] = ()) -> tuple[dict, dict]:
    """The job rendered through avatar_cli.render in this process -> (its summary, `recording(family_class)`'s log)."""
    from avatar_cli.job import resolve
    from avatar_cli.report import JsonReporter
    from avatar_cli.render import render
    from avatar_cli.spec import load_job

    with recording(family_class) as log:
        p = resolve(load_job(job, list(overrides)), force=True)
        t0 = time.perf_counter()
        done = render(p, JsonReporter(io.StringIO()))
    assert log["family"] is family_class  # the job's mode key chose it
    done["start"] = t0
    return done, log


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, wan_dir: Path) -> tuple[Path, dict, dict]:
    """One streaming render of the tiny model (float32, lossless video) through avatar_cli.render, in this process."""
    job = write_job(tmp_path_factory.mktemp("live_render"), wan_dir)
    done, log = render_in_process(job, LiveAvatarFamily)
    return job, done, log


@pytest.mark.slow
def test_streaming_render(streamed):
    job, done, log = streamed
    expected = num_frames(int(SECONDS * 16000), 16000, FPS)
    assert done["frames"] == expected == 69
    with av.open(str(job.parent / "out" / "video.mp4")) as c:
        v = c.streams.video[0]
        assert sum(1 for _ in c.decode(video=0)) == expected
        assert (v.width, v.height, float(v.average_rate)) == (64, 64, 16.0)
    # Bounded: the decoder cache is constant from block 0 (primed), the whole state from block 4 on.
    assert len(log["bytes"]) == 6 and len(set(log["vae_bytes"])) == 1
    assert len(set(log["bytes"][4:])) == 1 and log["bytes"][3] > log["bytes"][4]


@pytest.mark.slow
def test_kill_9_then_resume_is_bit_identical(streamed, tmp_path: Path):
    """Every rolling tensor (rings, sink, sink frame, decoder cache) is saved at every block: a render killed with
    SIGKILL and resumed makes the same frames as the uninterrupted one."""
    job, done, _ = streamed
    (tmp_path / "job.yaml").write_text(job.read_text().replace("ref.png", str(job.parent / "ref.png"))
                                       .replace("speech.wav", str(job.parent / "speech.wav")))
    out = tmp_path / "out" / "video.mp4"
    # After 5 of the 6 blocks (57 frames made): the file then holds whole fragments up to keyframe 16 or 32 (the
    # encoder's lookahead holds ~13 frames back; a fragment reaches the disk when the next keyframe is muxed), so the
    # resume restarts at block 1 or 2 from its saved state. Resuming across the sink refresh at block 4 is
    # test_state_is_bounded_and_resumes_bit_identically's.
    kill_at = 5
    killed_after(kill_at, "render", str(tmp_path / "job.yaml"), "--json")
    assert not out.exists()
    resumed = cli("render", str(tmp_path / "job.yaml"), "--resume", "--json")
    assert resumed.returncode == 0, f"killed after block {kill_at}: {resumed.stderr}"
    assert "differ from the interrupted render" not in resumed.stderr
    again = events(resumed.stdout)[-1]
    assert again["resumed_at"] > 0, f"killed after block {kill_at}: resumed from scratch"
    assert again["frames"] == done["frames"]
    assert again["frames_digest"] == done["frames_digest"], f"killed after block {kill_at}"


@pytest.mark.slow
def test_time_to_first_frame_vs_clip_mode(streamed):
    """Reported, not asserted: the same job (inputs, seed, size) in clip mode, at 4 steps to keep the test short
    (its default is 40 steps with CFG, two forwards each: 20 x the DiT work of this run)."""
    job, done, log = streamed
    clip, clip_log = render_in_process(job, WanS2VFamily, ["mode=clip", "sampling.steps=4"])
    assert clip["frames"] == done["frames"]
    stream_first = log["first_put"] - done["start"]
    clip_first = clip_log["first_put"] - clip["start"]
    print(f"\nTTFF, tiny 64x64 float32 on this CPU ({torch.get_num_threads()} threads): streaming "
          f"{done['ttff_s']:.2f} s to the first block published ({stream_first:.2f} s to its first frame, "
          f"{done['compute_s'].get('decode', 0):.1f} s decoding in all); clip mode at 4 steps {clip['ttff_s']:.2f} s "
          f"to the first clip published ({clip_first:.2f} s to its first frame)")
