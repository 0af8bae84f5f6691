"""The job spec's commented reference (configs/default.yaml and its packaged copy) is rendered from the schema."""

import tomllib
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from avatar_cli import spec_reference
from avatar_cli.spec import JobSpec

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "regenerate it: python -m avatar_cli.spec_reference --write"


def test_reference_files_are_the_rendered_schema():
    text = spec_reference.reference_yaml()
    for path in (ROOT / "configs" / "default.yaml", spec_reference.PACKAGED):
        assert path.read_text() == text, f"{path} differs from the schema's defaults; {REGENERATE}"


def test_every_key_has_one_comment_and_no_comment_is_stale():
    keys, comments = set(spec_reference.schema_keys()), set(spec_reference.COMMENTS)
    assert not keys - comments, f"keys without a comment in spec_reference.COMMENTS: {sorted(keys - comments)}"
    assert not comments - keys, f"comments for keys the schema lacks: {sorted(comments - keys)}"
    assert all("\n" not in c for c in spec_reference.COMMENTS.values())
    assert all(len(line) <= spec_reference.WIDTH for line in spec_reference.reference_yaml().splitlines())


def test_reference_loads_back_to_the_schema_defaults():
    schema = OmegaConf.to_container(OmegaConf.structured(JobSpec), enum_to_str=True)
    for key in ("reference", "audio", "output"):  # required: named in the header, not as keys
        assert schema.pop(key) == "???"
        assert f"#   {key} " in spec_reference.reference_yaml()
    assert yaml.safe_load(spec_reference.reference_yaml()) == schema
    # and OmegaConf reads it as a layer over the schema without a complaint
    OmegaConf.merge(OmegaConf.structured(JobSpec), OmegaConf.create(spec_reference.reference_yaml()))


def test_a_changed_default_shows(monkeypatch):
    monkeypatch.setattr(JobSpec.__dataclass_fields__["seed"], "default", 7)
    assert "\nseed: 7 " in spec_reference.reference_yaml()


def test_packaged_with_the_wheel():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "default.yaml" in project["tool"]["setuptools"]["package-data"]["avatar_cli"]
