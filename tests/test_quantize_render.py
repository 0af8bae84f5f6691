"""runtime.weights: fp8 | int8 on the tiny wan-s2v model: the DiT forward and the end-to-end clip-mode render against
the official goldens, a streaming-mode render against the unquantized one, the LoRA merged before quantizing, the
block-at-a-time read, offload of the quantized weights, two ranks replicating the quantized DiT, mini, and the
refusals. The figures the bounds are set from
come from bench/quant_error.py (bench/results.md)."""

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.family import QUANTIZED
from avatar_cli.runtime.quantize import is_quantized, quantize_linears
from tests.test_wan_dit import CASES, run

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import quant_error  # noqa: E402  (bench/: the tiny job and its render, whose figures bench/results.md holds)

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"
PATHS = dict(QUANTIZED)["dit"]


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def golden_dit() -> tuple[WanS2VDiT, dict]:
    m = WanS2VDiT(WanDiTParams.tiny()).eval()
    m.load_state_dict(load_file(GOLDEN / "dit_tiny_weights.safetensors"), strict=True)
    return m, load_file(GOLDEN / "dit_cases.safetensors")


# The official WanModel_S2V's outputs on the golden tiny weights (tests/golden/make_wan_goldens.py), float32.
# Measured relative L2 error of the quantized forward, over cases a, b and c: int8 2.4e-3 .. 2.6e-3, fp8 1.6e-2 ..
# 1.7e-2 (bf16 weights and activations, for scale: 4.5e-3 .. 4.6e-3). int8 keeps 8 bits of each channel's range,
# fp8 (e4m3) 3 bits of mantissa: ~2^-8 vs ~2^-4 relative error per weight, averaged down over each dot product. The
# bounds are twice the measurement: a wrong scale, a transposed channel or a layer left out would be off by far more.
BOUNDS = {"int8": 5e-3, "fp8": 3.5e-2}


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_dit_forward_against_the_official_golden(golden_dit, weights):
    base, cases = golden_dit
    m = copy.deepcopy(base)
    assert quantize_linears(m, weights, PATHS) == 3 * 10 + 2 * 4
    for key in [k for k, (_, variant) in CASES.items() if not variant]:
        err = rel_l2(run(m, cases, key), cases[f"{key}.out"])
        assert BOUNDS[weights] / 4 < err < BOUNDS[weights], (key, err)


# umT5 (runtime.weights quantizes its 24 layers' Linears too) on the tiny random wan-s2v model: two prompts' and the
# negative prompt's encodings against the unquantized encoder's, float32 activations. Measured (bench/quant_error.py
# text): rel. L2 int8 2.1e-2 .. 3.7e-2, fp8 7.4e-2 .. 1.6e-1 (bf16 activations with unquantized weights, for scale:
# 1.1e-2 .. 2.2e-2). Larger than the DiT forward's: the tiny encoder's rows have 32 or 64 weights, so one channel's
# scale rounds few of them, and T5's unscaled attention logits carry the error into the softmax. Bounds: twice the
# largest, and an eighth of the smallest below (the Linears were quantized).
TEXT_BOUNDS = {"int8": (2.5e-3, 7.5e-2), "fp8": (9e-3, 3.2e-1)}


def test_umt5_encodings_against_unquantized(tmp_path):
    from avatar_cli.families import registry

    wan = tmp_path / "wan"
    registry.init_family_dir(wan, "tiny", seed=0, family="wan-s2v")
    ref = quant_error.text_encodings(wan, "float32", "bf16")
    assert sorted(ref) == ["0.negative", "0.text", "1.negative", "1.text"]
    for weights, (floor, bound) in TEXT_BOUNDS.items():
        got = quant_error.text_encodings(wan, "float32", weights)
        errors = {k: rel_l2(got[k], ref[k]) for k in ref}
        assert all(floor < e < bound for e in errors.values()), (weights, errors)


