"""Checkpoint files of Wan2.2-S2V: header readers, safe .pth loading, and the check of a whole model directory,
run on a sparse copy of the real 14B release (real headers and shapes, data regions left as holes)."""

import json
import os
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

# The modules check_dir builds on meta for the expected names: imported here, so a break fails these tests.
import avatar_cli.families.wan_s2v.dit  # noqa: F401
import avatar_cli.families.wan_s2v.text  # noqa: F401
import avatar_cli.families.wan_s2v.vae  # noqa: F401

from avatar_cli.errors import InputError
from avatar_cli.families.wan_s2v.files import DIFFUSERS, OFFICIAL, check_dir, expected_for
from avatar_cli.modules.tensor_files import (
    CheckpointFormatError,
    UnsafeCheckpointError,
    load_pth,
    read_pth_header,
    read_safetensors_header,
    read_safetensors_index,
)
from tests.conftest import avatar

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"
DIT_PARAMS = 16_295_755_609  # the release's DiT, counted from its safetensors headers
T5_PARAMS = 5_680_910_336  # the release's umT5-XXL encoder
VAE_PARAMS = 126_892_531  # the release's Wan2.1 VAE

# The 14B release's config.json (WanModel_S2V.__init__ argument names).
CONFIG_14B = {
    "_class_name": "WanModel_S2V", "_diffusers_version": "0.35.0", "model_type": "s2v",
    "patch_size": [1, 2, 2], "text_len": 512, "in_dim": 16, "dim": 5120, "ffn_dim": 13824, "freq_dim": 256,
    "text_dim": 4096, "out_dim": 16, "num_heads": 40, "num_layers": 40, "window_size": [-1, -1],
    "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "cond_dim": 16, "audio_dim": 1024,
    "num_audio_token": 4, "enable_adain": True, "adain_mode": "attn_norm",
    "audio_inject_layers": [0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39], "zero_init": True,
    "zero_timestep": True, "enable_motioner": False, "add_last_motion": True, "enable_tsm": False,
    "trainable_token_pos_emb": False, "motion_token_num": 1024, "enable_framepack": True,
    "framepack_drop_mode": "padd",
}


def key_list(name: str) -> list[tuple[str, tuple[int, ...]]]:
    rows = [line.split("\t") for line in (GOLDEN / f"{name}_keys.txt").read_text().splitlines()]
    return [(k, tuple(json.loads(s))) for k, s in rows]


def as_expected(keys):
    return {k: (shape, None) for k, shape in keys}


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def write_sparse_safetensors(path: Path, entries, dtype: str = "BF16", size: int = 2) -> None:
    """A real safetensors header; the data region is a hole (os.truncate), so nothing is written for it."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        nbytes = numel(shape) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)


def write_sparse_dit(folder: Path, entries, shard_bytes: float = 10e9) -> None:
    """Split over shards of at most ~10 GB as the release does (4 shards for 32.6 GB), plus the index json."""
    shards, cur, cur_bytes = [], [], 0
    for name, shape in entries:
        nbytes = numel(shape) * 2
        if cur and cur_bytes + nbytes > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape))
        cur_bytes += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_sparse_safetensors(folder / fname, shard)
        weight_map.update({name: fname for name, _ in shard})
    total = sum(numel(s) * 2 for _, s in entries)
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_sparse_pth(path: Path, entries, dtype: torch.dtype) -> None:
    """torch.save of fake tensors under skip_data: a real zip archive with the real pickle and zip directory,
    the data records left as holes (the 11.4 GB T5 file takes ~1 MB of disk)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.serialization import skip_data

    with FakeTensorMode():
        sd = {k: torch.empty(shape, dtype=dtype) for k, shape in entries}
    with skip_data(materialize_fake_tensors=True):
        torch.save(sd, path)


def sparse_supported(folder: Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"x")
    os.truncate(probe, 1 << 30)
    ok = probe.stat().st_blocks * 512 < (1 << 20)
    probe.unlink()
    return ok


