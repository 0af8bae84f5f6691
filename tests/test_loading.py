"""Lazy loading (modules/loading.py): a model built on meta is filled from its safetensors files by positioned
reads, bit for bit as an eager load; under 2-rank FSDP2 each rank reads only its shard's rows, and its memory
grows by about half the checkpoint."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from avatar_cli.errors import InputError
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.modules import loading
from avatar_cli.modules.loading import TensorIndex, materialize
from avatar_cli.modules.module import build_meta, lazy_module, save_sharded_safetensors
from avatar_cli.modules.tensor_files import CheckpointFormatError
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.offload import HostTransfer
from avatar_cli.runtime.placement import place
from tests.conftest import torchrun

ROOT = Path(__file__).parent.parent
GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"
SCRIPTS = Path(__file__).parent / "dist_scripts"
TORCHRUN = ["--standalone", "--nproc_per_node", "2"]


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN / "dit_tiny_weights.safetensors")


@pytest.fixture(scope="module")
def release_layout(weights, tmp_path_factory) -> Path:
    """The tiny DiT's weights in the release's layout: 4 shards and an index."""
    folder = tmp_path_factory.mktemp("tiny_dit")
    save_sharded_safetensors(folder, {k: v.nbytes for k, v in weights.items()}, weights.__getitem__, shards=4)
    return folder


def lazy_tiny(folder: Path):
    return lazy_module("dit", WanS2VDiT, WanDiTParams.tiny(), TensorIndex.from_safetensors(folder))


def forward(model: nn.Module) -> torch.Tensor:
    c = load_file(GOLDEN / "dit_cases.safetensors")
    with torch.no_grad():
        return model(c["b.x"], c["b.t"], c["b.context"], c["b.ref"], c["b.motion"], c["b.cond"], c["b.audio"])


def test_release_layout_is_four_shards_and_an_index(release_layout, weights):
    names = sorted(p.name for p in release_layout.iterdir())
    assert names == [f"diffusion_pytorch_model-0000{i}-of-00004.safetensors" for i in range(1, 5)] + [
        "diffusion_pytorch_model.safetensors.index.json"]
    weight_map = json.loads((release_layout / names[-1]).read_text())["weight_map"]
    assert set(weight_map) == set(weights) and len(set(weight_map.values())) == 4


def test_lazy_module_reads_nothing_until_materialized_then_equals_the_file(release_layout, weights, monkeypatch):
    reads = []
    real = loading._Reader._pread
    monkeypatch.setattr(loading._Reader, "_pread", lambda self, *a: reads.append(a[0]) or real(self, *a))
    m = lazy_tiny(release_layout)
    assert m.is_lazy and reads == [] and m.device.type == "meta"
    assert m.dtype == torch.float32 and m.num_params == sum(v.numel() for v in weights.values())
    m.materialize("cpu")
    assert not m.is_lazy and len(set(reads)) == 4  # every shard read, each tensor once
    state = m.model.state_dict()
    assert set(state) == set(weights)
    for k, v in weights.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
        assert state[k].data_ptr() % 64 == 0  # aligned like load_module's copies (BLAS rounds by alignment)


def test_conversion_in_small_staging_steps_equals_casting_the_eager_load(release_layout, weights, monkeypatch):
    monkeypatch.setattr(loading, "STAGING_BYTES", 1000)  # many steps per tensor, boundaries mid-row
    m = lazy_tiny(release_layout).to("cpu", torch.bfloat16)  # `to` on a lazy module reads straight into bf16
    state = m.model.state_dict()
    assert all(state[k].dtype == torch.bfloat16 and torch.equal(state[k], v.bfloat16()) for k, v in weights.items())


def test_forward_of_the_lazy_model_equals_the_eager_one(release_layout, weights):
    eager = WanS2VDiT(WanDiTParams.tiny()).eval()
    eager.load_state_dict(weights, strict=True)
    assert torch.equal(forward(lazy_tiny(release_layout).materialize("cpu").model), forward(eager))


@pytest.mark.parametrize("change, named", [
    (lambda w: w.pop("blocks.1.ffn.0.weight"), "missing keys: blocks.1.ffn.0.weight"),
    (lambda w: w.update(extra=torch.zeros(2)), "unexpected keys: extra"),
    (lambda w: w.update({"head.head.bias": torch.zeros(3)}), "shape mismatch: head.head.bias (file [3], config [64])"),
])
def test_a_checkpoint_that_does_not_fit_is_named_before_any_read(weights, tmp_path, change, named):
    w = dict(weights)
    change(w)
    save_file(w, tmp_path / "dit.safetensors")
    index = TensorIndex.from_safetensors(tmp_path)
    with pytest.raises(InputError, match="weights don't match the config") as e:
        lazy_module("dit", WanS2VDiT, WanDiTParams.tiny(), index)
    assert named in str(e.value) and str(tmp_path / "dit.safetensors") in str(e.value)
    with pytest.raises(InputError, match=re.escape(named)):
        materialize(build_meta(WanS2VDiT, WanDiTParams.tiny()), index, "cpu")


def test_rename_maps_another_layout_and_refuses_two_names_for_one(weights, tmp_path):
    save_file({**{"model." + k: v for k, v in weights.items()}, "model.lora_A": torch.zeros(1)},
              tmp_path / "dit.safetensors")
    index = TensorIndex.from_safetensors(tmp_path / "dit.safetensors",
                                         rename=lambda k: None if "lora" in k else k.removeprefix("model."))
    m = lazy_module("dit", WanS2VDiT, WanDiTParams.tiny(), index).materialize("cpu")
    assert torch.equal(m.model.head.head.weight, weights["head.head.weight"])
    with pytest.raises(CheckpointFormatError, match=r"'model\.\S+' and 'model\.\S+' both map to 'same'"):
        TensorIndex.from_safetensors(tmp_path, rename=lambda k: "same")


def test_a_folder_must_hold_one_index_or_one_file(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "a.safetensors")
    save_file({"b": torch.zeros(1)}, tmp_path / "b.safetensors")
    with pytest.raises(InputError, match="expected one .* found a.safetensors, b.safetensors"):
        TensorIndex.from_safetensors(tmp_path)


class Rope(nn.Module):
    """A non-persistent table rebuilt by reset_buffers (what a model whose buffers are not in the file does)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.empty(4), persistent=False)
        self.reset_buffers()

    def reset_buffers(self):
        self.table = torch.arange(4.0)


