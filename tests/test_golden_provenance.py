"""Every golden made by running the official code records the official commit and the versions it ran with, and those
versions lie inside the official repository's own pins: a golden made under the project's dependencies would test the
project against itself wherever the official code hands work to a library (tests/golden/official_env.py)."""

import json
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from safetensors import safe_open

GOLDEN = Path(__file__).parent / "golden"
# Weights the official run wrote through transformers' or diffusers' save_pretrained, which leave no room for our
# metadata: the golden's JSON (official.json) records that run.
LIBRARY_WRITTEN = {"model.safetensors", "w2v_model.safetensors", "diffusion_pytorch_model.safetensors"}
# What each official repository's runs must have recorded, beyond torch: the pins of the libraries the run relied on.
REQUIRED_PINS = {"Wan-Video/Wan2.2": ("transformers_pin",), "Alibaba-Quark/LiveAvatar": ("transformers_pin",),
                 "H-oliday/SwiftVR": ("torch_pin", "diffusers_pin", "safetensors_pin", "numpy_pin")}
FILES = sorted(p for p in GOLDEN.rglob("*.safetensors") if p.name not in LIBRARY_WRITTEN)
RECORDS = sorted(p for p in GOLDEN.rglob("*.json") if "official" in json.loads(p.read_text()))


def test_goldens_are_found():
    assert len(FILES) >= 10, FILES


def check(path: Path, prov: dict) -> None:
    assert prov["repository"] in REQUIRED_PINS
    assert len(prov["commit"]) == 40
    assert "torch" in prov and all(pin in prov for pin in REQUIRED_PINS[prov["repository"]]), prov
    for dist, version in prov.items():
        pin = prov.get(f"{dist}_pin")
        if pin:
            assert version in SpecifierSet(pin), f"{path}: {dist} {version} is outside the official pin {pin}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(GOLDEN)))
def test_golden_ran_under_the_official_pins(path: Path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    assert "official" in meta, f"{path}: no provenance (made outside tests/golden/official_env.py?)"
    check(path, json.loads(meta["official"]))


def test_every_library_written_file_has_a_record():
    for path in GOLDEN.rglob("*.safetensors"):
        if path.name in LIBRARY_WRITTEN:
            assert any(r.parent in path.parents for r in RECORDS), f"{path}: no official.json beside it"


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: str(p.relative_to(GOLDEN)))
def test_golden_records_ran_under_the_official_pins(path: Path):
    check(path, json.loads(path.read_text())["official"])
