"""The checkpoint files users hold, read behind the wan-s2v family, each against the official layout holding the
same weights (the tiny model of `avatar models init`):

- the Diffusers repack with diffusers' own DiT class (WanS2VTransformer3DModel names; its full-size names and
  config as that class builds them are in tests/golden/wan_s2v/dit_diffusers_*): loads bit-identical weights;
- ComfyUI's single file, bare or under `model.diffusion_model.`: bit-identical weights; through `dit:` in a job,
  the same frames as the official directory;
- ComfyUI's scaled-FP8 file: weights within e4m3's rounding, the DiT's output within the bound stated below;
- GGUF (city96's layout) in Q8_0, Q4_K and Q6_K: the weights stay quantized in the model and dequantize exactly
  as gguf's own reference does; the DiT's output within the bounds stated below; a render through `dit:`;
- `avatar models check FILE`: each reported like a directory; another model's file, or a GGUF type that cannot be
  read, exit 2 naming it.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from avatar_cli.errors import InputError
from avatar_cli.families.registry import check_directory
from avatar_cli.families.wan_s2v import adapter_dit
from avatar_cli.families.wan_s2v import dit_file
from avatar_cli.families.wan_s2v import model_dir as wan
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.family import QUANTIZED
from avatar_cli.families.wan_s2v.files import DIFFUSERS, OFFICIAL
from avatar_cli.modules import gguf_weights
from avatar_cli.modules.loading import TensorIndex
from avatar_cli.modules.module import lazy_module
from avatar_cli.runtime.quantize import is_quantized
from tests.conftest import avatar, write_reference, write_wav
from tests.fp8_files import fp8_file
from tests.gguf_files import T, write_dit_gguf

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"


def key_list(name: str) -> dict[str, tuple[int, ...]]:
    rows = [line.split("\t") for line in (GOLDEN / f"{name}.txt").read_text().splitlines()]
    return {k: tuple(json.loads(s)) for k, s in rows}


@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("official") / "wan"
    wan.init_dir(path, "tiny", seed=0)
    return path


def dit_state(directory: Path) -> dict[str, torch.Tensor]:
    return wan._read_safetensors(directory / "diffusion_pytorch_model.safetensors.index.json")


def loaded(module) -> dict[str, torch.Tensor]:
    """A loaded DiT's weights as its layers read them (quantized ones dequantized), by official name."""
    model = (module.materialize("cpu") if module.is_lazy else module).model
    out = {}
    for k, v in model.state_dict().items():
        if ".parametrizations." in k:  # X.parametrizations.weight.original (the bytes) -> X.weight, dequantized
            if k.endswith(".original"):
                owner, attr = k.removesuffix(".original").split(".parametrizations.")
                out[f"{owner}.{attr}"] = getattr(model.get_submodule(owner), attr).detach()
            continue
        out[k] = v.dequantize() if is_quantized(v) else v  # an FP8 weight kept as stored: qdata x scale
    return out


def dit_inputs(p: WanDiTParams, seed: int = 0, frames: int = 2, hw: int = 8) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(16, frames, hw, hw, generator=g), 700, torch.randn(5, p.text_dim, generator=g),
            torch.randn(16, 1, hw, hw, generator=g), torch.randn(16, 19, hw, hw, generator=g),
            torch.zeros(16, frames, hw, hw), torch.randn(1, 25, p.audio_dim, 4 * frames, generator=g))


@torch.no_grad()
def forward(module, p: WanDiTParams) -> torch.Tensor:
    model = (module.materialize("cpu", torch.float32) if module.is_lazy else module.to("cpu", torch.float32)).model
    return model(*dit_inputs(p))  # (16, F, h, w) float32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --- Diffusers: diffusers' own DiT class -------------------------------------------------------------------

def test_diffusers_names_are_the_class_names():
    """The release's 1,260 names renamed one to one onto WanS2VTransformer3DModel's own state dict (built on meta
    from the diffusers Wan2.2-S2V port, listed in the golden), shapes unchanged; its config gives the release."""
    official, theirs = key_list("dit_keys"), key_list("dit_diffusers_keys")
    renamed = {adapter_dit.official_to_diffusers_key(k): s for k, s in official.items()}
    assert renamed == theirs and len(theirs) == 1260
    back = adapter_dit.diffusers_to_official_names(list(official))
    assert {back[k] for k in theirs} == set(official)
    config = json.loads((GOLDEN / "dit_diffusers_config.json").read_text())
    assert adapter_dit.params_from_diffusers_config(config) == WanDiTParams.full()
    assert adapter_dit.diffusers_config(WanDiTParams.full()) == config
    with pytest.raises(ValueError, match="added_kv_proj_dim"):
        adapter_dit.params_from_diffusers_config({**config, "added_kv_proj_dim": 1280})
    with pytest.raises(KeyError):
        adapter_dit.official_to_diffusers_key("blocks.0.self_attn.qkv.weight")


