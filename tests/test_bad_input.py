"""Every bad input: one clear line, exit code 2, no traceback, nothing at the output path."""

import json
import shutil
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from avatar_cli.cli import app
from avatar_cli.spec import JobSpec
from tests.conftest import write_wav

runner = CliRunner()


def render(job_dir: Path, *extra: str):
    return runner.invoke(app, ["render", str(job_dir / "job.yaml"), "--json", *extra])


def assert_bad_input(result, job_dir: Path, needle: str, output: Path | None = None):
    assert result.exit_code == 2, result.output
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last["event"] == "error" and last["code"] == 2
    assert needle in last["message"], last["message"]
    assert "\n" not in last["message"]
    assert "Traceback" not in result.output
    output = output or job_dir / "out" / "video.mp4"
    assert not output.exists()
    assert not output.with_name(output.stem + ".partial.mp4").exists()


def test_missing_reference(job_dir):
    (job_dir / "ref.png").unlink()
    assert_bad_input(render(job_dir), job_dir, "reference")


def test_reference_is_a_folder(job_dir):
    (job_dir / "ref.png").unlink()
    (job_dir / "ref.png").mkdir()
    assert_bad_input(render(job_dir), job_dir, "reference")


def test_reference_not_an_image(job_dir):
    (job_dir / "ref.png").write_text("hello, I am text")
    assert_bad_input(render(job_dir), job_dir, "reference")


def test_reference_is_audio(job_dir):
    shutil.copy(job_dir / "speech.wav", job_dir / "ref.png")
    assert_bad_input(render(job_dir), job_dir, "reference")


def test_missing_audio(job_dir):
    (job_dir / "speech.wav").unlink()
    assert_bad_input(render(job_dir), job_dir, "audio")


def test_corrupt_audio(job_dir):
    (job_dir / "speech.wav").write_bytes(bytes(range(256)) * 64)
    assert_bad_input(render(job_dir), job_dir, "audio")


