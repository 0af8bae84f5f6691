"""A third model family from a test folder alone (tests/toy_family/): registered with one line, it renders a job
end to end through `avatar render`, its prompt goes through the text cache, and `avatar models init` and
`avatar models check` work for it. Nothing in avatar_cli names it."""

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from avatar_cli.cli import app
from avatar_cli.families import registry
from tests.conftest import write_reference, write_wav
from tests.toy_family import TOY

runner = CliRunner()


@pytest.fixture
def toy_registered():
    registry.register(TOY)  # the one line that adds the family
    yield
    registry.FAMILIES.pop(TOY.name)


def events(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_toy_family_end_to_end(toy_registered, tmp_path: Path):
    model = tmp_path / "toy-model"
    init = runner.invoke(app, ["models", "init", str(model), "--family", "toy", "--json"])
    assert init.exit_code == 0, init.output
    made = events(init.output)[-1]
    assert made["family"] == "toy" and made["size"] == "tiny" and made["params"] > 0

    check = runner.invoke(app, ["models", "check", str(model), "--json"])
    assert check.exit_code == 0, check.output
    report = events(check.output)[-1]
    assert report["family"] == "toy" and report["ok"]

    (model / "net.safetensors").write_bytes(b"not a checkpoint")
    broken = runner.invoke(app, ["models", "check", str(model), "--json"])
    assert broken.exit_code == 2
    assert [e["ok"] for e in events(broken.output) if e["event"] == "check"] == [False]
    model.rename(tmp_path / "broken")
    assert runner.invoke(app, ["models", "init", str(model), "--family", "toy", "--json"]).exit_code == 0

    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 1.5)
    (tmp_path / "job.yaml").write_text(
        f"reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: {model}\nprompt: a toy talking\n"
        "video: {fps: 12, crf: 0}\nsampling: {steps: 2}\nchunking: {frames: 12}\n"
        f"runtime: {{dtype: float32, text_cache: {tmp_path / 'text'}}}\n")
    first = runner.invoke(app, ["render", str(tmp_path / "job.yaml"), "--json"])
    assert first.exit_code == 0, first.output
    done = events(first.output)[-1]
    assert done["event"] == "done" and done["frames"] == 18 and done["transitions"] is False
    assert done["parallel"] == "single"
    assert done["text_cache"] == "miss"
    assert list(done) == ["event", "output", "frames", "video_fps", "duration_s", "wall_s", "ttff_s", "render_fps",
                          "rtf", "peak_rss_mb", "load_s", "generate_s", "compute_s", "resumed_at", "frames_digest",
                          "ranks", "parallel", "text_cache", "dtype", "dtype_reason", "cpu_capability", "transitions"]
    assert list(done["compute_s"]) == ["reference", "prompt", "context", "a2v", "sr", "decode"]  # families.base.Step
    assert (tmp_path / "out" / "video.mp4").stat().st_size > 0
    assert len(list((tmp_path / "text").glob("*.safetensors"))) == 1

    again = runner.invoke(app, ["render", str(tmp_path / "job.yaml"), "-o", str(tmp_path / "again.mp4"), "--json"])
    assert again.exit_code == 0, again.output
    redone = events(again.output)[-1]
    assert redone["text_cache"] == "hit"  # the text encoder was not loaded
    assert redone["frames_digest"] == done["frames_digest"]


def test_a_family_without_a_prompt_identity_says_so(tmp_path: Path):
    registry.register(dataclasses.replace(TOY, prompt_identity=None))
    try:
        model = tmp_path / "toy-model"
        assert runner.invoke(app, ["models", "init", str(model), "--family", "toy", "--json"]).exit_code == 0
        write_reference(tmp_path / "ref.png")
        write_wav(tmp_path / "speech.wav", 0.5)
        (tmp_path / "job.yaml").write_text(
            f"reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: {model}\nprompt: a toy\n"
            "video: {fps: 12}\nsampling: {steps: 1}\nchunking: {frames: 12}\n"
            f"runtime: {{dtype: float32, text_cache: {tmp_path / 'text'}}}\n")
        result = runner.invoke(app, ["render", str(tmp_path / "job.yaml"), "--json"])
        assert result.exit_code == 0, result.output
        assert "the toy family declares no prompt identity" in result.output
        assert events(result.output)[-1]["text_cache"] == "off"
    finally:
        registry.FAMILIES.pop(TOY.name)