# --- renders -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The folder of bench/quant_error.py's tiny job (a 2 s, 4-step, 64x64 render of the tiny random model)."""
    return quant_error.tiny_job(tmp_path_factory.mktemp("quant")).parent


# Against the unquantized (float32) render of the same job, in 8-bit levels, measured on this 2 s, 4-step job
# (bench/quant_error.py; the DiT's and umT5's Linears quantized): streaming mode int8 mean |diff| 0.24 (max 5), fp8
# 0.68 (max 10). The error of each forward (above) and of the prompt's encoding compounds over the sampler's steps
# and the blocks. Bounds: about twice the measurement, and a floor showing the quantized weights were used at all.
FRAME_BOUNDS = {"int8": (0.05, 0.5, 10), "fp8": (0.15, 1.4, 20)}


def test_quantized_streaming_render_against_unquantized(tiny):
    """The streaming mode (LiveAvatar's block loop; the clip mode is compared with the official golden below)."""
    job, mode = tiny / "job.yaml", "streaming"
    ref = quant_error.render_frames(job, "bf16", mode)
    assert ref.shape == (32, 64, 64, 3)
    for weights, (floor, mean_bound, max_bound) in FRAME_BOUNDS.items():
        diff = np.abs(quant_error.render_frames(job, weights, mode) - ref)
        assert floor < diff.mean() < mean_bound and diff.max() <= max_bound, (weights, diff.mean(), diff.max())


# --- placement: LoRA first, offload of the quantized bytes, the meta count, the refusals ---------------------------

def placed_dit(model_dir: Path, weights: str, lora: Path | None = None, **offload):
    from avatar_cli.families.base import ParallelPlan
    from avatar_cli.families.registry import load_modules, resolve_model, with_lora
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.runtime.placement import place
    from tests.test_wan_lora_render import RANK, SCALE

    source = resolve_model(str(model_dir), model_dir.parent)
    if lora is not None:
        source = with_lora(source, lora, RANK, SCALE)
    modules = {"dit": load_modules(source)["dit"]}
    placement = place(modules, Runtime(torch.device("cpu"), torch.float32), Dist(), plan=ParallelPlan(
        quantized=QUANTIZED), weights=weights, **offload)
    return modules["dit"], placement


def quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every plain tensor of the model: a quantized weight's data and scales under their own names."""
    out = {}
    for name, t in model.state_dict().items():
        out.update({f"{name}.{a}": getattr(t, a) for a in t.__tensor_flatten__()[0]} if is_quantized(t) else {name: t})
    return out


