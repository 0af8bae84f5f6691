"""Where the key/value rings live (avatar_cli/runtime/rings.py): the RingStore allocates them on the device, in host
memory or in a scratch file, takes in a resumed state's, and is the streaming family's only source of scratch memory:
its model files do no file I/O, and its denoising gives the same latents wherever the rings live."""

import ast
from pathlib import Path

import pytest
import torch

from avatar_cli.families.base import RollingState
from avatar_cli.families.wan_s2v import causal
from avatar_cli.runtime.rings import RingStore, mapped_copy
from tests.test_wan_causal import golden, model  # noqa: F401 (fixtures)
from tests.test_wan_live import SAMPLING, family

WAN = Path(__file__).resolve().parents[1] / "avatar_cli" / "families" / "wan_s2v"


def test_a_ring_store_allocates_where_it_says(tmp_path: Path):
    shape = (2, 3, 4)
    on_device = RingStore().zeros(shape, torch.float16, "cpu")
    assert on_device.dtype == torch.float16 and not on_device.any() and on_device.untyped_storage().filename is None
    host = RingStore("host").zeros(shape, torch.float32, "meta")  # host memory, whatever the compute device
    assert host.device.type == "cpu" and host.shape == shape
    disk = RingStore("disk", tmp_path).zeros(shape, torch.bfloat16, "cpu")
    assert disk.shape == shape and disk.dtype == torch.bfloat16 and not disk.any()
    assert Path(disk.untyped_storage().filename).parent == tmp_path  # backed by a scratch file in the folder
    assert not list(tmp_path.iterdir())  # whose name is already gone
    disk += 1  # a shared mapping: written like memory
    assert bool((disk == 1).all())


def test_a_ring_store_adopts_a_resumed_state(tmp_path: Path):
    """A resumed state's tensors stay where they already are (a state read onto the device for rings there, one in
    host memory for rings off it); a ring read onto a GPU goes into the scratch file by mapped_copy."""
    ring = torch.arange(6.0).view(2, 3)
    assert RingStore().adopt(ring) is ring
    assert RingStore("host").adopt(ring) is ring and RingStore("disk", tmp_path).adopt(ring, ring=False) is ring
    copied = mapped_copy(ring, tmp_path)
    assert torch.equal(copied, ring) and copied.untyped_storage().filename is not None
    assert not list(tmp_path.iterdir())


def test_a_ring_store_is_a_cache_key_and_refuses_what_it_cannot_do(tmp_path: Path):
    assert RingStore() == RingStore("device") and len({RingStore(), RingStore("host"), RingStore("host")}) == 2
    assert RingStore("disk", tmp_path) != RingStore("disk", tmp_path / "other")
    with pytest.raises(ValueError, match="need a folder"):
        RingStore("disk")
    with pytest.raises(ValueError, match="one of device, host, disk"):
        RingStore("tape")


@pytest.mark.parametrize("where", ["host", "disk"])
def test_streaming_caches_come_from_the_ring_store(model, golden, tmp_path: Path, where: str):  # noqa: F811
    """Two blocks of the streaming family with its rings off the device: the latents are the device rings' bit for
    bit, and the rings in the state are the store's (disk: backed by a scratch file that leaves no name behind)."""
    ref = {"ref": golden["input.ref"], "motion": golden["input.motion"]}
    store = RingStore(where, tmp_path if where == "disk" else None)

    def run(rings: RingStore) -> tuple[list[torch.Tensor], RollingState]:
        f, state, out = family(), RollingState(), []
        for g in range(2):
            inputs = {"audio": golden[f"clip0.block{g}.audio"], "text": golden["input.context"], "seed": 1, "block": g}
            out.append(f.denoise({"dit": model}, inputs, ref, SAMPLING, state, rings=rings))
        return out, state

    want, _ = run(RingStore())
    got, state = run(store)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    k, v = state.tensors["kv.k"], state.tensors["kv.v"]
    backed = [t.untyped_storage().filename for t in (k, v)]
    assert all(backed) if where == "disk" else not any(backed)
    assert k.device.type == "cpu" and bool(k.abs().amax() > 0)  # written in place, where the store put them
    assert not list(tmp_path.glob(".avatar-rings-*"))


def test_the_streaming_model_files_do_no_file_io():
    """causal.py and dit.py are nn.Module code: no module of theirs reaches the file system (the rings' scratch
    memory comes from runtime/rings.py)."""
    for name in ("causal.py", "dit.py", "layers.py"):
        tree = ast.parse((WAN / name).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {"os", "tempfile", "pathlib", "mmap", "shutil", "io"}, (name, imported)
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "open" not in calls, name
    assert not hasattr(causal, "mapped_zeros")