def test_truncated_audio(job_dir):
    data = (job_dir / "speech.wav").read_bytes()
    (job_dir / "speech.wav").write_bytes(data[: len(data) // 2])
    assert_bad_input(render(job_dir), job_dir, "truncated")


def test_zero_length_audio(job_dir):
    write_wav(job_dir / "speech.wav", 0.0)
    assert_bad_input(render(job_dir), job_dir, "audio")


def test_audio_shorter_than_a_frame(job_dir):
    write_wav(job_dir / "speech.wav", 0.01)
    assert_bad_input(render(job_dir), job_dir, "shorter than one frame")


@pytest.mark.parametrize("override,needle", [
    ("colour=red", "unknown key 'colour'"),
    ("video.fps=fast", "video.fps"),
    ("video.fps=0", "video.fps must be positive"),
    ("chunking.frames=-3", "chunking.frames must be positive"),
    ("chunking.motion_frames=14", "must not exceed chunking.frames"),
    ("video.preset=ultrafastest", "video.preset must be one of ultrafast, superfast, veryfast, faster, fast, medium, "
                                  "slow, slower, veryslow, placebo"),
    ("video.width=20000 video.height=20000", "video.width must be at most 8192"),
    ("video.width=16 video.height=8194", "video.height must be at most 8192"),  # cheap to render if it regressed
    ("--nproc 0", "--nproc must be at least 1"),
    ("--nproc -1", "--nproc must be at least 1"),
])
def test_bad_spec(job_dir, override, needle):
    assert_bad_input(render(job_dir, *override.split()), job_dir, needle)


CHOICES = [("video.codec", "h265", "auto, libx264, h264_nvenc"), ("runtime.device", "tpu", "auto, cpu, cuda"),
           ("runtime.dtype", "int8", "auto, float32, bfloat16, float16"),
           ("runtime.offload", "disk", "auto, none, model, block"),
           ("runtime.reshard", "never", "per_block, per_stage"),
           ("runtime.shard", "sometimes", "auto, shard, replicate"),
           ("runtime.parallel", "tensor", "auto, sequence, steps"),
           ("runtime.decode", "gpu", "auto, inline, worker, thread"),
           ("runtime.weights", "int4", "bf16, fp8, int8"),
           ("runtime.offload_host", "disk", "auto, pinned, mmap"),
           ("runtime.vae_dtype", "float16", "auto, float32, bfloat16"),
           ("runtime.rings", "tape", "auto, device, host, disk")]


def test_choices_cover_every_enum_key():
    enum_keys = {f"{group.name}.{f.name}" for group in fields(JobSpec) if is_dataclass(group.type)
                 for f in fields(group.type) if isinstance(f.type, type) and issubclass(f.type, Enum)}
    assert enum_keys == {key for key, _, _ in CHOICES}


@pytest.mark.parametrize("key,value,allowed", CHOICES)
def test_choice_errors_list_the_choices(job_dir, key, value, allowed):
    group, name = key.split(".")
    job = job_dir / "job.yaml"
    job.write_text(job.read_text() + f"{group}:\n  {name}: {value}\n")
    needle = f"invalid value for '{key}': '{value}', expected one of {allowed}"
    assert_bad_input(render(job_dir), job_dir, needle)
    # On a terminal the error goes through Rich, whose markup once swallowed a [bracketed] list.
    result = runner.invoke(app, ["validate", str(job), "--no-json"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: {job}: {needle}"]


@pytest.mark.parametrize("command", ["render", "validate"])
def test_unknown_interpolation(job_dir, command):
    job = job_dir / "job.yaml"
    job.write_text(job.read_text().replace("output: out/video.mp4", "output: out/${nope}.mp4"))
    result = runner.invoke(app, [command, str(job), "--json"])
    assert_bad_input(result, job_dir, "cannot resolve 'output': Interpolation key 'nope' not found")
    assert not (job_dir / "out").exists()


def test_interpolation_resolves_after_overrides(job_dir):
    job = job_dir / "job.yaml"
    job.write_text(job.read_text().replace("output: out/video.mp4", "output: out/seed${seed}.mp4"))
    result = runner.invoke(app, ["validate", str(job), "seed=7", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["output"] == str(job_dir / "out" / "seed7.mp4")


@pytest.mark.parametrize("args,needle", [
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--seed", "1", "--size", "100000"], "--size must be an even number from 16 to 4096"),
    (["--seed", "1", "--size", "15"], "--size must be an even number from 16 to 4096"),
])
def test_reference_bad_arguments(tmp_path, args, needle):
    out = tmp_path / "face.png"
    result = runner.invoke(app, ["reference", *args, "-o", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: {needle}"]
    assert not list(tmp_path.iterdir())  # neither the PNG nor its .tmp


def test_reference_refuses_a_non_png_name(tmp_path):
    out = tmp_path / "face.jpg"
    result = runner.invoke(app, ["reference", "--seed", "1", "-o", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: output: {out} must end in .png"]
    assert not list(tmp_path.iterdir())


def test_reference_help_states_the_size_limit():
    result = runner.invoke(app, ["reference", "--help"], terminal_width=200)
    assert "16 to 4096" in result.stdout


def test_output_folder_cannot_be_written(job_dir):
    (job_dir / "blocker").write_text("a file where a folder should be")
    out = job_dir / "blocker" / "video.mp4"
    assert_bad_input(render(job_dir, "-o", str(out)), job_dir, "output", output=out)


def test_existing_output_is_never_overwritten_without_force(job_dir):
    out = job_dir / "out" / "video.mp4"
    out.parent.mkdir()
    out.write_bytes(b"the user's own video")
    result = render(job_dir)
    assert result.exit_code == 2 and "--force" in result.stdout
    assert out.read_bytes() == b"the user's own video"


def test_missing_model_dir(job_dir):
    assert_bad_input(render(job_dir, f"model={job_dir / 'no-model'}"), job_dir, "model")


def test_model_weights_do_not_match_config(job_dir, tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    state = load_file(str(broken / "dit.safetensors"))
    state["x_embed.weight"] = state["x_embed.weight"][:, :3].contiguous()
    save_file(state, str(broken / "dit.safetensors"))
    assert_bad_input(render(job_dir, f"model={broken}"), job_dir, "x_embed.weight")


def test_validate_reports_the_same_errors(job_dir):
    (job_dir / "ref.png").write_text("not an image")
    result = runner.invoke(app, ["validate", str(job_dir / "job.yaml"), "--json"])
    assert result.exit_code == 2 and "reference" in result.stdout


def test_debug_shows_a_traceback(job_dir):
    (job_dir / "speech.wav").unlink()
    result = runner.invoke(app, ["render", str(job_dir / "job.yaml"), "--json", "--debug"])
    assert result.exit_code == 2 and "Traceback" in result.output
