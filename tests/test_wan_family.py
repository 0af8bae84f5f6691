"""The wan-s2v family end to end on a tiny random model in the official layout: `models init`, the clip plan
and its lip-sync arithmetic, a render (1 rank; 2 ranks in test_multirank_render.py), kill -9 and resume."""

import json
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest

from avatar_cli.families.base import Sampling
from avatar_cli.families.wan_s2v.family import LEAD, WanS2VFamily, size_less_than_area
from avatar_cli.families.registry import check_model, init_family_dir, resolve_model
from avatar_cli.pipeline.schedule import num_frames
from tests.conftest import avatar, avatar_process, start_avatar, write_reference, write_wav

FPS = 16


def cli(*args: str) -> subprocess.CompletedProcess:
    return avatar(*args)


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wan") / "Wan2.2-S2V-tiny"
    init_family_dir(directory, "tiny", seed=0, family="wan-s2v")
    return directory


@pytest.fixture
def wan_job(tmp_path: Path, wan_dir: Path) -> Path:
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 6.3)
    (tmp_path / "job.yaml").write_text(
        f"reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: {wan_dir}\nprompt: a person talking\n"
        "seed: 3\nvideo: {width: 64, height: 64}\nsampling: {steps: 2}\n")
    return tmp_path


def test_models_init_writes_the_official_layout(wan_dir: Path, tmp_path: Path):
    names = {p.name for p in wan_dir.iterdir()}
    assert {"config.json", "diffusion_pytorch_model.safetensors.index.json", "Wan2.1_VAE.pth",
            "models_t5_umt5-xxl-enc-bf16.pth", "google", "wav2vec2-large-xlsr-53-english"} <= names
    src = resolve_model(str(wan_dir), tmp_path)
    assert src.family.name == "wan-s2v" and src.config.vae_preset == "tiny" and src.config.t5_preset == "tiny"
    check_model(src)  # headers fit our modules
    # A second init into the same (now non-empty) folder is refused, and nothing is touched.
    before = sorted(p.name for p in wan_dir.iterdir())
    result = cli("models", "init", str(wan_dir), "--family", "wan-s2v")
    assert result.returncode == 2 and "not empty" in result.stderr
    assert sorted(p.name for p in wan_dir.iterdir()) == before


def test_family_defaults_apply_under_the_job(wan_job: Path):
    from avatar_cli.spec import load_job

    job = load_job(wan_job / "job.yaml")
    s = job.spec
    assert (s.video.fps, s.sampling.steps, s.sampling.guidance, s.sampling.shift) == (16, 2, 4.5, 3.0)
    assert (s.chunking.frames, s.chunking.motion_frames, s.chunking.transitions) == (80, 73, False)
    # What the user writes still wins over the family's defaults.
    job = load_job(wan_job / "job.yaml", ["video.fps=25", "sampling.guidance=1.0"])
    assert (job.spec.video.fps, job.spec.sampling.guidance) == (25, 1.0)


def test_transitions_and_bad_sizes_are_spec_errors(wan_job: Path):
    from avatar_cli.errors import InputError
    from avatar_cli.job import resolve
    from avatar_cli.spec import load_job

    for override, words in (("chunking.frames=78", "multiple of 4"),
                            ("video.width=72", "multiples of 16"),
                            ("video.width=48", "at least 64")):
        with pytest.raises(InputError, match=words):
            resolve(load_job(wan_job / "job.yaml", [override]))
    # Through the CLI: one line, exit 2, no traceback.
    result = cli("validate", str(wan_job / "job.yaml"), "chunking.transitions=true")
    assert result.returncode == 2 and "no I chunks" in result.stderr and "Traceback" not in result.stderr


def plan_of(total: int, frames: int = 80) -> list:
    family = WanS2VFamily.__new__(WanS2VFamily)
    chunking = SimpleNamespace(frames=frames, motion_frames=73, transitions=False)
    return family.plan(chunking, total)


