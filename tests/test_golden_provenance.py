"""Every golden made by running the official code records the official commit and the versions it ran with, and those
versions lie inside the official repository's own pins: a golden made under the project's dependencies would test the
project against itself wherever the official code hands work to a library (tests/golden/official_env.py)."""

import json
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from safetensors import safe_open

GOLDEN = Path(__file__).parent / "golden"
# Files the official code wrote through a library's own writer (transformers' save_pretrained), with no room for ours.
LIBRARY_WRITTEN = {"model.safetensors"}
FILES = sorted(p for p in GOLDEN.rglob("*.safetensors") if p.name not in LIBRARY_WRITTEN)


def test_goldens_are_found():
    assert len(FILES) >= 10, FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(GOLDEN)))
def test_golden_ran_under_the_official_pins(path: Path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    assert "official" in meta, f"{path}: no provenance (made outside tests/golden/official_env.py?)"
    prov = json.loads(meta["official"])
    assert prov["repository"] in ("Wan-Video/Wan2.2", "Alibaba-Quark/LiveAvatar")
    assert len(prov["commit"]) == 40
    assert "transformers_pin" in prov and "torch" in prov
    for dist, version in prov.items():
        pin = prov.get(f"{dist}_pin")
        if pin:
            assert version in SpecifierSet(pin), f"{path}: {dist} {version} is outside the official pin {pin}"
