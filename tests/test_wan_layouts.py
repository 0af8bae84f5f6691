"""The two released layouts of Wan2.2-S2V-14B render alike: the official flat one and the Diffusers repack
(FastVideo/Wan2.2-S2V-14B-Diffusers: transformer/, vae/ in AutoencoderKLWan names, text_encoder/ in transformers'
UMT5EncoderModel names, tokenizer/, audio_encoder/ + audio_processor/).

- the VAE adapter on the real release's 194 names and shapes, against diffusers' AutoencoderKLWan itself;
- the tiny VAE decodes and encodes exactly as diffusers' AutoencoderKLWan given the converted weights;
- the tiny model written in both layouts (same seed) renders the same frames through the CLI;
- `avatar models check` on the Diffusers layout: ok, then a renamed and a missing VAE tensor named;
- the release-size vae/ and text_encoder/ headers (sparse files) recognised and checked;
- text_encoder/ variants: one file, the tied embedding stored twice, no config.json files.
"""

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from avatar_cli.errors import InputError
from avatar_cli.families.wan_s2v import adapter_vae
from avatar_cli.families.wan_s2v import model_dir as wan
from avatar_cli.families.wan_s2v.adapter_t5 import wan_to_hf
from avatar_cli.families.wan_s2v.files import DIFFUSERS, OFFICIAL, TIED_T5_KEY
from avatar_cli.families.wan_s2v.text import UMT5_XXL, umt5_config
from avatar_cli.families.wan_s2v.vae import WanVAEParams
from avatar_cli.families.registry import check_directory
from tests.conftest import avatar, write_reference, write_wav

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"
VAE_PARAMS = 126_892_531  # the release's Wan2.1 VAE
T5_PARAMS = 5_680_910_336  # the release's umT5-XXL encoder


def key_list(name: str) -> dict[str, tuple[int, ...]]:
    rows = [line.split("\t") for line in (GOLDEN / f"{name}_keys.txt").read_text().splitlines()]
    return {k: tuple(json.loads(s)) for k, s in rows}


def cli(*args: str) -> subprocess.CompletedProcess:
    return avatar(*args)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """The tiny model, seed 0, in both layouts."""
    root = tmp_path_factory.mktemp("layouts")
    out = {layout: root / layout for layout in (OFFICIAL, DIFFUSERS)}
    for layout, path in out.items():
        wan.init_dir(path, "tiny", seed=0, layout=layout)
    return out


# --- the VAE adapter ----------------------------------------------------------------------------------------

def diffusers_vae(p: WanVAEParams):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(**{k: v for k, v in adapter_vae.diffusers_config(p).items() if not k.startswith("_")})


