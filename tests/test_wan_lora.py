"""The LiveAvatar LoRA merged at load (wan_s2v/lora.py) on the tiny WanS2VDiT with the golden random weights: the
merged forward equals the unmerged forward with the LoRA applied on the fly; each malformed file is refused by
name; the target set and LoRA size at full size on meta."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from avatar_cli.errors import InputError
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.lora import (
    LIVEAVATAR_RANK,
    LoraFactors,
    LoraFile,
    check_lora,
    lora_scale,
    merge_lora,
    peft_targets,
    read_lora,
)
from avatar_cli.modules.tensor_files import TensorInfo

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"
RANK = 8
SCALE = lora_scale(alpha=4.0, rank=RANK)  # 0.5, LiveAvatar's alpha / rank ratio
Q0 = "blocks.0.self_attn.q"


@pytest.fixture(scope="module")
def weights() -> dict:
    # random weights, the official zero-initialised layers (head, injector o, adain, cond_encoder) included
    return load_file(GOLDEN / "dit_tiny_weights.safetensors")


@pytest.fixture(scope="module")
def case() -> tuple:
    c = load_file(GOLDEN / "dit_cases.safetensors")
    return c["b.x"], 501, c["b.context"], c["b.ref"], c["b.motion"], c["b.cond"], c["b.audio"]


def tiny(weights: dict, dtype=torch.float32) -> WanS2VDiT:
    m = WanS2VDiT(WanDiTParams.tiny()).eval()
    m.load_state_dict(weights, strict=True)
    return m.to(dtype)


def random_factors(model: nn.Module, rank: int = RANK, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A (r, in), B (out, r)) for LiveAvatar's targets, sized so the LoRA changes the output clearly."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in peft_targets(model):
        o, i = model.get_submodule(name).weight.shape
        out[name] = (torch.randn(rank, i, generator=g) / i**0.5, torch.randn(o, rank, generator=g) / rank**0.5)
    return out


def write_lora(path: Path, factors: dict, prefix: str = "base_model.model.", adapter: str = ".default",
               extra: dict | None = None) -> Path:
    sd = {}
    for name, (a, b) in factors.items():
        sd[f"{prefix}{name}.lora_A{adapter}.weight"] = a.contiguous()
        sd[f"{prefix}{name}.lora_B{adapter}.weight"] = b.contiguous()
    save_file({**sd, **(extra or {})}, str(path))
    return path


def run(m: WanS2VDiT, case: tuple) -> torch.Tensor:
    with torch.no_grad():
        return m(*case)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def test_merged_forward_equals_lora_on_the_fly(tmp_path, weights, case):
    base = tiny(weights)
    factors = random_factors(base)
    path = write_lora(tmp_path / "lora.safetensors", factors)

    # unmerged: y += scale · (x A^T) B^T after each target Linear
    hooked = tiny(weights)

    def hook(a, b):
        return lambda mod, inp, out: out + SCALE * (inp[0] @ a.T) @ b.T

    handles = [hooked.get_submodule(n).register_forward_hook(hook(a, b)) for n, (a, b) in factors.items()]
    on_the_fly = run(hooked, case)
    for h in handles:
        h.remove()

    merged = tiny(weights)
    assert merge_lora(merged, read_lora(path, rank=RANK), SCALE) == len(factors) == 3 * 10 + 2 * 4
    out = run(merged, case)
    assert rel_err(out, on_the_fly) <= 1e-5
    assert rel_err(run(base, case), on_the_fly) > 1e-2  # the LoRA matters: the check above could fail
    # only the targets changed
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, weights[k])}
    assert changed == {f"{n}.weight" for n in factors}


@pytest.mark.parametrize("prefix,adapter", [("base_model.model.", ".default"), ("base_model.model.", ""),
                                            ("", ".default"), ("", "")])
def test_key_spellings_merge_alike(tmp_path, weights, prefix, adapter):
    # PEFT in memory (prefix + adapter name), save_pretrained (no adapter name), and both without the prefix
    base = tiny(weights)
    factors = random_factors(base)
    lora = read_lora(write_lora(tmp_path / "l.safetensors", factors, prefix, adapter), rank=RANK)
    assert set(lora.modules) == set(factors)
    assert lora.num_params == sum(a.numel() + b.numel() for a, b in factors.values())
    merge_lora(base, lora, SCALE)
    a, b = factors[Q0]
    assert torch.equal(base.get_submodule(Q0).weight, weights[f"{Q0}.weight"] + (b @ a) * SCALE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_peft_merge_and_unload(tmp_path, weights, dtype):
    # peft is not installed: this emulates what peft 0.17.1's merge_and_unload computes for LiveAvatar's flow
    # (get_peft_model upcasts bf16 adapters to fp32; Linear.merge does base.weight.data += (B @ A) * scaling)
    m = tiny(weights, dtype)
    factors = {n: (a.to(dtype), b.to(dtype)) for n, (a, b) in random_factors(m).items()}  # the file's dtype
    merge_lora(m, read_lora(write_lora(tmp_path / "l.safetensors", factors), rank=RANK), SCALE)
    for name, (a, b) in factors.items():
        w = weights[f"{name}.weight"].to(dtype)
        w += (b.float() @ a.float()) * SCALE  # in place on the base dtype, as peft does
        assert torch.equal(m.get_submodule(name).weight, w), name


def test_full_size_targets_and_lora_size():
    # LiveAvatar's LoRA: 40 x 8 attention + 40 x 2 FFN + 12 x 4 audio-injector modules, 676,331,520 params at r=128
    with torch.device("meta"):
        m = WanS2VDiT(WanDiTParams.full())
    targets = peft_targets(m)
    assert len(targets) == 40 * 8 + 40 * 2 + 12 * 4
    assert sum(n.startswith("audio_injector.injector.") for n in targets) == 48
    assert {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in targets if n.startswith("blocks.")} == {
        f"{a}.{p}" for a in ("self_attn", "cross_attn") for p in "qkvo"} | {"ffn.0", "ffn.2"}

    def info(*shape):  # a header entry; no data is read by check_lora
        return TensorInfo(torch.bfloat16, shape, Path("x"))

    r = LIVEAVATAR_RANK
    modules = {}
    for n in targets:
        o, i = m.get_submodule(n).weight.shape
        modules[n] = LoraFactors(f"{n}.lora_A.weight", f"{n}.lora_B.weight", info(r, i), info(o, r))
    lora = LoraFile(Path("x"), r, modules)
    assert len(check_lora(m, lora)) == 448 and lora.num_params == 676_331_520
    assert lora_scale() == 0.5


def refused(path: Path, *names: str, rank: int = RANK, model: nn.Module | None = None):
    with pytest.raises(InputError) as e:
        lora = read_lora(path, rank=rank)
        if model is not None:
            merge_lora(model, lora, SCALE)
    msg = str(e.value)
    assert "\n" not in msg
    for n in names:
        assert re.search(re.escape(n), msg), (n, msg)
    return msg


def one_factor(o=64, i=64, r=RANK):
    return torch.randn(r, i), torch.randn(o, r)


def test_refuses_tensors_that_are_not_factors(tmp_path):
    # LiveAvatar's loader (strict=False, load_lora_weight_only=False) would overwrite the base weight with these
    for stray in ("base_model.model.blocks.0.norm3.weight", "blocks.0.self_attn.q.bias",
                  "blocks.0.self_attn.q.lora_A.other.weight", "blocks.0.self_attn.q.lora_magnitude_vector"):
        path = write_lora(tmp_path / "s.safetensors", {Q0: one_factor()}, extra={stray: torch.zeros(64)})
        assert "not LoRA factors" in refused(path, stray)


def test_refuses_a_target_the_model_lacks(tmp_path, weights):
    m = tiny(weights)
    factors = {Q0: one_factor(), "blocks.7.self_attn.q": one_factor(), "blocks.0.norm3": one_factor()}
    path = write_lora(tmp_path / "t.safetensors", factors)
    refused(path, "blocks.7.self_attn.q", "blocks.0.norm3 (a FP32LayerNorm", model=m)
    # checked before any weight changed
    assert all(torch.equal(v, weights[k]) for k, v in m.state_dict().items())


def test_refuses_rank_mismatches(tmp_path):
    a, b = one_factor()
    path = write_lora(tmp_path / "r.safetensors", {Q0: (a, b[:, :4])})  # A rank 8, B rank 4
    assert "rank mismatch" in refused(path, f"{Q0}.lora_A.default.weight", f"{Q0}.lora_B.default.weight")
    path = write_lora(tmp_path / "c.safetensors", {Q0: one_factor()})  # consistent, but not the configured rank
    assert "configured rank is 128" in refused(path, f"{Q0}.lora_A.default.weight", rank=128)


def test_refuses_factors_that_do_not_fit_the_weight(tmp_path, weights):
    for a, b in (one_factor(i=32), one_factor(o=128)):  # q.weight is [64, 64]
        path = write_lora(tmp_path / "f.safetensors", {Q0: (a, b)})
        assert "do not fit" in refused(path, f"{Q0}.lora_A.default.weight", f"{Q0}.weight [64, 64]",
                                       model=tiny(weights))


def test_refuses_a_factor_without_its_partner(tmp_path):
    a, b = one_factor()
    for lone, missing in ((f"{Q0}.lora_A.weight", "no lora_B"), (f"{Q0}.lora_B.weight", "no lora_A")):
        save_file({lone: a if "lora_A" in lone else b}, str(tmp_path / "p.safetensors"))
        refused(tmp_path / "p.safetensors", lone, missing)


def test_refuses_two_spellings_of_one_factor_and_bad_tensors(tmp_path):
    a, b = one_factor()
    save_file({f"{Q0}.lora_A.weight": a, f"base_model.model.{Q0}.lora_A.default.weight": a.clone(),
               f"{Q0}.lora_B.weight": b}, str(tmp_path / "d.safetensors"))
    assert "two spellings" in refused(tmp_path / "d.safetensors", f"{Q0}.lora_A.weight")
    save_file({f"{Q0}.lora_A.weight": a.to(torch.int32), f"{Q0}.lora_B.weight": b}, str(tmp_path / "i.safetensors"))
    refused(tmp_path / "i.safetensors", f"{Q0}.lora_A.weight", "2-D float")
    save_file({}, str(tmp_path / "e.safetensors"))
    refused(tmp_path / "e.safetensors", "holds no tensors")


def test_refuses_non_finite_factors(tmp_path, weights):
    a, b = one_factor()
    a[0, 0] = float("nan")
    refused(write_lora(tmp_path / "n.safetensors", {Q0: (a, b)}), "NaN", model=tiny(weights))


def test_refuses_meta_weights(tmp_path):
    # the merge runs on loaded weights, before sharding: a meta model is a caller's mistake, not a bad file
    with torch.device("meta"):
        m = WanS2VDiT(WanDiTParams.tiny())
    lora = read_lora(write_lora(tmp_path / "m.safetensors", {Q0: one_factor()}), rank=RANK)
    with pytest.raises(ValueError, match="meta"):
        merge_lora(m, lora, SCALE)