def diffusers_named(tmp_path: Path) -> Path:
    """The tiny model (seed 0) in the Diffusers layout, its transformer/ as diffusers' class writes it."""
    d = tmp_path / "diffusers-named"
    wan.init_dir(d, "tiny", seed=0, layout=DIFFUSERS)
    tr = d / "transformer"
    state = dit_state(tr)
    for f in tr.iterdir():
        f.unlink()
    renamed = {adapter_dit.official_to_diffusers_key(k): v for k, v in state.items()}
    save_file(renamed, str(tr / "diffusion_pytorch_model.safetensors"))
    (tr / "config.json").write_text(json.dumps(adapter_dit.diffusers_config(wan.tiny_dit())))
    return d


def test_diffusers_named_dit_loads_the_official_weights(official, tmp_path):
    d = diffusers_named(tmp_path)
    cfg = wan.read_config(d)
    # The class has no text length: its pipeline pads prompts to 512 tokens, as the release does.
    assert (cfg.layout, cfg.dit_names, cfg.dit) == (DIFFUSERS, "diffusers",
                                                    dataclasses.replace(wan.tiny_dit(), text_len=512))
    report = check_directory(d)
    assert report["ok"] and report["components"]["dit"]["checked"], report["lines"]
    wan.check_or_fail(cfg)
    a, b = loaded(wan.load_dit(wan.read_config(official))), loaded(wan.load_dit(cfg))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A renamed tensor left under its official name is named, from headers, before anything loads.
    f = d / "transformer" / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(f))
    sd["blocks.0.self_attn.q.weight"] = sd.pop("blocks.0.attn1.to_q.weight")
    save_file(sd, str(f))
    with pytest.raises(InputError, match="blocks.0.attn1.to_q.weight"):
        wan.check_or_fail(wan.read_config(d))


# --- ComfyUI single files ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["model.diffusion_model.", ""])
def test_comfy_single_file_loads_the_official_weights(official, tmp_path, prefix):
    f = tmp_path / "wan2.2_s2v_14B_bf16.safetensors"
    save_file({prefix + k: v for k, v in dit_state(official).items()}, str(f))
    info = dit_file.inspect(f)
    assert (info.format, info.prefix, info.ok) == ("comfy", prefix, True)
    cfg = wan.with_dit_file(wan.read_config(official), f)
    wan.check_or_fail(cfg)
    module = wan.load_dit(cfg)
    assert module.is_lazy  # read like the official shards: lazily, each rank its own rows
    a, b = loaded(wan.load_dit(wan.read_config(official))), loaded(module)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mixed", [False, True], ids=["scaled_fp8", "comfy_quant"])