@pytest.mark.parametrize("total", [1, 77, 78, 157, 158, 1000])
def test_clip_plan_covers_the_timeline_once(total: int):
    chunks = plan_of(total)
    kept = [f for c in chunks for f in range(*c.keep)]
    assert kept == list(range(total))
    assert all(c.publish_to == c.keep[1] and c.length == 80 for c in chunks)
    # The official clip counts: 77 frames from clip 0, 80 from each later one.
    assert len(chunks) == 1 + max(0, -(-(total - 77) // 80))


def test_lip_sync_arithmetic():
    """Output frame k must be generated with the audio of frame k (time k / fps).

    Within a clip, decoded frame j (after the reference frame) is window position j, which reads the audio
    of frame `start + j` (family.clip_audio reads frames start .. start + length - 1), and is published as
    timeline frame start + j (the kept frames are window positions keep - start). The official loop reads
    frames 80 r + j for clip r and publishes decoded frame j at 77 + 80 (r - 1) + j - 0 (clip 0: j - 3): a lead
    of 3 frames. Ours: none."""
    for c in plan_of(1000):
        for k in range(*c.keep):
            j = k - c.start  # window position (= decoded frame after the reference frame)
            audio_frame = c.start + j  # what clip_audio gives position j
            assert audio_frame == k
            official_audio = 80 * c.index + j  # the official window of clip r starts at 80 r
            assert official_audio - k == LEAD  # the official 187.5 ms lead that we remove
    assert plan_of(1000)[0].start == -LEAD


def test_official_area_rule():
    # (h x w) the official get_size_less_than_area at 480 x 832.
    assert size_less_than_area(1080, 1920, 480 * 832) == (448, 832)
    assert size_less_than_area(1920, 1080, 480 * 832) == (832, 448)
    assert size_less_than_area(1024, 1024, 480 * 832) == (576, 576)
    assert size_less_than_area(512, 512, 480 * 832) == (512, 512)
    assert size_less_than_area(1080, 1920, 720 * 1280) == (704, 1280)
    family = WanS2VFamily.__new__(WanS2VFamily)
    assert family.frame_size((1920, 1080), None) == (832, 448)  # (width, height)
    assert family.frame_size((1920, 1080), (128, 64)) == (128, 64)


def probe(path: Path) -> dict:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        frames = sum(1 for _ in c.decode(video=0))
        return {"frames": frames, "size": (v.width, v.height), "fps": float(v.average_rate),
                "audio": a.codec_context.name}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, wan_dir: Path) -> tuple[Path, dict]:
    """One render of the tiny model (float32, lossless video), shared by the tests that read it."""
    folder = tmp_path_factory.mktemp("wan_render")
    write_reference(folder / "ref.png")
    write_wav(folder / "speech.wav", 6.3)
    (folder / "job.yaml").write_text(
        f"reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: {wan_dir}\nprompt: a person talking\n"
        "seed: 3\nvideo: {width: 64, height: 64, crf: 0}\nsampling: {steps: 2}\nruntime: {dtype: float32}\n")
    result = cli("render", str(folder / "job.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    return folder, events(result.stdout)


def test_render_tiny_wan_model(one_rank):
    folder, evs = one_rank
    done = evs[-1]
    chunks = [e for e in evs if e["event"] == "chunk"]
    expected = num_frames(int(6.3 * 16000), 16000, FPS)  # round(6.3 s x 16 fps) = 101
    assert done["frames"] == expected == 101
    assert [(c["start"], c["end"]) for c in chunks] == [(0, 77), (77, 101)]
    info = probe(folder / "out" / "video.mp4")
    assert info == {"frames": expected, "size": (64, 64), "fps": 16.0, "audio": "aac"}
    # Another seed gives another video: the noise is used (the same seed giving the same video is shown by the
    # resume test, which compares a resumed render with an uninterrupted one).
    other = cli("render", str(folder / "job.yaml"), "--json", "-o", str(folder / "seed4.mp4"), "seed=4")
    assert other.returncode == 0, other.stderr
    assert events(other.stdout)[-1]["frames_digest"] != done["frames_digest"]


def test_kill_9_then_resume_is_bit_identical(wan_job: Path, tmp_path: Path):
    """The rolling state (decoder cache, motion latents) is saved at every resume point."""
    write_wav(wan_job / "long.wav", 11.0)  # 176 frames: 3 clips (77, 80, 19 frames)
    job = str(wan_job / "job.yaml")
    full = cli("render", job, f"audio={wan_job / 'long.wav'}", "-o", str(tmp_path / "full.mp4"), "--json")
    assert full.returncode == 0, full.stderr
    reference = events(full.stdout)[-1]

    kill_at = 2  # after the second clip: the third resumes from its checkpoint
    out = wan_job / "out" / "video.mp4"
    proc = start_avatar("render", job, f"audio={wan_job / 'long.wav'}", "--json")
    try:
        seen = 0
        for line in proc.stdout:
            seen += json.loads(line)["event"] == "chunk"
            if seen >= kill_at:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert not out.exists()
    resumed = cli("render", job, f"audio={wan_job / 'long.wav'}", "--resume", "--json")
    assert resumed.returncode == 0, f"killed at clip {kill_at}: {resumed.stderr}"
    assert "differ from the interrupted render" not in resumed.stderr
    done = events(resumed.stdout)[-1]
    assert done["resumed_at"] > 0, f"killed at clip {kill_at}: resumed from scratch"
    assert done["frames_digest"] == reference["frames_digest"], f"killed at clip {kill_at}"


def test_prompt_overflow_counts_the_release_tokenizer(wan_dir: Path, tmp_path: Path):
    family = resolve_model(str(wan_dir), tmp_path).family
    limit = family.config.dit.text_len  # 16 at tiny size, 512 in the release
    assert family.prompt_overflow("a person talking") is None
    words = " ".join(["talking"] * limit)
    n, reads = family.prompt_overflow(words)
    ids = family.tokenizer(words, add_special_tokens=True).input_ids
    assert (n, reads) == (len(ids), limit) and n > limit


def test_check_job_refuses_wrong_motion_frames(wan_dir: Path, tmp_path: Path):
    family = resolve_model(str(wan_dir), tmp_path).family
    with pytest.raises(ValueError, match="motion_frames"):
        family.check_job(SimpleNamespace(frames=80, motion_frames=10, transitions=False), Sampling(40, 4.5, 3.0))


def frames_of(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.float32)


def test_two_ranks_match_one(one_rank, tmp_path: Path):
    """torchrun, 2 gloo ranks: the DiT and umT5 FSDP2-sharded, the DiT sequence parallel (Ulysses over heads),
    every rank decoding (the motion latents feed back), rank 0 writing."""
    folder, evs = one_rank
    # Lossless video (crf 0, in the job): a random model's frames are noise, on which a 1-level change can flip
    # an H.264 macroblock's mode and move its pixels by tens; lossless, what is compared is the model's output.
    two = avatar_process("render", str(folder / "job.yaml"), "-o", str(tmp_path / "two.mp4"), "--json", "--nproc", "2")
    assert two.returncode == 0, two.stderr[-2000:]
    assert (evs[-1]["ranks"], events(two.stdout)[-1]["ranks"]) == (1, 2)
    a, b = frames_of(folder / "out" / "video.mp4"), frames_of(tmp_path / "two.mp4")
    assert a.shape == b.shape == (101, 64, 64, 3)
    diff = np.abs(a - b)
    # Measured: 4e-5 of the values differ, by at most 4 (a 1-level RGB change through yuv420).
    assert (diff > 0).mean() < 1e-3 and diff.max() <= 6, ((diff > 0).mean(), diff.max())


def test_streaming_mode_from_the_job_spec(one_rank, tmp_path: Path):
    """`mode: streaming` renders LiveAvatar's blocks (live.py): the first block 9 frames, then 12 each, the same
    length; a mode the family lacks, or guidance in streaming mode, is a spec error."""
    folder, _ = one_rank
    job = str(folder / "job.yaml")
    result = cli("render", job, "mode=streaming", "-o", str(tmp_path / "live.mp4"), "--json")
    assert result.returncode == 0, result.stderr
    chunks = [e for e in events(result.stdout) if e["event"] == "chunk"]
    assert [(c["start"], c["end"]) for c in chunks[:3]] == [(0, 9), (9, 21), (21, 33)]
    assert events(result.stdout)[-1]["frames"] == 101 and chunks[-1]["end"] == 101
    bad = cli("validate", job, "mode=streaming", "sampling.guidance=4.5")
    assert bad.returncode == 2 and "without guidance" in bad.stderr
    # One batch of two jobs that differ only in runtime.rings (host: here the host is the device; disk: a scratch
    # file): each is placed as its own spec says (the placement holds its rings; the model cache does not hand
    # one job's placement to the other), each says so once, and both make the device render's frames.
    from omegaconf import OmegaConf

    from avatar_cli.render import setup as render_setup

    for at in ("host", "disk"):
        spec = OmegaConf.load(job)
        spec.runtime = {**spec.get("runtime", {}), "rings": at}
        spec.mode, spec.output = "streaming", str(tmp_path / f"{at}.mp4")
        OmegaConf.save(spec, folder / f"rings-{at}.yaml")
    placed, real = [], render_setup.ModelCache.get

    def get(self, *args, **kw):
        modules, placement = real(self, *args, **kw)
        placed.append(placement.rings.at)
        return modules, placement

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(render_setup.ModelCache, "get", get)
        batch = cli("render", str(folder / "rings-*.yaml"), "--json")
    assert batch.returncode == 0, batch.stderr
    assert placed == ["disk", "host"]  # the jobs in sorted order
    assert [e["frames_digest"] for e in events(batch.stdout) if e["event"] == "done"] == \
        [events(result.stdout)[-1]["frames_digest"]] * 2
    assert batch.stderr.count("rings: host (asked for)") == 1 and batch.stderr.count("rings: disk (asked for)") == 1
    assert not list(tmp_path.glob(".avatar-rings-*"))  # the scratch file's name is gone
    from avatar_cli.errors import InputError
    from avatar_cli.job import resolve
    from avatar_cli.spec import load_job

    with pytest.raises(InputError, match="runtime.rings: host runs on one rank"):
        resolve(load_job(Path(job), ["mode=streaming", "runtime.rings=host"]), force=True, world_size=2)


def test_a_bfloat16_vae_renders_near_the_float32_one(one_rank, tmp_path: Path):
    """runtime.vae_dtype: bfloat16 puts the VAE (encode and decode) in bf16 in a float32 render: another video (its
    fingerprint differs too), close to the float32 one. One second of audio (16 frames, one clip): the VAE's every
    use, at a sixth of the frames (bf16 convolutions are slow on a CPU without native bf16). Measured here: 0.49
    levels of 255 on average, 4 at the 99.9th percentile, 6 at most; bounds at about three times the first two."""
    folder, _ = one_rank
    write_wav(tmp_path / "second.wav", 1.0)
    digests = []
    for vae in ("auto", "bfloat16"):
        res = cli("render", str(folder / "job.yaml"), "--json", "-o", str(tmp_path / f"{vae}.mp4"),
                  f"audio={tmp_path / 'second.wav'}", f"runtime.vae_dtype={vae}")
        assert res.returncode == 0, res.stderr
        digests.append(events(res.stdout)[-1]["frames_digest"])
    assert digests[0] != digests[1]
    diff = np.abs(frames_of(tmp_path / "bfloat16.mp4") - frames_of(tmp_path / "auto.mp4"))
    assert diff.shape == (16, 64, 64, 3)
    assert diff.mean() < 1.5 and np.percentile(diff, 99.9) < 12, (diff.mean(), np.percentile(diff, 99.9))
    from avatar_cli.pipeline.fingerprint import spec_digest
    from avatar_cli.spec import load_job

    job = folder / "job.yaml"  # a resume of the one must not continue with the other
    assert spec_digest(load_job(job, ["runtime.vae_dtype=bfloat16"])) != spec_digest(load_job(job))
    assert spec_digest(load_job(job, ["runtime.vae_dtype=auto"])) == spec_digest(load_job(job))
