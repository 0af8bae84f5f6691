"""A toy third model family that lives only in this folder: its own tiny nn.Modules, its own directory format
(`toy.json` + one safetensors file per component) and its own prompt identity. `registry.register(TOY)` adds it;
nothing outside this folder names it (tests/test_toy_family.py)."""

from tests.toy_family.spec import TOY

__all__ = ["TOY"]