def test_comfy_fp8_scaled_file(official, tmp_path, mixed):
    """The blocks' and injectors' FP8 Linears kept as stored (1 byte a weight and the file's scale, dequantized
    in each forward), the other FP8 tensors dequantized at load (fp8 x scale_weight, ComfyUI's arithmetic); with
    a LoRA to merge, everything dequantized at load. Every weight within e4m3's rounding of the official one (3
    mantissa bits: half an ulp is 2^-4 of the value; values under the smallest normal, 2^-6 x scale, are off by at
    most half a subnormal step, 2^-10 x scale), the rest bit-identical.

    The DiT's output against the official weights' (float32, 2 latent frames at 64x64 pixels) measured 5.2e-2 of its
    largest value (the random tiny model passes rounding on through every layer undamped); bound 1e-1: about twice
    that, and far below what a scale left out or applied twice would give (weights off by a factor of 448).
    """
    state = dit_state(official)
    f = tmp_path / "wan2.2_s2v_14B_fp8_scaled.safetensors"
    fp8_file(state, f, mixed)
    info = dit_file.inspect(f)
    assert info.format == "comfy-fp8" and info.ok and "float8_e4m3fn" in info.types
    cfg = wan.with_dit_file(wan.read_config(official), f)
    module = wan.load_dit(cfg, dict(QUANTIZED)["dit"])
    kept = [n for n, m in module.model.named_modules() if isinstance(m, torch.nn.Linear) and is_quantized(m.weight)]
    assert len(kept) == 3 * 8 + 3 * 2 + 2 * 4 and all(n.startswith(("blocks.", "audio_injector.")) for n in kept)
    assert all(module.model.get_submodule(n).weight.qdata.dtype == torch.float8_e4m3fn for n in kept)
    got = loaded(module)
    assert all(torch.equal(got[k], v) for k, v in loaded(wan.load_dit(cfg)).items())
    quantized = 0
    for k, v in state.items():
        if v.dim() == 2 and k.endswith(".weight") and "trainable_cond_mask" not in k:
            scale = float(v.abs().max()) / 448
            bound = torch.maximum(v.abs() * 2.0**-4, torch.full_like(v, scale * 2.0**-10))
            assert ((got[k] - v).abs() <= bound * (1 + 1e-6)).all(), k
            quantized += 1
        else:
            assert torch.equal(got[k], v), k
    assert quantized >= 40
    err = rel_err(forward(module, cfg.dit), forward(wan.load_dit(wan.read_config(official)), cfg.dit))
    assert 0 < err < 1e-1, err
    if mixed:  # a layer stored in a format not read here is named, from the header and the small blobs
        other = tmp_path / "int8.safetensors"
        fp8_file(state, other, mixed, fmt="int8_tensorwise")
        with pytest.raises(InputError, match="int8_tensorwise"):
            wan.with_dit_file(wan.read_config(official), other)


# --- GGUF ---------------------------------------------------------------------------------------------------

