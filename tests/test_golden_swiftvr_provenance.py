"""The SwiftVR goldens (tests/golden/make_swiftvr_goldens.py) are what they say: the official commit the brief pins,
the release layout the official loader read, and seeded weights that regenerate to the recorded hashes."""

import json
import math
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

GOLDEN = Path(__file__).parent / "golden"
SWIFTVR = GOLDEN / "swiftvr"
sys.path.insert(0, str(GOLDEN))
from swiftvr_weights import RULE, seeded_weights, tensor_sha256  # noqa: E402

PINNED = "7cb5de2f1a99ac2063b79cf6722fcdf42705b752"
RECORD = json.loads((SWIFTVR / "official.json").read_text())
KEYS = json.loads((SWIFTVR / "release" / "keys.json").read_text())
CASES = sorted(SWIFTVR.glob("case_*.safetensors"))


def test_cases_are_found():
    assert {p.stem for p in CASES} >= {"case_a", "case_b", "case_c1", "case_c2", "case_e"}


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_case_ran_the_pinned_commit_under_the_pinned_torch(path: Path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    prov = json.loads(meta["official"])
    assert prov == RECORD["official"]
    assert prov["commit"] == PINNED and prov["repository"] == "H-oliday/SwiftVR"
    assert prov["torch"].split("+")[0] == "2.10.0" and prov["diffusers"] == "0.36.0"
    assert json.loads(meta["case"])["chunks"]


def test_committed_release_matches_its_key_listing_and_config():
    rel = SWIFTVR / "release"
    dit = load_file(str(rel / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert {k: list(v.shape) for k, v in dit.items()} == KEYS["transformer/diffusion_pytorch_model.safetensors"]
    prompt = load_file(str(rel / "prompt_embedding.safetensors"))
    assert {k: list(v.shape) for k, v in prompt.items()} == KEYS["prompt_embedding.safetensors"] == {
        "prompt_emb": [1, RECORD["prompt_tokens"], RECORD["tiny_dit"]["text_dim"]]}
    config = json.loads((rel / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel"
    assert {k: config[k] for k in RECORD["tiny_dit"]} == RECORD["tiny_dit"]


def test_seeded_rule_regenerates_the_committed_transformer():
    rule = RECORD["transformer_rule"]
    assert {k: rule[k] for k in RULE} == json.loads(json.dumps(RULE))
    shapes = KEYS["transformer/diffusion_pytorch_model.safetensors"]
    drawn = seeded_weights(shapes, rule["seed"])
    assert tensor_sha256(drawn) == rule["sha256"]
    committed = load_file(str(SWIFTVR / "release" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(drawn[k].equal(committed[k]) for k in shapes)


def test_seeded_rule_regenerates_the_reae_hash():
    rule = RECORD["reae_rule"]
    shapes = KEYS["reae.safetensors"]
    assert len(shapes) == 128 and sum(math.prod(s) for s in shapes.values()) == 40_946_364
    assert tensor_sha256(seeded_weights(shapes, rule["seed"])) == rule["sha256"]
