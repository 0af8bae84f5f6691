"""`avatar models init --family swiftvr` and `avatar models check` of a SwiftVR directory (the super-resolution model
a job names in `sr.model`): a random tiny directory in the release's layout, checked from its headers; each broken
file refused with exit 2, one line naming the tensor or the file."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from avatar_cli.cli import app

runner = CliRunner()


def events(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def error(result) -> str:
    assert result.exit_code == 2, result.output
    errors = [e for e in events(result.output) if e["event"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == 2 and "Traceback" not in result.output
    return errors[0]["message"]


@pytest.fixture(scope="module")
def tiny_sr(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sr") / "swiftvr"
    init = runner.invoke(app, ["models", "init", str(d), "--family", "swiftvr", "--seed", "3", "--json"])
    assert init.exit_code == 0, init.output
    made = events(init.output)[-1]
    files = [d / "reae.safetensors", d / "prompt_embedding.safetensors",
             d / "transformer" / "diffusion_pytorch_model.safetensors"]
    params = sum(t.numel() for f in files for t in load_file(str(f)).values())
    assert (made["family"], made["size"], made["trained"], made["params"]) == ("swiftvr", "tiny", False, params)
    assert (d / "transformer" / "config.json").is_file()
    return d


def broken_copy(src: Path, dst: Path) -> Path:
    for f in src.rglob("*"):
        if f.is_file():
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / f.relative_to(src)).write_bytes(f.read_bytes())
    return dst


def test_a_tiny_directory_is_written_in_the_release_layout_and_checked_from_its_headers(tiny_sr: Path):
    check = runner.invoke(app, ["models", "check", str(tiny_sr), "--json"])
    assert check.exit_code == 0, check.output
    report = events(check.output)[-1]
    assert report["event"] == "check" and report["family"] == "swiftvr" and report["ok"]
    reae = load_file(str(tiny_sr / "reae.safetensors"))
    comps = report["components"]
    assert comps["reae"]["tensors"] == len(reae) and comps["reae"]["params"] == sum(t.numel() for t in reae.values())
    assert comps["prompt"]["tensors"] == 1 and comps["transformer"]["tensors"] > 0
    text = runner.invoke(app, ["models", "check", str(tiny_sr), "--no-json"])
    assert text.exit_code == 0 and "SwiftVR" in text.output and "transformer" in text.output


@pytest.mark.parametrize("fault", ["mis-shaped", "missing", "unexpected"])
def test_a_broken_tensor_is_named(tiny_sr: Path, tmp_path: Path, fault: str):
    d = broken_copy(tiny_sr, tmp_path / "sr")
    f = d / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(f))
    name = sorted(k for k in state if k.startswith("blocks.1."))[0]
    if fault == "mis-shaped":
        state[name] = torch.zeros(state[name].numel() + 1)
    elif fault == "missing":
        del state[name]
    else:
        name = "blocks.1.extra.weight"
        state[name] = torch.zeros(2)
    save_file(state, str(f))
    message = error(runner.invoke(app, ["models", "check", str(d), "--json"]))
    assert name in message


def test_a_pickle_is_refused_without_being_read(tiny_sr: Path, tmp_path: Path):
    d = broken_copy(tiny_sr, tmp_path / "sr")
    (d / "reae.safetensors").rename(d / "reae.pth")  # never unpickled: refused by its name
    message = error(runner.invoke(app, ["models", "check", str(d), "--json"]))
    assert "reae.pth" in message and "pickle" in message


def test_init_refuses_another_size_and_a_folder_in_use(tiny_sr: Path, tmp_path: Path):
    assert "--size: full" in error(runner.invoke(app, ["models", "init", str(tmp_path / "x"), "--family", "swiftvr",
                                                       "--size", "full", "--json"]))
    assert not (tmp_path / "x").exists()
    before = sorted(p.name for p in tiny_sr.rglob("*"))
    assert "not empty" in error(runner.invoke(app, ["models", "init", str(tiny_sr), "--family", "swiftvr", "--json"]))
    assert sorted(p.name for p in tiny_sr.rglob("*")) == before