def test_vae_adapter_on_the_release_names():
    """All 194 tensors of Wan2.1_VAE.pth: renamed to exactly diffusers' AutoencoderKLWan names and shapes (the
    release's size built on meta), the same names as diffusers' own converter gives, and back again."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    official = key_list("vae")
    assert len(official) == 194
    renamed = {adapter_vae.official_key_to_diffusers(k): s for k, s in official.items()}
    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in diffusers_vae(WanVAEParams.full()).state_dict().items()}
    assert renamed == theirs  # total, one to one, shapes unchanged (the RMS gains included)
    with torch.device("meta"):
        fake = {k: torch.empty(s) for k, s in official.items()}
    assert set(convert_wan_vae_to_diffusers(fake)) == set(renamed)
    assert {adapter_vae.diffusers_key_to_official(k): s for k, s in renamed.items()} == official
    for bad in ("decoder.upsamples.3.residual.0.gamma", "encoder.head.1.weight", "conv3.weight"):
        with pytest.raises(KeyError):
            adapter_vae.official_key_to_diffusers(bad)
    for bad in ("decoder.up_blocks.0.resnets.3.conv1.weight", "decoder.up_blocks.0.upsamplers.0.norm1.gamma"):
        with pytest.raises(KeyError):
            adapter_vae.diffusers_key_to_official(bad)


def test_vae_config_round_trip_and_refusals():
    for p in (WanVAEParams.full(), WanVAEParams.tiny()):
        assert adapter_vae.params_from_config(adapter_vae.diffusers_config(p)) == p
    release = adapter_vae.diffusers_config(WanVAEParams.full())
    # The Wan2.2 (TI2V-5B) VAE is the residual one, with another structure: named, not misread.
    for field, value in (("is_residual", True), ("decoder_base_dim", 256), ("attn_scales", [0.5]),
                         ("_class_name", "AutoencoderKL"), ("scale_factor_spatial", 16)):
        with pytest.raises(ValueError, match=field):
            adapter_vae.params_from_config({**release, field: value})


@torch.no_grad()
def test_tiny_vae_matches_diffusers(dirs):
    """Our WanVAE (loaded from the official tiny dir) and diffusers' AutoencoderKLWan given the adapter's names:
    the same frames and latents. Ours takes and gives normalised latents, diffusers raw ones (its pipelines
    apply latents_mean/std outside): the test applies them as our VAE does (times 1/std, divide by 1/std)."""
    ours = wan.load_vae(wan.read_config(dirs[OFFICIAL])).model.eval()
    p = ours.params
    converted = adapter_vae.official_to_diffusers(ours.state_dict())
    with torch.device("meta"):  # no random init to pay for: every tensor is assigned, strictly
        theirs = diffusers_vae(p).eval()
    theirs.load_state_dict(converted, strict=True, assign=True)
    # The Diffusers dir holds exactly these tensors under exactly these names.
    written = load_file(str(dirs[DIFFUSERS] / "vae" / "diffusion_pytorch_model.safetensors"))
    assert written.keys() == converted.keys() and all(torch.equal(written[k], converted[k]) for k in written)

    gen = torch.Generator().manual_seed(5)
    mean = torch.tensor(p.latent_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(p.latent_std).view(1, -1, 1, 1, 1)
    z = torch.randn(1, 16, 3, 4, 4, generator=gen)  # (B, z, n, h, w) normalised
    a = ours.decode(z)  # (1, 3, 9, 32, 32)
    b = theirs.decode(z / inv_std + mean).sample
    assert a.shape == b.shape == (1, 3, 9, 32, 32)
    assert 0.05 < a.abs().mean() and (a.abs() < 1).float().mean() > 0.5  # not saturated: values are compared
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # measured: bit-identical (max |d| 0.0)
    x = torch.rand(1, 3, 9, 32, 32, generator=gen) * 2 - 1
    mu = theirs.encode(x).latent_dist.mode()  # (1, 16, 3, 4, 4) raw
    torch.testing.assert_close(ours.encode(x), (mu - mean) * inv_std, rtol=0, atol=1e-5)


# --- the two layouts ----------------------------------------------------------------------------------------

def test_both_layouts_load_the_same_weights(dirs):
    names = {p.name for p in dirs[DIFFUSERS].iterdir()}
    assert names == {"model_index.json", "transformer", "vae", "text_encoder", "tokenizer", "audio_encoder",
                     "audio_processor"}
    assert json.loads((dirs[DIFFUSERS] / "model_index.json").read_text())["_class_name"] == wan.PIPELINE_CLASS
    assert not (dirs[DIFFUSERS] / "audio_encoder" / "preprocessor_config.json").exists()  # from audio_processor/
    cfgs = {layout: wan.read_config(path) for layout, path in dirs.items()}
    a, b = cfgs[OFFICIAL], cfgs[DIFFUSERS]
    assert (b.layout, b.vae_preset, b.t5_preset) == (DIFFUSERS, "tiny", "tiny")  # from the config.json files
    assert (a.dit, a.vae, a.t5) == (b.dit, b.vae, b.t5)
    ma, mb = wan.load_components(a), wan.load_components(b)
    for name in ma:
        sa = (ma[name].materialize("cpu") if ma[name].is_lazy else ma[name]).model.state_dict()
        sb = (mb[name].materialize("cpu") if mb[name].is_lazy else mb[name]).model.state_dict()
        assert sa.keys() == sb.keys(), name
        assert all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa), name
    assert ma["audio"].model.extractor.to_dict() == mb["audio"].model.extractor.to_dict()


def test_both_layouts_render_the_same_frames(dirs, tmp_path):
    """Through the CLI. One clip (2 s of audio): a clip uses every component (wav2vec2, umT5, the DiT, the VAE
    encoder for the reference, its decoder); a second clip adds nothing layout-specific and ~20 s of VAE."""
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 2.0)
    digests = {}
    for layout, path in dirs.items():
        job = tmp_path / f"{layout}.yaml"
        job.write_text(f"reference: ref.png\naudio: speech.wav\noutput: out/{layout}.mp4\nmodel: {path}\n"
                       "prompt: a person talking\nseed: 3\nvideo: {width: 64, height: 64}\nsampling: {steps: 2}\n")
        result = cli("render", str(job), "--json")
        assert result.returncode == 0, result.stderr[-2000:]
        done = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")][-1]
        assert done["frames"] == 32
        digests[layout] = done["frames_digest"]
    assert digests[OFFICIAL] == digests[DIFFUSERS]


def damaged_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    vae_file = dst / "vae" / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(vae_file))
    # A tensor left under its official name (an unconverted key), and one dropped.
    sd["decoder.upsamples.4.shortcut.weight"] = sd.pop("decoder.up_blocks.1.resnets.0.conv_shortcut.weight")
    del sd["post_quant_conv.bias"]
    save_file(sd, str(vae_file))
    return dst


def test_models_check_on_the_diffusers_layout(dirs, tmp_path):
    report = check_directory(dirs[DIFFUSERS])  # what `avatar models check --json` prints
    assert report["ok"] and report["layout"] == DIFFUSERS, report["lines"]
    comps = report["components"]
    assert all(comps[c]["checked"] for c in ("dit", "vae", "t5"))
    assert (comps["vae"]["tensors"], comps["vae"]["params"]) == (194, 924_491)
    assert comps["t5"]["tensors"] == 22  # the tied embedding stored once (transformers' save_pretrained)

    bad = damaged_copy(dirs[DIFFUSERS], tmp_path / "damaged")
    result = cli("models", "check", str(bad), "--json")
    assert result.returncode == 2, result.stderr
    vae = json.loads(result.stdout.strip().splitlines()[0])["components"]["vae"]
    assert sorted(vae["missing"]) == ["decoder.up_blocks.1.resnets.0.conv_shortcut.weight", "post_quant_conv.bias"]
    assert vae["unexpected"] == ["decoder.upsamples.4.shortcut.weight"]
    with pytest.raises(InputError, match="post_quant_conv.bias"):
        wan.check_or_fail(wan.read_config(bad))  # a render refuses it before loading anything


def test_text_encoder_variants(dirs, tmp_path):
    """One model.safetensors holding the tied embedding twice (older exports), and no vae/ or text_encoder/
    config.json: sizes recognised from the headers; the same weights as the sharded original."""
    d = shutil.copytree(dirs[DIFFUSERS], tmp_path / "variant")
    te = d / "text_encoder"
    sd = wan._read_safetensors(te / "model.safetensors.index.json")
    sd[TIED_T5_KEY] = sd["shared.weight"].clone()
    for f in te.glob("model*"):
        f.unlink()
    save_file(sd, str(te / "model.safetensors"))
    (te / "config.json").unlink()
    (d / "vae" / "config.json").unlink()
    cfg = wan.read_config(d)
    assert (cfg.vae_preset, cfg.t5_preset) == ("tiny", "tiny")
    assert wan.check_path(d).ok
    ref = wan.load_text(wan.read_config(dirs[DIFFUSERS])).model.state_dict()
    got = wan.load_text(cfg).model
    assert got.model.shared.weight is got.model.encoder.embed_tokens.weight  # still tied after loading
    assert all(torch.equal(v, ref[k]) for k, v in got.state_dict().items())


def test_config_files_refused_by_name(dirs, tmp_path):
    d = shutil.copytree(dirs[DIFFUSERS], tmp_path / "bad")
    vae_cfg = d / "vae" / "config.json"
    vae_cfg.write_text(json.dumps({**json.loads(vae_cfg.read_text()), "is_residual": True}))
    with pytest.raises(InputError, match="is_residual"):
        wan.read_config(d)
    report = wan.check_path(d)  # reported, and the header still compared (with the preset it matches)
    assert not report.ok and any("is_residual" in p for p in report.components["vae"].problems)
    assert not report.components["vae"].missing
    vae_cfg.write_text(json.dumps(adapter_vae.diffusers_config(WanVAEParams.tiny())))
    te_cfg = d / "text_encoder" / "config.json"
    te_cfg.write_text(json.dumps({**json.loads(te_cfg.read_text()), "d_kv": 4}))
    with pytest.raises(InputError, match="d_kv"):
        wan.read_config(d)
    with pytest.raises(InputError, match="layout"):
        wan.init_dir(tmp_path / "x", "tiny", layout="comfy")


# --- the release's size, headers only -----------------------------------------------------------------------

def write_sparse_safetensors(path: Path, entries: dict[str, tuple[int, ...]], dtype: str, size: int) -> None:
    """A real safetensors header with the data region left as a hole (nothing written for it)."""
    header, offset = {}, 0
    for name, shape in entries.items():
        nbytes = size
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)


def test_release_sized_vae_and_text_encoder(dirs, tmp_path):
    """vae/ and text_encoder/ at the release's size (sparse files: real headers, 12 GB of holes): their config
    files give the release's sizes, and every name and shape checks (T5 in bf16, the VAE in fp32)."""
    d = shutil.copytree(dirs[DIFFUSERS], tmp_path / "release")
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    os.truncate(probe, 1 << 30)
    if probe.stat().st_blocks * 512 >= (1 << 20):
        pytest.skip("this filesystem does not keep sparse files (12 GB would be written)")
    vae_names = {adapter_vae.official_key_to_diffusers(k): s for k, s in key_list("vae").items()}
    write_sparse_safetensors(d / "vae" / "diffusion_pytorch_model.safetensors", vae_names, "F32", 4)
    (d / "vae" / "config.json").write_text(json.dumps(adapter_vae.diffusers_config(WanVAEParams.full())))
    te = d / "text_encoder"
    for f in te.glob("model*"):
        f.unlink()
    with torch.device("meta"):
        t5_names = {k: tuple(v.shape) for k, v in wan_to_hf({k: torch.empty(s) for k, s in key_list("t5").items()},
                                                            with_tied=False).items()}
    write_sparse_safetensors(te / "model.safetensors", t5_names, "BF16", 2)
    umt5_config(UMT5_XXL).save_pretrained(str(te))
    cfg = wan.read_config(d)
    assert (cfg.vae_preset, cfg.t5_preset, cfg.vae, cfg.t5) == ("release", "release", WanVAEParams.full(), UMT5_XXL)
    report = wan.check_path(d)
    for name, params in (("vae", VAE_PARAMS), ("t5", T5_PARAMS)):
        c = report.components[name]
        assert c.ok and c.expected_from == "given" and c.params == params, c.lines()
