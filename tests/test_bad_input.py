"""Every bad input: one clear line, exit code 2, no traceback, nothing at the output path."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from avatar_cli.cli import app
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
])
def test_bad_spec(job_dir, override, needle):
    assert_bad_input(render(job_dir, override), job_dir, needle)


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