def test_lora_is_merged_before_quantizing(tiny):
    """The quantized weights of base + LoRA (merged block by block as each is read, LoraMerge.part) are those of the
    pre-merged file quantized, bit for bit."""
    from tests.test_wan_lora_render import lora_factors, write_premerged

    lora = tiny / "lora.safetensors"
    save_file(lora_factors(), str(lora))
    write_premerged(tiny / "Wan2.2-S2V-tiny", lora, tiny / "premerged")
    merged, _ = placed_dit(tiny / "Wan2.2-S2V-tiny", "int8", lora)
    assert merged.after_load is None and is_quantized(merged.model.blocks[0].ffn[0].weight)
    want = quantized_state(placed_dit(tiny / "premerged", "int8")[0].model)
    got = quantized_state(merged.model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    plain = quantized_state(placed_dit(tiny / "Wan2.2-S2V-tiny", "int8")[0].model)
    assert not torch.equal(plain["blocks.0.ffn.0.weight.qdata"], got["blocks.0.ffn.0.weight.qdata"])


@pytest.mark.parametrize("offload", ["model", "block"])
def test_offload_streams_the_quantized_bytes(tiny, golden_dit, offload):
    """Offload packs what quantization left (1-byte data and scales): the forward equals the resident model's, and
    the bytes it moves are the meta-device count's."""
    from avatar_cli.modules.module import build_meta
    from avatar_cli.runtime.offload import HostTransfer, model_bytes
    from avatar_cli.runtime.quantize import quantized_bytes

    _, cases = golden_dit
    resident, _ = placed_dit(tiny / "Wan2.2-S2V-tiny", "fp8")
    moved, placement = placed_dit(tiny / "Wan2.2-S2V-tiny", "fp8", transfer=HostTransfer(), free_bytes=1,
                                  offload=offload)
    offloader = placement.offloaders["dit"]
    with offloader.stage():
        out = run(moved.model, cases, "b")
    torch.testing.assert_close(out, run(resident.model, cases, "b"), rtol=0, atol=0)
    meta = quantized_bytes(build_meta(WanS2VDiT, WanDiTParams.tiny()), "fp8", PATHS, torch.float32)
    assert model_bytes(moved.model) == model_bytes(resident.model) == meta
    assert meta < quantized_bytes(build_meta(WanS2VDiT, WanDiTParams.tiny()), "bf16", PATHS, torch.float32)


def test_quantized_components_are_not_sharded(tiny):
    """FSDP2 cannot shard torchao's tensors: runtime.shard: shard with quantized weights is a spec error (exit 2)."""
    from types import SimpleNamespace

    from avatar_cli.errors import InputError
    from avatar_cli.families.base import ParallelPlan
    from avatar_cli.families.registry import load_modules, resolve_model
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.placement import place

    source = resolve_model(str(tiny / "Wan2.2-S2V-tiny"), tiny)
    modules = {"dit": load_modules(source)["dit"]}
    two = SimpleNamespace(enabled=True, world_size=2)
    plan = ParallelPlan(sharded=("dit",), sp_heads=2, quantized=QUANTIZED)
    with pytest.raises(InputError, match="cannot shard the quantized weights of dit"):
        place(modules, Runtime(torch.device("cpu"), torch.float32), two, plan=plan, shard="shard", weights="int8")


def test_bad_weights_value_is_a_spec_error(tiny):
    from tests.conftest import avatar

    r = avatar("validate", str(tiny / "job.yaml"), "runtime.weights=int4")
    assert r.returncode == 2 and "runtime.weights" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_mini_renders_with_int8_weights(job_dir: Path, tiny_model: Path):
    """mini quantizes its DiT blocks' attention and MLP, not their modulation (`ada`), and renders. (The tiny mini's
    random init zeroes the modulation, so its blocks add nothing and the frames cannot show the rounding.)"""
    from avatar_cli.families.registry import load_modules, resolve_model
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.runtime.placement import place, plan_for
    from tests.conftest import avatar

    source = resolve_model(str(tiny_model), tiny_model.parent)
    modules = load_modules(source)
    place(modules, Runtime(torch.device("cpu"), torch.float32), Dist(), plan=plan_for(source.family.parallel, modules),
          weights="int8")
    block = modules["dit"].model.blocks[0]
    assert is_quantized(block.attn.qkv.weight) and is_quantized(getattr(block.mlp, "0").weight)
    assert not is_quantized(block.ada.weight) and not is_quantized(modules["text"].model.blocks[0].qkv.weight)
    r = avatar("render", str(job_dir / "job.yaml"), "--json", "runtime.weights=int8", "runtime.threads=1")
    assert r.returncode == 0 and '"event": "done"' in r.stdout, r.stderr[-2000:]


def test_weights_need_torchao_and_a_family_that_names_its_linears(tiny, monkeypatch):
    from avatar_cli.runtime.quantize import check_setting
    from tests.conftest import avatar

    check_setting("bf16", "toy", ())  # nothing to check
    with pytest.raises(ValueError, match="the toy family has no weights to quantize"):
        check_setting("fp8", "toy", ())
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    r = avatar("validate", str(tiny / "job.yaml"), "runtime.weights=int8")
    assert r.returncode == 2 and "needs torchao: pip install 'avatar-cli[quant]'" in r.stderr, r.stderr


def test_a_lazy_dit_is_read_and_quantized_a_block_at_a_time(tiny, monkeypatch):
    """Without a LoRA, placement reads block i + 1 only once block i is quantized, and gets the weights a whole read
    then quantized gives, bit for bit."""
    from avatar_cli.modules import loading

    read = loading.materialize
    seen = []

    def spy(model, index, device, dtype=None):
        blocks = getattr(model, "blocks", None)
        if blocks is None:  # a block: every block before it is quantized, every one after still on meta
            seen.append([is_quantized(b.ffn[0].weight) if not b.ffn[0].weight.is_meta else None
                         for b in spy.model.blocks])
        read(model, index, device, dtype)

    from avatar_cli.families.registry import load_modules, resolve_model

    source = resolve_model(str(tiny / "Wan2.2-S2V-tiny"), tiny)
    whole = load_modules(source)["dit"]
    whole.to("cpu", torch.float32)
    quantize_linears(whole.model, "int8", PATHS)
    original = quantize_linears.__globals__["load_quantized"]

    def load(model, *args):
        spy.model = model
        return original(model, *args)

    monkeypatch.setattr(loading, "materialize", spy)
    monkeypatch.setattr("avatar_cli.runtime.placement.load_quantized", load)
    streamed, _ = placed_dit(tiny / "Wan2.2-S2V-tiny", "int8")
    assert seen == [[None, None, None], [True, None, None], [True, True, None]]
    want, got = quantized_state(whole.model), quantized_state(streamed.model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# The end-to-end golden (two clips of the official WanS2V.generate on a tiny model) rendered with quantized weights,
# against the official latents and clip 0's frames (tests/test_wan_e2e_golden.py renders it unquantized to 1e-4).
# Measured (bench/quant_error.py; the DiT's and umT5's Linears quantized): int8 latents rel. L2 9.2e-3 / 9.3e-3
# (clips 0 / 1), frames mean |diff| 4.7e-3; fp8 4.7e-2 / 4.7e-2, 2.8e-2 (the DiT alone: int8 5.7e-3, fp8 3.4e-2).
# Bounds: twice that, and an eighth of it below (the weights were quantized). int8 only here (fp8's forward is
# bounded against the official golden above, its render in the streaming test).
OFFICIAL_BOUNDS = {"int8": (1.9e-2, 9.5e-3)}


def test_end_to_end_golden_with_quantized_weights(tmp_path):
    errors = quant_error.official_errors(tmp_path, tuple(OFFICIAL_BOUNDS))
    for weights, (latents, frames) in OFFICIAL_BOUNDS.items():
        e = errors[weights]
        assert latents / 8 < e["latents_0"] < latents and latents / 8 < e["latents_1"] < latents, (weights, e)
        assert frames / 8 < e["frames_0_mean"] < frames, (weights, e)


def test_two_ranks_replicate_the_quantized_dit(tiny, tmp_path):
    """torchrun, 2 gloo ranks, clip mode: the quantized DiT and umT5 replicated (not FSDP2-sharded), the DiT run
    sequence parallel: the frames are the one-process int8 render's, within the bound of
    tests/test_wan_family.py::test_two_ranks_match_one (Ulysses sums in another order; lossless video)."""
    from tests.conftest import avatar, avatar_process

    job, out = tiny / "job.yaml", {}
    for n, run in ((1, avatar), (2, avatar_process)):
        video = tmp_path / f"{n}.mp4"
        r = run("render", str(job), "-o", str(video), "--json", "--nproc", str(n), "runtime.weights=int8")
        assert r.returncode == 0, r.stderr[-2000:]
        out[n] = quant_error.frames_of(video)
    diff = np.abs(out[1] - out[2])
    assert out[1].shape == (32, 64, 64, 3)
    assert (diff > 0).mean() < 1e-3 and diff.max() <= 6, ((diff > 0).mean(), diff.max())