def make_official_dir(root: Path, dit_entries) -> Path:
    root.mkdir(parents=True)
    if not sparse_supported(root):
        pytest.skip("this filesystem does not keep sparse files (the copy would write ~45 GB)")
    write_sparse_dit(root, dit_entries)
    (root / "config.json").write_text(json.dumps(CONFIG_14B, indent=2))
    write_sparse_pth(root / "models_t5_umt5-xxl-enc-bf16.pth", key_list("t5"), torch.bfloat16)
    write_sparse_pth(root / "Wan2.1_VAE.pth", key_list("vae"), torch.float32)
    tok = root / "google" / "umt5-xxl"
    tok.mkdir(parents=True)
    for f in ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"):
        (tok / f).write_text("{}")
    w2v = root / "wav2vec2-large-xlsr-53-english"
    w2v.mkdir()
    (w2v / "config.json").write_text('{"model_type": "wav2vec2"}')
    (w2v / "preprocessor_config.json").write_text('{"sampling_rate": 16000}')
    save_file({"wav2vec2.masked_spec_embed": torch.zeros(1024)}, w2v / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return make_official_dir(tmp_path_factory.mktemp("wan") / "Wan2.2-S2V-14B", key_list("dit"))


@pytest.fixture(scope="module")
def given() -> dict:
    """Expected key lists from the release's (tests-only) key files; at run time they come from our modules."""
    return {name: as_expected(key_list(name)) for name in ("dit", "t5", "vae")}


def test_check_sparse_14b_release(release, given):
    disk = sum(p.stat().st_blocks * 512 for p in release.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in release.rglob("*") if p.is_file())
    assert size > 44e9 and disk < 50e6  # the real sizes, but holes on disk
    report = check_dir(release, expected=given)  # its speed: bench/check_speed.py
    assert report.layout == OFFICIAL
    dit = report.components["dit"]
    assert dit.tensors == 1260 and dit.params == DIT_PARAMS
    assert dit.dtypes == {"bfloat16": 1260} and dit.nbytes == 2 * DIT_PARAMS
    assert len([f for f in dit.files if f.suffix == ".safetensors"]) == 4
    t5, vae = report.components["t5"], report.components["vae"]
    assert (t5.tensors, t5.params, t5.dtypes) == (242, T5_PARAMS, {"bfloat16": 242})
    assert (vae.tensors, vae.params, vae.dtypes) == (194, VAE_PARAMS, {"float32": 194})
    assert report.ok, "\n".join(report.lines())
    assert report.components["wav2vec2"].expected_from is None  # listed, not compared
    assert "16,295,755,609 params" in report.lines()[1]


def test_check_with_our_modules(release):
    """At run time the expected names and shapes come from our modules on meta: the DiT from config.json, the
    T5 encoder through its adapter, the VAE from its params. They must accept the real release as it is."""
    report = check_dir(release)  # its speed: bench/check_speed.py
    assert report.ok, "\n".join(report.lines())
    for name in ("dit", "t5", "vae"):
        assert report.components[name].expected_from is not None, name
    assert report.components["dit"].expected_from.startswith("WanS2VDiT")


def test_dit_expected_follows_config(tmp_path, release):
    """The DiT's expected keys follow config.json: a 39-layer config finds block 39 unexpected; a config field
    our params refuse is a named problem, not a crash."""
    root = tmp_path / "cfg"
    root.mkdir()
    for f in release.iterdir():
        if f.name.startswith("diffusion_pytorch_model"):
            (root / f.name).symlink_to(f)
    (root / "config.json").write_text(json.dumps({**CONFIG_14B, "num_layers": 39,
                                                  "audio_inject_layers": [0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36]}))
    dit = check_dir(root).components["dit"]
    assert dit.unexpected and all(n.startswith(("blocks.39.", "audio_injector.")) for n in dit.unexpected)
    assert "blocks.39.ffn.2.bias" in dit.unexpected and not dit.missing and not dit.mis_shaped
    (root / "config.json").write_text(json.dumps({**CONFIG_14B, "dimension": 5120}))
    dit = check_dir(root).components["dit"]
    assert dit.tensors == 1260 and any("config.json" in p and "dimension" in p for p in dit.problems)


def test_faults_are_named(tmp_path, given):
    """A mis-shaped, a missing and an extra tensor, each named; a missing file named."""
    entries = dict(key_list("dit"))
    entries["blocks.0.self_attn.q.weight"] = (5120, 5121)
    del entries["blocks.3.ffn.2.bias"]
    entries["blocks.40.norm3.weight"] = (5120,)
    root = tmp_path / "broken"
    root.mkdir()
    if not sparse_supported(root):
        pytest.skip("no sparse files on this filesystem")
    write_sparse_dit(root, list(entries.items()))
    (root / "config.json").write_text(json.dumps(CONFIG_14B))
    report = check_dir(root, expected=given)
    dit = report.components["dit"]
    assert dit.mis_shaped == [("blocks.0.self_attn.q.weight", (5120, 5121), (5120, 5120))]
    assert dit.missing == ["blocks.3.ffn.2.bias"]
    assert dit.unexpected == ["blocks.40.norm3.weight"]
    text = "\n".join(report.lines())
    for name in ("blocks.0.self_attn.q.weight", "blocks.3.ffn.2.bias", "blocks.40.norm3.weight"):
        assert name in text
    assert not report.ok
    assert any("Wan2.1_VAE.pth" in p for p in report.components["vae"].problems)
    assert any("umt5-xxl" in p for p in report.components["tokenizer"].problems)


def test_wrong_config_class_reported(tmp_path):
    root = tmp_path / "x"
    root.mkdir()
    save_file({"a": torch.zeros(2)}, root / "diffusion_pytorch_model.safetensors")
    (root / "config.json").write_text(json.dumps({"_class_name": "WanModel"}))
    report = check_dir(root)
    assert any("WanModel_S2V" in p for p in report.components["dit"].problems)


def test_not_a_model_dir(tmp_path):
    with pytest.raises(CheckpointFormatError, match="not a Wan2.2-S2V-14B directory"):
        check_dir(tmp_path)


def test_diffusers_layout(tmp_path, given):
    root = tmp_path / "Wan2.2-S2V-14B-Diffusers"
    for sub in ("transformer", "text_encoder", "vae", "tokenizer", "audio_encoder", "audio_processor"):
        (root / sub).mkdir(parents=True)
    if not sparse_supported(root):
        pytest.skip("no sparse files on this filesystem")
    (root / "model_index.json").write_text('{"_class_name": "WanSpeechToVideoPipeline"}')
    write_sparse_dit(root / "transformer", key_list("dit"))
    (root / "transformer" / "config.json").write_text(json.dumps(CONFIG_14B))
    for sub, fname in (("text_encoder", "model.safetensors"), ("vae", "diffusion_pytorch_model.safetensors"),
                       ("audio_encoder", "model.safetensors")):
        save_file({"w": torch.zeros(3, 2)}, root / sub / fname)
        (root / sub / "config.json").write_text("{}")
    (root / "tokenizer" / "tokenizer_config.json").write_text("{}")
    (root / "tokenizer" / "spiece.model").write_bytes(b"\0")
    (root / "audio_processor" / "preprocessor_config.json").write_text("{}")
    report = check_dir(root, expected={"dit": given["dit"]})
    assert report.layout == DIFFUSERS
    assert report.components["dit"].params == DIT_PARAMS and report.components["dit"].ok
    assert report.ok, "\n".join(report.lines())
    assert report.components["t5"].params == 6 and report.components["t5"].expected_from is None


def test_safetensors_header_spans(tmp_path):
    """The byte ranges read from the header hold exactly the tensors' bytes."""
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.tensor([7, 8], dtype=torch.int64)}
    save_file(tensors, tmp_path / "m.safetensors")
    infos = read_safetensors_header(tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    for name, t in tensors.items():
        info = infos[name]
        assert (info.dtype, info.shape, info.nbytes) == (t.dtype, tuple(t.shape), t.numel() * t.element_size())
        start, end = info.span
        assert data[start:end] == t.numpy().tobytes()


def test_safetensors_truncated_and_garbage(tmp_path):
    save_file({"a": torch.zeros(100)}, tmp_path / "m.safetensors")
    raw = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-10])
    with pytest.raises(CheckpointFormatError, match="truncated: entry 'a'"):
        read_safetensors_header(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointFormatError, match="not a safetensors file"):
        read_safetensors_header(tmp_path / "junk.safetensors")