class Toy(nn.Module):
    def __init__(self, with_reset: bool = True):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)
        self.b.weight = self.a.weight  # tied: one tensor under two names
        self.register_buffer("scale", torch.ones(2))  # persistent: read from the file
        self.rope = Rope() if with_reset else nn.Module()
        if not with_reset:
            self.rope.register_buffer("table", torch.empty(4), persistent=False)


def test_buffers_tied_weights_and_non_persistent_tables(tmp_path):
    torch.manual_seed(0)
    toy = Toy()
    state = {k: torch.randn(v.shape) for k, v in toy.state_dict().items()}
    state["b.weight"] = state["a.weight"]
    save_file({k: v.clone() for k, v in state.items()}, tmp_path / "toy.safetensors")
    with torch.device("meta"):
        lazy = Toy()
    materialize(lazy, TensorIndex.from_safetensors(tmp_path), "cpu")
    assert all(torch.equal(lazy.state_dict()[k], v) for k, v in state.items())
    assert lazy.b.weight is lazy.a.weight and torch.equal(lazy.rope.table, torch.arange(4.0))
    with torch.device("meta"):
        bare = Toy(with_reset=False)
    with pytest.raises(ValueError, match="rope: non-persistent buffer.* table .* no reset_buffers"):
        materialize(bare, TensorIndex.from_safetensors(tmp_path), "cpu")


@pytest.mark.parametrize("offload", [False, True])
def test_single_process_placement_reads_a_lazy_module_where_it_runs(release_layout, weights, offload):
    m = lazy_tiny(release_layout)
    extra = dict(transfer=HostTransfer(), free_bytes=1, offload="model") if offload else {}
    placement = place({"dit": m}, Runtime(torch.device("cpu"), torch.bfloat16), Dist(), **extra)
    assert not m.is_lazy and m.dtype == torch.bfloat16
    assert list(placement.offloaders) == (["dit"] if offload else [])
    assert torch.equal(m.model.blocks[2].ffn[2].weight.cpu(), weights["blocks.2.ffn.2.weight"].bfloat16())


def _torchrun(args: list[str], timeout: float) -> dict | list:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(SCRIPTS))
    r = torchrun(*TORCHRUN, *args, env=env, timeout=timeout)
    lines = [line for line in r.stdout.splitlines() if line.startswith(("{", "["))]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(lines[-1])


def test_two_ranks_each_read_exactly_their_fsdp2_rows(release_layout):
    res = _torchrun([str(SCRIPTS / "lazy_load.py"), str(release_layout), str(GOLDEN)], timeout=120)
    assert res["ok"] is True
    for rank, figures in enumerate(res["ranks"]):
        for label in ("float32", "bfloat16", "float32/offload"):
            f = figures[label]
            assert f["equal_shards"] == f["tensors"] == 141 and f["forward_rel_diff"] == 0.0
            # Uneven dim-0 splits: 1- and 3-row tensors over 2 ranks leave rank 1 short, six of them empty.
            assert f["uneven"] == 7 and f["empty_on_rank"] == (6 if rank == 1 else 0)


def test_two_ranks_each_grow_by_about_half_the_checkpoint(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import load_memory
    finally:
        sys.path.remove(str(ROOT / "bench"))
    folder = tmp_path / "test"
    load_memory.write_checkpoint(folder, load_memory.params("test"))
    rows = load_memory.run_ranks(folder, "test", timeout_s=120)
    slack = 16 << 20  # interpreter and allocator noise, beside a ~60 MB shard
    for r in rows:
        assert r["local_shard_mb"] < 0.51 * r["checkpoint_mb"]  # each rank keeps half (+ padding rows)
        assert r["delta_mb"] * 2**20 < 0.6 * r["checkpoint_mb"] * 2**20 + slack, r
