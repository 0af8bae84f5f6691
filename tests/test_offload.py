"""The block offloader's state machine, with the CPU standing in for the GPU (HostTransfer); NUMA placement
(which precedes any pinned allocation) through a fake sysfs tree."""

import copy
import dataclasses
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from avatar_cli.families.mini.dit import DiT
from avatar_cli.families.mini.config import SIZES
from avatar_cli.families.mini.text import TextEncoder
from avatar_cli.families.base import ParallelPlan
from avatar_cli.runtime import numa
from avatar_cli.runtime.budget import ModelBytes
from avatar_cli.runtime.placement import Placement, choose_layout
from avatar_cli.modules.tensor_files import read_safetensors_header
from avatar_cli.runtime.offload import ALIGN, BlockOffloader, HostTransfer, MappedCheckpoint, ModelOffloader

DEPTH = 4  # more blocks than buffers, so blocks really stream through the double buffer


def _dit() -> DiT:
    g = torch.Generator().manual_seed(0)
    model = DiT(dataclasses.replace(SIZES["tiny"].dit, depth=DEPTH)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)  # non-zero gates: every block matters
    return model


def _inputs(frames: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    p = SIZES["tiny"].dit
    c, s = p.latent_channels, p.latent_size
    return (torch.randn(1, frames, c, s, s, generator=g), torch.rand(1, frames, generator=g),
            torch.zeros(1, frames, dtype=torch.bool), torch.randn(1, frames, p.audio_dim, generator=g),
            torch.randn(1, c, s, s, generator=g), torch.randn(1, c, 2 * s, 2 * s, generator=g),
            torch.randn(1, 2, p.text_dim, generator=g))


def _padded(params) -> int:
    return sum(-(-p.nbytes // ALIGN) * ALIGN for p in params)


@torch.no_grad()
def test_block_offload_state_machine_and_outputs():
    plain = _dit()
    model = copy.deepcopy(plain)
    t = HostTransfer()
    off = BlockOffloader(model, t)
    host_ptrs = [p.data_ptr() for p in model.parameters()]
    assert not any(t.is_device(p) for p in model.parameters())

    seen: list[int] = []

    def check(i: int):
        def hook(block, _args):
            # This block's parameters are on the device when it runs; at most 2 blocks ever are.
            assert all(t.is_device(p) for p in block.parameters()), f"block {i} not loaded"
            assert all(t.is_device(p) for p in model.final.parameters())  # non-block params too
            on_device = [j for j in range(DEPTH) if any(t.is_device(p) for p in model.blocks[j].parameters())]
            assert i in on_device and len(on_device) <= 2, on_device
            for j in on_device:  # and each points at its own weights, not a buffer refilled for another block
                for p, q in zip(model.blocks[j].parameters(), plain.blocks[j].parameters()):
                    assert torch.equal(p, q), f"block {j} sees stale or foreign weights while block {i} runs"
            seen.append(i)
        return hook

    # Registered after the offloader's hooks, so they run after its swap.
    for i, b in enumerate(model.blocks):
        b.register_forward_pre_hook(check(i))

    args = _inputs()
    with off.stage():
        outs = [model(*args) for _ in range(2)]  # two denoising steps of one stage
    assert seen == list(range(DEPTH)) * 2
    for out in outs:
        assert torch.equal(out, plain(*args))

    # Loads in block order: root, then blocks 0..3 each step; the last block prefetches block 0.
    assert t.loads == ["root"] + [f"block {i}" for i in list(range(DEPTH)) * 2] + ["block 0"]

    # After the stage: nothing on the device, every parameter back on its original host slab (no copy back).
    assert not any(t.is_device(p) for p in model.parameters())
    assert [p.data_ptr() for p in model.parameters()] == host_ptrs
    assert t.live_bytes == 0

    # Peak device bytes: the non-block parameters plus two (largest) blocks, never more.
    block_ids = {id(p) for b in model.blocks for p in b.parameters()}
    root = _padded(p for p in model.parameters() if id(p) not in block_ids)
    largest = max(_padded(b.parameters()) for b in model.blocks)
    assert t.peak_bytes <= root + 2 * largest
    assert t.peak_bytes < _padded(model.parameters())  # less than the whole model resident

    # A second stage starts by itself at the first forward, and gives the same result.
    out = model(*args)
    assert off.active and torch.equal(out, outs[0])
    off.end()
    assert not any(t.is_device(p) for p in model.parameters())


def _mapped_dit(tmp_path: Path, file_dtype: torch.dtype, compute: torch.dtype):
    """The test DiT saved as a safetensors checkpoint in file_dtype, a twin built on meta, and that twin block-
    offloaded from the memory-mapped file (the mmap host tier), computing in `compute`."""
    plain = _dit()
    path = tmp_path / "dit.safetensors"
    save_file({k: v.to(file_dtype).contiguous() for k, v in plain.state_dict().items()}, str(path))
    with torch.device("meta"):
        twin = DiT(dataclasses.replace(SIZES["tiny"].dit, depth=DEPTH)).eval()
    t = HostTransfer()
    mapped = MappedCheckpoint(read_safetensors_header(path))
    return plain.to(file_dtype).to(compute), twin, t, BlockOffloader(twin, t, mapped=mapped, dtype=compute)


@torch.no_grad()
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_block_offload_from_the_memory_mapped_checkpoint(tmp_path: Path, file_dtype: torch.dtype):
    """The mmap host tier: the blocks stay in the file (no host copy: between stages a block's parameters are meta
    placeholders), are staged block by block through two pinned buffers, cast from the file's dtype to the compute
    dtype (bf16 on disk, float32 compute here), and the forwards equal the resident model's exactly."""
    plain, model, t, off = _mapped_dit(tmp_path, file_dtype, torch.float32)
    # no block has a host copy: each parameter a placeholder of its shape and dtype (one NaN, broadcast)
    placeholders = [p for b in model.blocks for p in b.parameters()]
    assert all(p.dtype == torch.float32 and p.untyped_storage().nbytes() == 4 for p in placeholders)
    block_ids = {id(p) for b in model.blocks for p in b.parameters()}
    assert not any(p.device.type == "meta" for p in model.parameters() if id(p) not in block_ids)  # the root: read
    args = _inputs()
    with off.stage():
        outs = [model(*args) for _ in range(2)]  # two denoising steps: the staging pair refills around the ring
    for out in outs:
        assert torch.equal(out, plain(*args))
    assert t.loads == ["root"] + [f"block {i}" for i in list(range(DEPTH)) * 2] + ["block 0"]
    assert t.live_bytes == 0 and all(p.untyped_storage().nbytes() == 4 for p in placeholders)
    # Host memory: the root's slab and the staging pair, not the blocks (the pinned tier holds every block).
    largest = max(g.nbytes for g in off.blocks)
    assert off.host_bytes == off.root.slab.numel() + 2 * largest
    assert off.host_bytes < _padded(plain.parameters()) * 0.8
    assert torch.equal(model(*args), outs[0])  # a second stage, started by the first forward
    off.end()


@torch.no_grad()
def test_mmap_staging_waits_for_the_copy_out_before_refilling(tmp_path: Path):
    """A staging buffer is refilled for block i+2 only once block i's copy out of it has landed: a refill before
    that would put block i+2's weights where block i's copy still reads (HostTransfer lands copies late)."""
    _, model, t, off = _mapped_dit(tmp_path, torch.float32, torch.float32)
    waits = []
    host_wait = t.host_wait
    t.host_wait = lambda e: (waits.append(e), host_wait(e))
    with off.stage():
        model(*_inputs())
    # 5 blocks staged after the first two (blocks 2, 3 and block 0 again): each waited on its buffer's last copy
    assert len(waits) == DEPTH - 1 and waits == sorted(waits)


@torch.no_grad()
def test_block_offload_brings_in_the_blocks_the_streaming_forward_calls():
    """The wan-s2v streaming forward (causal.py) calls each of its blocks, with per-row arguments by keyword: the
    offloader's forward pre-hooks bring every block in before it runs, in order, and the latents equal the resident
    model's. No class is changed: `blocks` is a plain ModuleList throughout, and after remove()."""
    from avatar_cli.families.wan_s2v import causal
    from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT

    torch.manual_seed(0)
    plain = WanS2VDiT(WanDiTParams.tiny()).eval()
    model = copy.deepcopy(plain)
    t = HostTransfer()
    off = BlockOffloader(model, t)
    assert type(model.blocks) is torch.nn.ModuleList
    ran: list[tuple[int, bool]] = []  # (block, all its parameters on the device when it ran)
    for i, b in enumerate(model.blocks):  # registered after the offloader's: they run after its swap
        b.register_forward_pre_hook(lambda blk, _args, i=i: ran.append((i, all(t.is_device(p)
                                                                              for p in blk.parameters()))))
    p, H, W = plain.params, 8, 16
    g = torch.Generator().manual_seed(1)
    ref, motion = torch.randn(16, 1, H, W, generator=g), torch.randn(16, 19, H, W, generator=g)
    ctx, noise = torch.randn(5, p.text_dim, generator=g), torch.randn(16, 3, H, W, generator=g)
    audio = torch.randn(1, 25, p.audio_dim, 12, generator=g)

    def stream(m: WanS2VDiT) -> torch.Tensor:
        caches = causal.CausalCaches.empty(p, H, W, steps=2)
        causal.prefill_sink(m, caches, ref, motion, ctx)
        return causal.stream_block(m, caches, noise, 0, ctx, audio, 4)  # (16, 3, h, w)

    with off.stage():
        got = stream(model)
        assert type(model.blocks) is torch.nn.ModuleList
    assert torch.equal(got, stream(plain))
    layers = list(range(p.num_layers))
    assert ran == [(i, True) for i in layers * 3]  # the prefill, then 2 steps: every block called, on the device
    assert [label for label in t.loads if label != "root"] == [f"block {i}" for i in layers * 3] + ["block 0"]
    off.remove()
    assert type(model.blocks) is torch.nn.ModuleList and t.live_bytes == 0


@torch.no_grad()
def test_block_offload_text_encoder_and_remove():
    text = TextEncoder(SIZES["tiny"].text).eval()
    plain = copy.deepcopy(text)
    t = HostTransfer()
    off = BlockOffloader(text, t)
    ids = torch.tensor([[1, 2, 3]])
    with off.stage():
        assert torch.equal(text(ids), plain(ids))
    off.remove()
    assert torch.equal(text(ids), plain(ids))  # no hooks left: plain host parameters
    assert not off.active and t.loads == ["root", "block 0"]  # depth 1: nothing to prefetch


@torch.no_grad()
def test_model_offload_holds_whole_model_only_during_stage():
    plain = _dit()
    model = copy.deepcopy(plain)
    t = HostTransfer()
    off = ModelOffloader(model, t)
    args = _inputs()
    out = model(*args)  # starts the stage by itself
    assert all(t.is_device(p) for p in model.parameters())
    assert torch.equal(out, plain(*args))
    off.end()
    assert not any(t.is_device(p) for p in model.parameters()) and t.live_bytes == 0
    assert t.peak_bytes == _padded(model.parameters())


@torch.no_grad()
def test_a_stage_prefetches_the_next_stage_model_so_the_handoff_waits_for_no_copy():
    plain = _dit()
    a, b = copy.deepcopy(plain), copy.deepcopy(plain)
    t = HostTransfer()
    placement = Placement(offloaders={"a": ModelOffloader(a, t, name="a"), "b": BlockOffloader(b, t, name="b")})
    args = _inputs()
    with placement.stage("a", then="b"):
        assert t.loads == ["a: model", "b: root", "b: block 0"]  # b's copy is on its way while a computes
        assert not any(t.is_device(p) for p in b.parameters())  # on its way, not yet in use
        a(*args)
    issued = len(t.loads)
    with placement.stage("b", then="a"):
        assert t.loads[issued:issued + 1] == ["a: model"]  # b's begin issued no copy of its own: prefetched
        assert torch.equal(b(*args), plain(*args))
    assert t.live_bytes > 0  # a's prefetch is still on the device ...
    placement.release()
    assert t.live_bytes == 0 and not any(t.is_device(p) for m in (a, b) for p in m.parameters())  # ... until released


def test_offload_keeps_channels_last_weights_channels_last():
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 1)).to(memory_format=torch.channels_last)
    x = torch.randn(1, 3, 9, 9).to(memory_format=torch.channels_last)
    want = conv(x)
    t = HostTransfer()
    with ModelOffloader(conv, t).stage():
        assert all(t.is_device(p) for p in conv.parameters())
        assert conv[0].weight.is_contiguous(memory_format=torch.channels_last)
        assert not conv[0].weight.is_contiguous()
        assert torch.equal(conv(x), want)
    assert conv[1].weight.is_contiguous(memory_format=torch.channels_last)  # the host view too


def test_offload_rejects_modules_with_buffers():
    m = torch.nn.Module()
    m.blocks = torch.nn.ModuleList([torch.nn.BatchNorm1d(4)])
    with pytest.raises(ValueError, match="buffers"):
        BlockOffloader(m, HostTransfer())


def test_choose_layout_offload_decides_from_free_memory():
    gib = 2**30
    sizes = {"dit": ModelBytes(28 * gib, "bfloat16"), "sr": ModelBytes(4 * gib, "bfloat16"),
             "vae": ModelBytes(1 * gib, "bfloat16")}

    def layout(policy, free, working=0):
        return choose_layout(sizes, ParallelPlan(), 1, free, working, offload=policy)

    assert layout("auto", 70 * gib, 8 * gib).offload == "none"
    assert layout("auto", 40 * gib, 8 * gib).offload == "model"
    # The DiT alone would fit in 37, but not beside the SR it prefetches for the next stage.
    assert layout("auto", 37 * gib, 8 * gib).offload == "block"
    low = layout("auto", 20 * gib, 8 * gib)
    assert low.offload == "block"
    assert "auto chose block" in low.offload_why and "free 20.00 GiB" in low.offload_why
    forced = layout("block", 80 * gib)
    assert forced.offload == "block" and "set by runtime.offload" in forced.offload_why


# NUMA placement

def _sysfs(root: Path, address: str, node: str, cpulists: dict[int, str]) -> Path:
    dev = root / "bus/pci/devices" / address
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(node + "\n")
    for n, text in cpulists.items():
        d = root / f"devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(text + "\n")
    return root


@pytest.mark.parametrize("text, cpus", [("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}), ("", set()),
                                        ("0-1\n", {0, 1})])
def test_parse_cpulist(text, cpus):
    assert numa.parse_cpulist(text) == cpus


def test_pci_address_matches_sysfs_spelling():
    assert numa.pci_address(0, 0x3B, 0) == "0000:3b:00.0"
    assert numa.pci_address(1, 0xC1, 0x1F) == "0001:c1:1f.0"


def test_numa_node_lookup(tmp_path):
    root = _sysfs(tmp_path, "0000:3b:00.0", "1", {0: "0-7", 1: "8-15"})
    assert numa.numa_node("0000:3b:00.0", root) == 1
    assert numa.node_cpus(1, root) == set(range(8, 16))
    assert numa.numa_node("0000:99:00.0", root) is None  # unknown device
    assert numa.node_cpus(5, root) == set()


def test_minus_one_means_node_zero(tmp_path):
    root = _sysfs(tmp_path, "0000:01:00.0", "-1", {0: "0-1"})
    assert numa.numa_node("0000:01:00.0", root) == 0


def test_bind_uses_device_properties_and_sets_affinity(tmp_path, monkeypatch):
    mine = sorted(os.sched_getaffinity(0))
    root = _sysfs(tmp_path, "0000:3b:00.0", "1", {1: f"{mine[0]},100000"})  # a CPU we may not use is dropped
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, set(cpus))))
    assert numa.bind_to_gpu_node(torch.device("cuda", 0), root) == {mine[0]}
    assert calls == [(0, {mine[0]})]