def test_index_must_agree_with_shards(tmp_path):
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path / "s1.safetensors")
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    assert set(read_safetensors_index(index)) == {"a", "b"}
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="holds 'b', which the index does not list"):
        read_safetensors_index(index)
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors",
                                                "c": "s1.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="maps 'c' to s1.safetensors, which does not hold it"):
        read_safetensors_index(index)
    index.write_text(json.dumps({"weight_map": {"a": "../s1.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="not a plain file name"):
        read_safetensors_index(index)


def rchar(io: Path) -> int:
    if not io.exists():
        return 0
    return int(next(ln for ln in io.read_text().splitlines() if ln.startswith("rchar")).split()[1])


def test_pth_header_reads_little_of_a_large_sparse_file(tmp_path):
    """11.4 GB T5 .pth (sparse): the mmap'd load reads only the pickle and the zip directory (its speed:
    bench/check_speed.py)."""
    path = tmp_path / "t5.pth"
    write_sparse_pth(path, key_list("t5"), torch.bfloat16)
    assert path.stat().st_size > 11e9
    io = Path("/proc/self/io")
    read_before = rchar(io)
    infos = read_pth_header(path)
    if io.exists():  # bytes this process read through read(): ~1 MB (pickle + zip directory), not 11 GB
        assert rchar(io) - read_before < 50e6
    assert len(infos) == 242 and sum(i.numel for i in infos.values()) == T5_PARAMS
    assert infos["token_embedding.weight"].shape == (256384, 4096)


class Payload:
    """Unpickling this runs os.mkdir(marker): the file would create a folder if it were ever executed."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pth_with_object_refused_and_not_executed(tmp_path):
    marker = tmp_path / "EXECUTED"
    path = tmp_path / "evil.pth"
    torch.save({"w": torch.ones(2), "payload": Payload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_pth(path)
    msg = str(err.value)
    assert str(path) in msg and "entry 'payload'" in msg and "mkdir" in msg
    assert not marker.exists()  # nothing ran: neither torch's check nor our diagnosis
    with pytest.raises(UnsafeCheckpointError):
        read_pth_header(path)
    assert not marker.exists()
    # Shows the payload is live: an unrestricted load does run it.
    torch.load(path, weights_only=False)
    assert marker.is_dir()
    # The CLI turns it into exit 2, and callers may catch it as a ValueError.
    assert isinstance(err.value, InputError) and isinstance(err.value, ValueError) and err.value.exit_code == 2


class Settings:
    """A plain custom class: weights_only refuses its GLOBAL before building it."""

    def __init__(self):
        self.lr = 0.1


@pytest.mark.parametrize("obj, entry", [
    ({"w": torch.ones(2), "cfg": Settings()}, r"entry 'cfg' is an object built by '[\w.]*Settings'"),
    ({"w": torch.ones(2), "meta": {"step": 3}}, "entry 'meta' is a dict"),
    ({"w": torch.ones(2), "n": 5}, "entry 'n' is an int"),
    ([torch.ones(2)], "the top-level object is a list"),
    ({1: torch.ones(2)}, "key 1 is an int"),
])
def test_pth_not_flat_refused(tmp_path, obj, entry):
    path = tmp_path / "bad.pth"
    torch.save(obj, path)
    with pytest.raises(UnsafeCheckpointError, match=entry) as err:
        load_pth(path)
    assert str(path) in str(err.value)


def test_pth_state_dict_loads(tmp_path):
    m = torch.nn.Linear(3, 4)
    path = tmp_path / "sd.pth"
    torch.save(m.state_dict(), path)  # an OrderedDict carrying _metadata, as the release's .pth files do
    sd = load_pth(path)
    assert set(sd) == {"weight", "bias"} and torch.equal(sd["weight"], m.weight.detach())
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointFormatError, match="junk.pth: not a readable torch checkpoint") as err:
        load_pth(tmp_path / "junk.pth")
    assert not isinstance(err.value, UnsafeCheckpointError)


def test_vae_expected_from_module_matches_release():
    """At run time the VAE's expected names and shapes come from our module built on meta."""
    expected, source = expected_for("vae", OFFICIAL, None)
    assert expected is not None, source
    assert {k: s for k, (s, _) in expected.items()} == dict(key_list("vae"))


def test_models_check_cli_on_the_sparse_14b_release(release):
    """`avatar models check` itself (headers only): the real tensor count and parameters (its time in a fresh
    process: bench/check_speed.py)."""
    result = avatar("models", "check", str(release), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    dit = report["components"]["dit"]
    assert (dit["tensors"], dit["params"], dit["checked"]) == (1260, DIT_PARAMS, True)
    assert report["components"]["vae"]["params"] == VAE_PARAMS and report["components"]["t5"]["params"] == T5_PARAMS
    assert report["ok"]


def test_models_check_cli_names_a_mis_shaped_tensor(tmp_path):
    from avatar_cli.families.registry import init_family_dir

    d = tmp_path / "tiny"
    init_family_dir(d, "tiny", family="wan-s2v")
    vae = {k: v.clone() for k, v in load_pth(d / "Wan2.1_VAE.pth").items()}  # mapped: copy before overwriting
    vae["decoder.head.2.weight"] = torch.zeros(3, 8, 3, 3, 2)  # one kernel dimension wrong
    del vae["conv2.bias"]
    torch.save(vae, d / "Wan2.1_VAE.pth")
    result = avatar("models", "check", str(d), "--json")
    assert result.returncode == 2
    report = json.loads(result.stdout.strip().splitlines()[0])
    vae_report = report["components"]["vae"]
    assert not report["ok"] and "conv2.bias" in vae_report["missing"]
    assert [m[0] for m in vae_report["mis_shaped"]] == ["decoder.head.2.weight"]