def test_torch_dequantization_is_gguf_s_own():
    """The torch ports give exactly what gguf's numpy reference gives, on random block bytes (every bit
    pattern is a valid block, the float16 scales set finite)."""
    rng = np.random.default_rng(0)
    for qtype in gguf_weights.TORCH_DEQUANT:
        t = getattr(gguf.GGMLQuantizationType, qtype)
        block, size = gguf.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(6, 2 * size), dtype=np.uint8)
        halves = raw.reshape(12, size)
        scales = {"Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [size - 2]}[qtype]
        for at in scales:
            halves[:, at:at + 2] = np.float16(rng.standard_normal(12) * 0.01).reshape(12, 1).view(np.uint8)
        ref = gguf.quants.dequantize(raw, t)  # (6, 2 * block)
        ours = gguf_weights.dequantize(torch.from_numpy(raw), qtype, (6, 2 * block))
        assert np.array_equal(ours.numpy(), ref), qtype


def k_params() -> WanDiTParams:
    """The tiny DiT widened so that its rows fill 256-value K-quant blocks (dim, ffn, freq and audio widths)."""
    return dataclasses.replace(WanDiTParams.tiny(), dim=256, ffn_dim=512, freq_dim=256, audio_dim=256,
                               text_dim=256)


def random_dit(p: WanDiTParams, folder: Path) -> dict[str, torch.Tensor]:
    """A random DiT of `p` written as the official shards + config.json (as `models init` writes one)."""
    torch.manual_seed(0)
    model = WanS2VDiT(p)
    wan._randomise(model, torch.Generator().manual_seed(1))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    wan._write_dit(folder, p, state)
    return state


# Measured errors of the DiT output (float32, 2 latent frames at 64x64 pixels; largest difference over the
# largest value) against the official weights', and the bounds: about twice each measurement, and each below the
# next coarser format's measurement, so a format read as a coarser one (or a mis-ordered block) fails. The random
# tiny model passes rounding on undamped through its layers: these are not the release's errors.
GGUF_CASES = {T.Q8_0: ("tiny", 9.3e-3, 2e-2), T.Q6_K: ("k", 2.6e-2, 5e-2), T.Q4_K: ("k", 1.07e-1, 2e-1)}


@pytest.mark.parametrize("qtype", list(GGUF_CASES), ids=lambda t: t.name)
def test_gguf_dit_stays_quantized_and_matches(official, tmp_path, qtype):
    size, measured, bound = GGUF_CASES[qtype]
    if size == "tiny":
        p, folder, state = wan.tiny_dit(), official, dit_state(official)
    else:
        p, folder = k_params(), tmp_path / "k"
        state = random_dit(p, folder)
    f = tmp_path / f"Wan2.2-S2V-14B-{qtype.name}.gguf"
    types = write_dit_gguf(f, state, qtype)
    info = dit_file.inspect(f)
    assert info.format == "gguf" and info.ok and info.types[qtype.name] >= 20, info.types
    module = dit_file.load(info, p)
    model = module.model
    # Quantized in memory: every quantized weight is its file bytes behind a parametrization.
    packed = {n: t for n, t in model.named_parameters() if t.dtype == torch.uint8}
    assert len(packed) == sum(t == qtype for t in types.values())
    # Q8_0 keeps 8.5 bits a value, Q6_K 6.56, Q4_K 4.5 (bf16: 16).
    bits = 8 * sum(t.numel() for t in packed.values()) / sum(state[n.split(".parametrizations.")[0] + ".weight"]
                                                           .numel() for n in packed)
    assert bits == {T.Q8_0: 8.5, T.Q6_K: 6.5625, T.Q4_K: 4.5}[qtype]
    # What each layer reads is exactly gguf's own dequantization of the file.
    reader = gguf.GGUFReader(str(f))
    got = loaded(module)
    for t in reader.tensors:
        if t.tensor_type == qtype:
            ref = gguf.quants.dequantize(t.data, qtype).reshape(state[t.name].shape)
            assert np.array_equal(got[t.name].numpy(), ref), t.name
    # Each quantized Linear dequantizes its weight once a forward: the cast of its input to the weight's dtype
    # reads the parametrization's dtype, not the weight.
    calls = []
    real = gguf_weights.dequantize
    try:
        gguf_weights.dequantize = lambda *a: calls.append(a[1]) or real(*a)
        forward(module, p)
    finally:
        gguf_weights.dequantize = real
    assert len(calls) == len(packed), (len(calls), len(packed))
    official_module = lazy_module("dit", WanS2VDiT, p, TensorIndex.from_safetensors(
        folder / "diffusion_pytorch_model.safetensors.index.json"))
    err = rel_err(forward(module, p), forward(official_module, p))
    assert 0 < err < bound, (err, measured)


@torch.no_grad()
def test_gguf_dit_streams_through_block_offload(official, tmp_path):
    """runtime.offload: block moves a GGUF DiT's blocks as their quantized bytes (the CPU standing in for the
    GPU): the same output as the DiT left in place."""
    from avatar_cli.runtime.offload import BlockOffloader, HostTransfer

    f = tmp_path / "q8.gguf"
    write_dit_gguf(f, dit_state(official), T.Q8_0)
    model = dit_file.load(dit_file.inspect(f), wan.tiny_dit()).model
    ref = model(*dit_inputs(wan.tiny_dit()))
    t = HostTransfer()
    off = BlockOffloader(model, t)
    with off.stage():
        out = model(*dit_inputs(wan.tiny_dit()))
    assert torch.equal(out, ref) and t.loads[:3] == ["root", "block 0", "block 1"]
    packed = sum(p.numel() for b in model.blocks for p in b.parameters() if p.dtype == torch.uint8)
    assert packed > 0 and t.peak_bytes < sum(p.numel() * p.element_size() for p in model.parameters())


def test_stored_quantized_weights_are_replicated_not_sharded(official, tmp_path):
    """FSDP2 cannot shard a GGUF or FP8 file's quantized weights: on several ranks placement counts such a DiT
    with the quantized ones (replicated; `runtime.shard: shard` refused by name before any rank is touched)."""
    from avatar_cli.families.base import ParallelPlan
    from avatar_cli.runtime.device import resolve_runtime
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.runtime.placement import place

    f = tmp_path / "q8.gguf"
    write_dit_gguf(f, dit_state(official), T.Q8_0)
    fp8 = tmp_path / "fp8.safetensors"
    fp8_file(dit_state(official), fp8)
    cfg = wan.read_config(official)
    for module in (dit_file.load(dit_file.inspect(f), cfg.dit),
                   wan.load_dit(wan.with_dit_file(cfg, fp8), dict(QUANTIZED)["dit"])):
        assert module.stored_quantized
        plan = ParallelPlan(sharded=("dit",), sp_heads=cfg.dit.num_heads)
        with pytest.raises(InputError, match="cannot shard the quantized weights of dit"):
            place({"dit": module}, resolve_runtime("cpu", "float32"), Dist(world_size=2), plan=plan,
                  shard="shard")
    assert not wan.load_dit(wan.with_dit_file(cfg, fp8)).stored_quantized  # dequantized at load (a LoRA's case)


def test_models_check_on_files(official, tmp_path):
    comfy = tmp_path / "wan2.2_s2v_14B_bf16.safetensors"
    save_file({adapter_dit.COMFY_PREFIX + k: v for k, v in dit_state(official).items()}, str(comfy))
    q8 = tmp_path / "Wan2.2-S2V-14B-Q8_0.gguf"
    write_dit_gguf(q8, dit_state(official), T.Q8_0)
    for path in (comfy, q8):
        result = avatar("models", "check", str(path), "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(result.stdout.strip().splitlines()[0])
        dit = report["components"]["dit"]
        assert dit["ok"] and dit["checked"] and dit["tensors"] == len(dit_state(official)), report

    # Another model's file: a Wan DiT without the S2V parts (as a T2V file is), and something else entirely.
    t2v = tmp_path / "wan2.1_t2v_1.3B_bf16.safetensors"
    save_file({k: v for k, v in dit_state(official).items()
               if not k.startswith(("casual_audio_encoder", "audio_injector"))}, str(t2v))
    other = tmp_path / "flux1-dev-Q8_0.gguf"
    write_dit_gguf(other, {"double_blocks.0.img_attn.qkv.weight": torch.randn(96, 32)}, T.Q8_0, arch="flux")
    # A GGUF type that cannot be dequantized here (gguf-py has no numpy code for the IQ2 types).
    iq = tmp_path / "Wan2.2-S2V-14B-IQ2_XXS.gguf"
    w = gguf.GGUFWriter(path=None, arch="wan")
    for k, v in dit_state(official).items():
        w.add_tensor(k, v.numpy())
    w.add_tensor("blocks.0.ffn.0.weight_iq", np.zeros((4, 66), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file(path=str(iq))
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    renamed = tmp_path / "transformer.safetensors"  # one file in diffusers' names: the directory reads it
    save_file({adapter_dit.official_to_diffusers_key(k): v for k, v in dit_state(official).items()}, str(renamed))
    for path, why in ((t2v, "another model"), (other, "architecture 'flux'"), (iq, "IQ2_XXS"),
                      (renamed, "Diffusers directory")):
        result = avatar("models", "check", str(path))
        assert result.returncode == 2, result.stdout + result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert why in result.stdout + last and "Traceback" not in result.stderr, (path, result.stdout, last)


# --- a job pointed at a file -------------------------------------------------------------------------------

def test_jobs_with_a_dit_file_render(official, tmp_path):
    """Through the CLI: `dit:` names ComfyUI's file beside the official directory (which then needs no DiT
    shards): the same frames as the directory's own DiT; a GGUF Q8_0 renders too; a T2V file and a LoRA on a
    GGUF DiT are exit 2, naming them."""
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 1.0)
    no_shards = tmp_path / "release-without-dit"
    shutil.copytree(official, no_shards, ignore=shutil.ignore_patterns("diffusion_pytorch_model*"))
    comfy = tmp_path / "wan2.2_s2v_14B_bf16.safetensors"
    save_file({adapter_dit.COMFY_PREFIX + k: v for k, v in dit_state(official).items()}, str(comfy))
    q8 = tmp_path / "Wan2.2-S2V-14B-Q8_0.gguf"
    write_dit_gguf(q8, dit_state(official), T.Q8_0)

    def render(name: str, model: Path, extra: str = ""):
        job = tmp_path / f"{name}.yaml"
        job.write_text(f"reference: ref.png\naudio: speech.wav\noutput: out/{name}.mp4\nmodel: {model}\n"
                       "seed: 3\nvideo: {width: 64, height: 64}\nsampling: {steps: 2}\n" + extra)
        return avatar("render", str(job), "--json")

    digests = {}
    fp8 = tmp_path / "wan2.2_s2v_14B_fp8_scaled.safetensors"
    fp8_file(dit_state(official), fp8)
    for name, model, extra in (("official", official, ""), ("comfy", no_shards, f"dit: {comfy}\n"),
                               ("q8", no_shards, f"dit: {q8.name}\n"), ("fp8", no_shards, f"dit: {fp8}\n")):
        result = render(name, model, extra)
        assert result.returncode == 0, result.stderr[-2000:]
        done = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")][-1]
        assert done["frames"] == 16
        digests[name] = done["frames_digest"]
    assert digests["comfy"] == digests["official"]
    # Quantized: close to the official frames, not equal.
    assert digests["q8"] != digests["official"] and digests["fp8"] != digests["official"]
    import av

    def frames(name: str) -> np.ndarray:
        with av.open(str(tmp_path / "out" / f"{name}.mp4")) as c:
            return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.float32)

    # Measured: 4.0 (Q8_0) and 5.2 (FP8) levels of 255 on average over the 16 frames (the random tiny model carries
    # the rounding through 2 steps and the decode undamped); bounds about twice that. A weight read into the wrong
    # place gives unrelated frames.
    ref = frames("official")
    for name, bound in (("q8", 8.0), ("fp8", 10.5)):
        diff = np.abs(frames(name) - ref)
        assert diff.mean() < bound, (name, diff.mean())

    t2v = tmp_path / "t2v.safetensors"
    save_file({k: v for k, v in dit_state(official).items() if not k.startswith("audio_injector")}, str(t2v))
    result = render("bad", no_shards, f"dit: {t2v}\n")
    assert result.returncode == 2 and "another model" in result.stderr and "Traceback" not in result.stderr
    lora = tmp_path / "lora.safetensors"
    save_file({"blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 64),
               "blocks.0.self_attn.q.lora_B.weight": torch.zeros(64, 4)}, str(lora))
    result = render("lora", no_shards, f"dit: {q8}\nlora: {lora}\nlora_rank: 4\n")
    assert result.returncode == 2 and "GGUF" in result.stderr, result.stderr[-500:]
    for dit in (q8, fp8):  # quantized already: not quantized a second time
        result = render("twice", no_shards, f"dit: {dit}\nruntime: {{weights: int8}}\n")
        assert result.returncode == 2 and "already" in result.stderr, result.stderr[-500:]
    for model, dit, why in ((no_shards, tmp_path / "gone.gguf", "no such file"),
                            ("mini", comfy, "reads its DiT from its model directory only")):
        result = render("refused", model, f"dit: {dit}\n")
        assert result.returncode == 2 and why in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_k_quant_gguf_renders_near_the_official_layout(tmp_path):
    """A Q4_K GGUF (city96's mix: the blocks' Linears in Q4_K where their rows fill 256-value blocks, the rest F16 or
    F32) of a tiny model whose DiT is widened to dim 256 so its blocks' rows do: rendered through the CLI, frames
    near the official layout's holding the same weights."""
    import av

    official = tmp_path / "wan"
    wan.init_dir(official, "tiny", seed=0)
    p = dataclasses.replace(wan.tiny_dit(), dim=256, ffn_dim=512)
    state = random_dit(p, official)  # the directory's DiT, widened
    no_shards = tmp_path / "release-without-dit"
    shutil.copytree(official, no_shards, ignore=shutil.ignore_patterns("diffusion_pytorch_model*"))
    q4 = tmp_path / "Wan2.2-S2V-14B-Q4_K_M.gguf"
    types = write_dit_gguf(q4, state, T.Q4_K)
    assert sum(t == T.Q4_K for t in types.values()) >= 40
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 1.0)
    for name, model, extra in (("official", official, ""), ("q4", no_shards, f"dit: {q4}\n")):
        (tmp_path / f"{name}.yaml").write_text(
            f"reference: ref.png\naudio: speech.wav\noutput: out/{name}.mp4\nmodel: {model}\nseed: 3\n"
            "video: {width: 64, height: 64}\nsampling: {steps: 2}\n" + extra)
        result = avatar("render", str(tmp_path / f"{name}.yaml"), "--json")
        assert result.returncode == 0, result.stderr[-2000:]

    def frames(name: str) -> np.ndarray:
        with av.open(str(tmp_path / "out" / f"{name}.mp4")) as c:
            return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.float32)

    # Measured: 7.6 levels of 255 on average (Q4_K's 4.5 bits a value through 2 steps and the decode); bound about
    # twice that.
    diff = np.abs(frames("q4") - frames("official"))
    assert diff.mean() < 15, diff.mean()