def test_unknown_node_changes_nothing_and_logs_one_line(tmp_path, monkeypatch, caplog):
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: pytest.fail("affinity changed"))
    with caplog.at_level("INFO", logger="avatar_cli.runtime.numa"):
        assert numa.bind_to_gpu_node(torch.device("cuda", 0), tmp_path) is None
    assert len(caplog.records) == 1 and "unknown" in caplog.text
    assert numa.bind_to_gpu_node(torch.device("cpu")) is None


def test_gpu_check_script_runs_every_section_on_the_cpu_stand_in(tmp_path):
    """bench/gpu_check.py waits for a session with a GPU: its smoke run takes every code path but CUDA's,
    so the one lent run is not spent on a typo. Offloaded output must equal resident output exactly."""
    import json
    import subprocess
    import sys

    script = Path(__file__).parent.parent / "bench" / "gpu_check.py"
    md = tmp_path / "gpu_check.md"
    run = subprocess.run([sys.executable, str(script), "--smoke", "--markdown", str(md)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stdout + run.stderr
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    for kind in ("block", "model"):
        for tag in ("prefetch", "no prefetch"):
            for hop in ("dit->sr", "sr->vae", "vae->dit"):
                assert f"handoff {hop} ({kind} offload, {tag}) GPU ms median/max" in figures
    assert figures["block offload output max |diff| vs resident"] == 0.0
    assert figures["DiT forward block-offload ms"] > 0 and figures["DiT forward resident ms"] > 0
    assert figures["encode fps libx264 64x64"] > 0
    assert figures["render fps (2 s clip, 64x64)"] > 0 and figures["TTFF s (2 s clip, 64x64)"] > 0
    assert "peak GPU ratio long / 2 s" in figures
    text = md.read_text()
    assert text.startswith("## GPU check, ") and "- command: `python bench/gpu_check.py --smoke" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + len(figures) - 2  # header, rule, a row per figure (GPU and torch head the section)
    assert all(line.replace("\\|", "").count("|") == 3 for line in rows)  # two cells, whatever the key holds


def test_gpu_check_without_a_gpu_says_so_and_exits_2():
    import subprocess
    import sys

    script = Path(__file__).parent.parent / "bench" / "gpu_check.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA device" in run.stderr and "Traceback" not in run.stderr


def test_a_gpu_rank_binds_to_its_node_before_joining_the_process_group(monkeypatch):
    """NCCL's eager init allocates pinned host memory: the NUMA binding must come first, for LOCAL_RANK's GPU."""
    from avatar_cli.render import setup as render_setup
    from avatar_cli.errors import InputError
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.spec import load_job

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(render_setup, "resolve_runtime", lambda *_: Runtime(torch.device("cuda"), torch.bfloat16))
    monkeypatch.setattr(render_setup, "launched_by_torchrun", lambda: True)
    monkeypatch.setattr(render_setup, "bind_to_gpu_node", lambda device: calls.append(("bind", str(device))) or {0})
    monkeypatch.setattr(render_setup, "current_dist", lambda kind: calls.append(("dist", kind)) or Dist())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    threads = torch.get_num_threads()
    spec = load_job(Path(__file__).parent.parent / "sample_inputs" / "job.yaml").spec
    try:
        runtime, _ = render_setup.setup_runtime(spec)
        assert calls == [("bind", "cuda:1"), ("dist", "cuda")] and runtime.device == torch.device("cuda", 1)
        assert torch.get_num_threads() == 1  # no more threads than the node's CPUs we may use
    finally:
        torch.set_num_threads(threads)
    # More workers than GPUs (--nproc 8 on a 1-GPU host): a one-line input error, before any GPU call.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InputError, match="local rank 1 but only 1 GPU"):
        render_setup.setup_runtime(spec)


@pytest.mark.parametrize("mode", ["clip", "streaming"])
def test_wan_render_streaming_blocks_from_the_mapped_checkpoint_equals_the_resident_one(tmp_path: Path, caplog,
                                                                                         mode: str):
    """A tiny wan-s2v render (the official layout; its DiT read lazily from safetensors) with runtime.offload: block
    and runtime.offload_host: mmap, the CPU standing in for the GPU: the DiT's blocks come from the memory-mapped
    checkpoint, one after another, and the frames are the resident render's. In both modes: the streaming forward
    calls each block too, so the offloader's hooks bring it in (a block not brought in would compute on its NaN
    placeholders)."""
    from avatar_cli import render as rendering
    from avatar_cli.job import resolve
    from avatar_cli.families.registry import init_family_dir
    from avatar_cli.report import QuietReporter
    from avatar_cli.spec import load_job
    from tests.conftest import write_reference, write_wav

    model = tmp_path / "wan"
    init_family_dir(model, "tiny", seed=0, family="wan-s2v")
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 1.0)
    (tmp_path / "job.yaml").write_text(
        f"reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: {model}\nseed: 3\nmode: {mode}\n"
        "video: {width: 64, height: 64}\n" + ("sampling: {steps: 2}\n" if mode == "clip" else ""))

    def render(name: str, *overrides: str, transfer=None, free=None):
        job = load_job(tmp_path / "job.yaml", ["runtime.dtype=float32", "runtime.text_cache=off", *overrides],
                       output=str(tmp_path / f"{name}.mp4"))
        cache = rendering.ModelCache(transfer=transfer, free_bytes=free)
        return rendering.render(resolve(job), QuietReporter(0), models=cache), cache

    plain, _ = render("plain")
    t = HostTransfer()
    with caplog.at_level(logging.INFO, logger="avatar_cli"):
        mapped, cache = render("mapped", "runtime.offload=block", "runtime.offload_host=mmap", transfer=t, free=1)
    assert mapped["frames_digest"] == plain["frames_digest"]
    (_, placement), = cache.loaded.values()
    dit = placement.offloaders["dit"]
    assert dit.mapped is not None and dit.host_bytes == dit.root.slab.numel() + 2 * dit.block_bytes
    assert placement.offloaders["text"].mapped is None  # umT5 comes from a .pth: its blocks wait pinned
    assert "offload host: mmap (set by runtime.offload_host)" in caplog.text
    # the layout kept free what `avatar plan` counts on meta for this job (runtime.shard: auto reads it)
    assert "kept free for state and activations (counted on the meta device)" in caplog.text
    dit_loads = [label for label in t.loads if label.startswith("dit: block")]
    assert t.live_bytes == 0 and dit_loads[:4] == ["dit: block 0", "dit: block 1", "dit: block 2", "dit: block 0"]


@torch.no_grad()
def test_mmap_tier_merges_a_lora_into_each_block_as_it_lands(tmp_path: Path):
    """A LoRA'd DiT (the streaming mode's) from the memory-mapped base checkpoint: the root's targets merged once on
    the host, each block's on the "device" each time its copy lands; two forwards (the blocks stream through twice)
    equal the forward of the weights merged once at load, bit for bit, and the file is left as it was."""
    from avatar_cli.families.registry import init_family_dir, load_modules, resolve_model, with_lora
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.runtime.placement import place
    from tests.test_wan_lora_render import RANK, SCALE, lora_factors

    base, lora = tmp_path / "wan", tmp_path / "lora.safetensors"
    init_family_dir(base, "tiny", seed=0, family="wan-s2v")
    save_file(lora_factors(), str(lora))
    source = with_lora(resolve_model(str(base), tmp_path), lora, RANK, SCALE)
    rt = Runtime(torch.device("cpu"), torch.float32)
    merged = load_modules(source)["dit"]
    place({"dit": merged}, rt, Dist())  # read whole, merged once
    dit = load_modules(source)["dit"]
    t = HostTransfer()
    placement = place({"dit": dit}, rt, Dist(), "block", transfer=t, free_bytes=1, offload_host="mmap")
    off = placement.offloaders["dit"]
    assert off.mapped is not None and dit.after_load is None and len(off._merges) == len(dit.model.blocks)
    fresh = MappedCheckpoint(dit.index.tensors)
    before = {k: fresh.tensor(k).clone() for k in dit.index.tensors}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import wan_budget as wb
    finally:
        sys.path.pop(0)
    args = wb.dit_inputs(dit.model.params, wb.CLIP_TINY, "cpu", torch.Generator().manual_seed(0))
    with off.stage():
        outs = [dit.model(**args) for _ in range(2)]
    want = merged.model(**args)
    assert all(torch.equal(o, want) for o in outs) and not torch.equal(want, dit_without_lora(base, args))
    after = MappedCheckpoint(dit.index.tensors)
    assert all(torch.equal(after.tensor(k), v) for k, v in before.items())  # the file holds the base weights


def dit_without_lora(base: Path, args: dict) -> torch.Tensor:
    from avatar_cli.families.registry import load_modules, resolve_model
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.runtime.placement import place

    plain = load_modules(resolve_model(str(base), base.parent))["dit"]
    place({"dit": plain}, Runtime(torch.device("cpu"), torch.float32), Dist())
    return plain.model(**args)
