"""Speed and memory checks on one CUDA GPU: one script that prints one line per figure and a JSON summary.

Run it from a checkout with avatar installed (`make setup`, or `pip install -e .`), on a machine with a CUDA GPU:

    python bench/gpu_check.py [--sections LIST] [--budget-s 270] [--long-s 300] [--markdown FILE]

Sections (--sections, comma-separated; the default runs the first four):
  handoff           stage handoff overhead (A2V -> SR -> VAE -> next chunk's A2V), CUDA events, block and model
                    offload, with and without the next stage's prefetch;
  offload_overhead  block offload vs everything resident: time per DiT forward, on a large synthetic DiT, its
                    blocks from pinned copies and from the memory-mapped checkpoint (runtime.offload_host);
  renders           time to first frame and render fps at 512x512 (the real `render`, in process), and peak GPU
                    memory of a 30 s vs a long render (--long-s, shortened to fit --budget-s, skipped if under 60 s);
  encode_fps        h264_nvenc vs libx264 encode fps at 512x512;
  wan               Wan2.2-S2V-14B at full size with random weights (the 16.3 B-parameter DiT in bf16, the fp32
                    VAE; needs about 45 GB of GPU memory), one 480p clip r >= 1 (latent 16x20x56x104, 32,760
                    tokens, audio [1, 25, 1024, 80]): a measured bf16 matmul peak; the DiT forward (warm-up + median
                    of 3, CUDA events), its peak memory, tokens/s and FLOP/s (FLOPs counted on the meta device by
                    bench/wan_budget.py, which also predicts the activation peak); the handoff, GPU idle time from
                    the clip's last Euler step to the first kernel of the VAE decode of its 20 latents; the decode
                    (continuing the timeline, 20 latents -> 80 frames) in fp32, the official dtype, and in bf16; and
                    the fp32 re-encode of the 73 motion frames every clip makes: median of 2 and peak memory.
                    Needs torch only. bench/wan_budget.py predicts these figures on paper;
  decode            runtime.decode worker vs inline: the sample job (mini) at 512x512 and a 30 s clip, 2 renders
                    of each mode alternating: generate s, rtf, TTFF, the decode's seconds and the render process's
                    wait on the worker's queue, peak GPU memory, the worker's peak RSS, and whether the frames match;
  weights           runtime.weights at full size with random weights: the DiT forward of the wan section's clip with
                    its block Linears in bf16, int8 and fp8 (torchao weight-only, as a render quantizes them): the
                    time to quantize them on the GPU, the weights' GPU memory, the forward's median time (of 3,
                    CUDA events) and its error against the bf16 forward (relative L2 and max |diff| of the
                    velocity). Needs about 45 GB of GPU memory;
  live              bench/live_gpu.py: the wan-s2v streaming mode's block forward at 704x384, its fps and TTFF;
  sr                SwiftVR super-resolution (sr.model) at full size with random weights (its 5.0 B-parameter
                    transformer and ReAE built on the meta device, then given storage on the GPU: 10 GB in bf16),
                    704x384 -> 1408x768 and 832x448 -> 1664x896, its transformer's block Linears in bf16 and int8
                    (runtime.weights): the first chunk's time (28 frames in), the stream's fps over the 4 middle
                    chunks that follow (24 frames each, CUDA events), peak memory above the weights against what
                    `avatar plan` counts on meta (avatar_cli/sr/swiftvr/budget.py), and every input frame out;
  live_session      a live session of the sample job on this device (bench/live_latency.py): a WAV on stdin at the
                    speaker's pace, `-o -`: first frame out, latency median and 95th percentile, stalls.
Each section is guarded: a failure prints its error and the rest still run (exit 1 if any failed). --budget-s
bounds the whole run; give `wan` a run of its own.

--markdown writes the figures as a bench/results.md section (date, GPU, torch, command) to paste in.
--smoke runs every section on the CPU at toy sizes (a host copy stands in for the GPU, the wall clock for CUDA
events); the test suite runs it, so that a first GPU run is not also the script's first run. Its figures mean
nothing.
"""

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
import traceback
import wave
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from avatar_cli.families.mini.dit import DiT, DiTParams  # noqa: E402
from avatar_cli.families.mini.config import COMPONENTS, SIZES  # noqa: E402
from avatar_cli.modules.module import random_module  # noqa: E402
from avatar_cli.modules.tensor_files import read_safetensors_header  # noqa: E402
from avatar_cli.runtime.offload import BlockOffloader, MappedCheckpoint, ModelOffloader, make_transfer  # noqa: E402
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT  # noqa: E402
from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAEParams  # noqa: E402
from avatar_cli.families.wan_s2v.family import QUANTIZED  # noqa: E402
from avatar_cli.runtime.quantize import quantize_linears, quantized_bytes  # noqa: E402
from avatar_cli.sr.swiftvr import budget as sr_budget  # noqa: E402
import wan_budget as wb  # noqa: E402  (bench/: the Wan shapes and meta counting shared with the budget)
import live_gpu  # noqa: E402  (bench/: the streaming mode's section)
import live_latency  # noqa: E402  (bench/: the live session's section)

DEV = torch.device("cuda", 0)
SMOKE = False  # --smoke: CPU, toy sizes
RESULTS: dict[str, object] = {}
FAILED: list[str] = []


def report(key: str, value: object, unit: str = "") -> None:
    RESULTS[key] = value
    print(f"{key}: {value}{(' ' + unit) if unit else ''}", flush=True)


def size(gpu: int, smoke: int) -> int:
    return smoke if SMOKE else gpu


def mark() -> object:
    """A point on the compute timeline: a recorded CUDA event on a GPU, the wall clock on the CPU."""
    if DEV.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def ms_between(start: object, end: object) -> float:
    if DEV.type != "cuda":
        return (end - start) * 1e3
    end.synchronize()
    return start.elapsed_time(end)


def gpu_ms(fn, repeats: int = 1) -> float:
    """Mean GPU-timeline ms of fn() (CUDA events on the current stream)."""
    start = mark()
    for _ in range(repeats):
        fn()
    return ms_between(start, mark()) / repeats


def reset_peak() -> None:
    if DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats(DEV)


def peak_mb() -> float:
    return torch.cuda.max_memory_allocated(DEV) / 2**20 if DEV.type == "cuda" else 0.0


def dit_inputs(p: DiTParams, frames: int) -> tuple[torch.Tensor, ...]:
    c, s = p.latent_channels, p.latent_size
    kw = {"device": DEV, "dtype": torch.bfloat16}
    return (torch.randn(1, frames, c, s, s, **kw), torch.rand(1, frames, device=DEV),
            torch.zeros(1, frames, dtype=torch.bool, device=DEV), torch.randn(1, frames, p.audio_dim, **kw),
            torch.randn(1, c, s, s, **kw), torch.randn(1, c, 2 * s, 2 * s, **kw),
            torch.randn(1, 4, p.text_dim, **kw))


@torch.no_grad()
def handoff() -> None:
    """Mini models in pinned host memory: GPU time from a stage's end to the next stage's model being ready.

    Each stage 'computes' ~20 ms of matmuls (the copies must overlap something, as in a render). With
    prefetch (what the pipeline does: `stage(a, then=b)`), b's copy is issued when a starts; without, at
    the handoff itself.
    """
    cfg, t = SIZES["mini"], make_transfer(DEV)
    models = {n: random_module(n, cls, getattr(cfg, n), 0).model.to(torch.bfloat16) for n, (_, cls) in COMPONENTS.items()}
    x = torch.randn(size(4096, 64), size(4096, 64), device=DEV, dtype=torch.bfloat16)

    def compute() -> None:
        for _ in range(20):
            x @ x  # ~1 ms each on a recent GPU
        if DEV.type != "cuda":
            t.wait(t.compute_mark())  # the stand-in lands queued copies only when compute waits

    for kind in ("block", "model"):
        for prefetch in (True, False):
            offs = {n: (BlockOffloader(m, t) if kind == "block" and hasattr(m, "blocks") else ModelOffloader(m, t))
                    for n, m in models.items() if n in ("dit", "sr", "vae")}
            order = ["dit", "sr", "vae", "dit"]
            offs["dit"].begin()
            times = []
            for _ in range(size(20, 2)):
                for a, b in zip(order[:-1], order[1:]):
                    if prefetch:
                        offs[b].prefetch()
                    compute()
                    e0 = mark()
                    h0 = time.perf_counter()
                    offs[a].end()
                    offs[b].begin()
                    host = (time.perf_counter() - h0) * 1e3
                    times.append((f"{a}->{b}", ms_between(e0, mark()), host))
            offs["dit"].end()
            for o in offs.values():
                o.remove()
            tag = "prefetch" if prefetch else "no prefetch"
            for name in ("dit->sr", "sr->vae", "vae->dit"):
                g = sorted(x[1] for x in times if x[0] == name)
                h = sorted(x[2] for x in times if x[0] == name)
                report(f"handoff {name} ({kind} offload, {tag}) GPU ms median/max", f"{g[len(g) // 2]:.3f}/{g[-1]:.3f}")
                report(f"handoff {name} ({kind} offload, {tag}) host ms median", f"{h[len(h) // 2]:.3f}")


@torch.no_grad()
def offload_overhead() -> None:
    """A ~1B-parameter synthetic DiT at 512x512 (64x64 latents): resident vs streamed block by block."""
    p = DiTParams(latent_channels=16, latent_size=size(64, 8), patch=2, dim=size(2048, 64), depth=size(16, 2),
                  heads=size(16, 2), audio_dim=128, text_dim=128, ref_hi_patch=4)
    model = DiT(p).eval().to(torch.bfloat16)
    args = dit_inputs(p, frames=4)
    with tempfile.TemporaryDirectory() as tmp:
        # The same weights as a bf16 safetensors checkpoint: runtime.offload_host: mmap streams the blocks from it
        # (page cache -> pinned staging -> GPU), the file just written, so the page cache holds it.
        path = Path(tmp) / "dit.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        with torch.device("meta"):
            twin = DiT(p).eval().to(torch.bfloat16)
        mapped_off = BlockOffloader(twin, make_transfer(DEV), mapped=MappedCheckpoint(read_safetensors_header(path)),
                                    dtype=torch.bfloat16)
        with mapped_off.stage():
            out_mapped = twin(*args)  # warm-up
            mapped = gpu_ms(lambda: twin(*args), repeats=5)
        mapped_off.remove()
    off = BlockOffloader(model, make_transfer(DEV))
    with off.stage():
        out_streamed = model(*args)  # warm-up
        streamed = gpu_ms(lambda: model(*args), repeats=5)
    off.remove()
    resident_model = model.to(DEV)
    out_resident = resident_model(*args)
    resident = gpu_ms(lambda: resident_model(*args), repeats=5)
    # Same weights, same kernels: any difference means a block ran before its copy landed.
    report("block offload output max |diff| vs resident", float((out_streamed - out_resident).abs().max()))
    report("block offload from mmap output max |diff| vs resident", float((out_mapped - out_resident).abs().max()))
    report("DiT params (B)", round(sum(x.numel() for x in model.parameters()) / 1e9, 3))
    report("DiT forward resident ms", round(resident, 2))
    report("DiT forward block-offload ms", round(streamed, 2))
    report("DiT forward block-offload from mmap ms", round(mapped, 2))
    report("block offload overhead %", round(100 * (streamed / resident - 1), 1))
    report("block offload from mmap overhead %", round(100 * (mapped / resident - 1), 1))


def speech(seconds: float, path: Path) -> Path:
    with wave.open(str(ROOT / "sample_inputs" / "speech.wav")) as w:
        rate, data = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    n = int(seconds * rate)
    reps = np.tile(data, n // data.size + 1)[:n]
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(reps.tobytes())
    return path


def render(seconds: float, work: Path, overrides: tuple[str, ...] = ()) -> dict:
    from avatar_cli.report import JsonReporter
    from avatar_cli.job import resolve
    from avatar_cli.render import render as run_render
    from avatar_cli.spec import load_job

    audio = speech(seconds, work / f"speech_{int(seconds)}.wav")
    side = size(512, 64)
    job = load_job(ROOT / "sample_inputs" / "job.yaml",
                   [f"audio={audio}", f"video.width={side}", f"video.height={side}", f"runtime.device={DEV.type}",
                    *overrides], output=str(work / f"out_{int(seconds)}.mp4"))
    reset_peak()
    with open(work / "events.jsonl", "w") as events:
        summary = run_render(resolve(job, force=True), JsonReporter(events))
    summary["peak_gpu_mb"] = peak_mb()
    return summary


def renders(long_s: float, deadline: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        short_s, side = size(30, 2), size(512, 64)
        long_s = size(long_s, 2 * short_s)
        short = render(short_s, work)
        report(f"TTFF s ({short_s} s clip, {side}x{side})", short["ttff_s"])
        report(f"render fps ({short_s} s clip, {side}x{side})", short["render_fps"])
        report(f"peak GPU MB, {short_s} s render", round(short["peak_gpu_mb"], 1))
        per_s = short["wall_s"] / short_s
        fits = (deadline - time.monotonic()) / max(per_s, 1e-6)
        long_s = min(long_s, fits)
        if long_s < 2 * short_s:
            report("peak GPU MB, long render", "skipped (time budget)")
            return
        long = render(long_s, work)
        report(f"peak GPU MB, {long_s:.0f} s render", round(long["peak_gpu_mb"], 1))
        report(f"peak GPU ratio long / {short_s} s", round(long["peak_gpu_mb"] / max(short["peak_gpu_mb"], 1e-9), 3))


def encode_fps() -> None:
    import av

    side = size(512, 64)
    frames = [np.random.default_rng(i).integers(0, 255, (side, side, 3), dtype=np.uint8) for i in range(8)]
    for codec in ("h264_nvenc", "libx264"):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                out = av.open(str(Path(tmp) / "x.mp4"), "w")
                s = out.add_stream(codec, rate=25)
                s.width, s.height, s.pix_fmt = side, side, "yuv420p"
                n, t0 = size(300, 10), time.perf_counter()
                for i in range(n):
                    for pkt in s.encode(av.VideoFrame.from_ndarray(frames[i % 8], format="rgb24")):
                        out.mux(pkt)
                for pkt in s.encode():
                    out.mux(pkt)
                out.close()
                report(f"encode fps {codec} {side}x{side}", round(n / (time.perf_counter() - t0), 1))
            except Exception as e:  # nvenc needs the driver's libnvidia-encode
                report(f"encode fps {codec} {side}x{side}", f"failed: {e}")


def decode() -> None:
    """7. runtime.decode worker vs inline: the sample job (mini) at 512x512, a 30 s clip, the modes alternating, 2
    each. The worker takes cuda:1 when a second GPU is visible, else shares cuda:0 (then it overlaps the DiT's next
    chunk through the GPU's time slicing between processes, and the encoder's CPU work with both). Peak GPU memory is
    the render process's (torch's allocator); the worker's RSS comes from its own VmHWM."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        seconds = size(30, 1)
        runs: dict[str, list[dict]] = {"inline": [], "worker": []}
        for rep in range(size(2, 1)):
            for mode in ("inline", "worker") if rep % 2 == 0 else ("worker", "inline"):
                runs[mode].append(render(seconds, work, (f"runtime.decode={mode}",)))
        for mode, done in runs.items():
            gen = median([d["generate_s"] for d in done])
            measure(f"decode {mode}", clip_s=seconds, generate_s=round(gen, 3),
                    rtf=round(median([d["rtf"] for d in done]), 3), ttff_s=round(median([d["ttff_s"] for d in done]), 3),
                    decode_s=round(median([d["compute_s"].get("decode", 0.0) for d in done]), 3),
                    wait_s=round(median([d["compute_s"].get("decode_wait", 0.0) for d in done]), 3),
                    peak_gpu_mb=round(max(d["peak_gpu_mb"] for d in done), 1),
                    worker_peak_rss_mb=max((d.get("decode_worker_peak_rss_mb") or 0.0) for d in done) or None,
                    worker_device="cuda:1" if DEV.type == "cuda" and torch.cuda.device_count() > 1 else str(DEV))
        same = len({d["frames_digest"] for done in runs.values() for d in done}) == 1
        report("decode summary", f"generate {RESULTS['decode inline: generate_s']} s inline vs "
                                 f"{RESULTS['decode worker: generate_s']} s worker "
                                 f"(x{RESULTS['decode inline: generate_s'] / RESULTS['decode worker: generate_s']:.2f}), "
                                 f"same frames: {'yes' if same else 'NO'}")


def live_session() -> None:
    """A live session of the sample job on this device, a WAV on stdin at the speaker's pace (bench/live_latency.py)."""
    seconds = size(60, 3)
    r = live_latency.session(seconds, overrides=(f"runtime.device={DEV.type}",))
    report(f"live session ({seconds} s): first frame at the reader s", round(r["first_frame_s"], 3))
    report(f"live session ({seconds} s): latency median s", round(r["latency_median_s"], 3))
    report(f"live session ({seconds} s): latency p95 s", round(r["latency_p95_s"], 3))
    report(f"live session ({seconds} s): stalls", r["stalls"])


def measure(name: str, **fields) -> dict:
    """One JSON line for a measurement; its fields also become figures of the summary and the markdown."""
    print(json.dumps({"measure": name, **fields}), flush=True)
    for k, v in fields.items():
        RESULTS[f"{name}: {k}"] = v
    return fields


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def gb_allocated() -> float:
    return torch.cuda.memory_allocated(DEV) / 1e9 if DEV.type == "cuda" else 0.0


@torch.no_grad()
def matmul_peak_tflops() -> float:
    """bf16 matmul TFLOP/s on this device, best of 3 runs of 20 (8192^3 on a GPU): the yardstick for the DiT."""
    n = size(8192, 128)
    a, b = (torch.randn(n, n, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    gpu_ms(lambda: a @ b, repeats=size(5, 1))  # warm-up: cuBLAS picks its kernel
    best_ms = min(gpu_ms(lambda: a @ b, repeats=size(20, 2)) for _ in range(3))
    return 2 * n ** 3 / (best_ms / 1e3) / 1e12


def marker() -> None:
    """A recognisable event on the compute timeline: a tiny spin kernel on a GPU, a named range on the CPU."""
    if DEV.type == "cuda":
        torch.cuda._sleep(100)  # kernel name: at::cuda::(anonymous namespace)::spin_kernel(long)
    else:
        with torch.profiler.record_function("wan.marker"):
            pass


def timeline(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of the profiled device work: kernels and copies on a GPU, CPU ops on the CPU."""
    kind = torch.autograd.DeviceType.CUDA if DEV.type == "cuda" else torch.autograd.DeviceType.CPU
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == kind),
                  key=lambda e: e[1])


def handoff_gap(events: list[tuple[str, float, float]]) -> dict:
    """From a timeline holding two markers (before and after the Euler step that ends the DiT stage): the Euler
    step's span and the idle time from the second marker to the decode's first kernel. Copies do not count as
    the decode's start: its first ops are two small host-to-device copies that wait for the GPU to drain."""
    marks = [e for e in events if "spin_kernel" in e[0] or e[0] == "wan.marker"]
    if len(marks) < 2:
        raise RuntimeError(f"handoff: {len(marks)} of 2 markers in a timeline of {len(events)} events")
    m1, m2 = marks[0], marks[1]
    after = [e for e in events if e[1] >= m2[2] and e is not m2 and not e[0].startswith(("Memcpy", "Memset"))]
    if not after:
        raise RuntimeError("handoff: no work after the second marker")
    return {"euler_ms": (m2[1] - m1[2]) / 1e3, "gap_ms": (after[0][1] - m2[2]) / 1e3, "first_kernel": after[0][0][:80]}


def wan() -> None:
    """Wan2.2-S2V-14B at full size, random weights, one 480p clip r >= 1 (the docstring's item 6)."""
    flushed = SMOKE and torch.set_flush_denormal(True)  # on the CPU small random weights decay into denormals
    try:
        wan_measure()
    finally:
        if flushed:
            torch.set_flush_denormal(False)


@torch.no_grad()
def wan_measure() -> None:
    p, clip, vp = ((WanDiTParams.tiny(), wb.CLIP_TINY, WanVAEParams.tiny()) if SMOKE
                   else (WanDiTParams.full(), wb.CLIP_480P, WanVAEParams.full()))
    peak = matmul_peak_tflops()
    measure("wan matmul peak", bf16_tflops=float(f"{peak:.4g}"), n=size(8192, 128))

    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32  # bf16 on the CPU is emulated and slow
    tokens, noisy = wb.seq_len(p, clip)
    meta_model = wb.on_meta(WanS2VDiT, p, dtype)
    meta_inputs = wb.dit_inputs(p, clip, "meta")
    flops = wb.dit_flops(meta_model, meta_inputs)["total"]
    predicted = wb.peak_bytes(lambda: meta_model(**meta_inputs))
    del meta_model

    model = wb.random_init(wb.on_meta(WanS2VDiT, p, dtype), DEV, seed=0)
    inputs = wb.dit_inputs(p, clip, DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    weights_gb = gb_allocated()
    v = model(**inputs)  # warm-up
    finite = bool(torch.isfinite(v).all())
    gpu, host, peaks = [], [], []
    for _ in range(size(3, 2)):
        reset_peak()
        base = gb_allocated()
        e0, h0 = mark(), time.perf_counter()
        v = model(**inputs)  # (16, F, h, w) fp32
        host.append((time.perf_counter() - h0) * 1e3)
        gpu.append(ms_between(e0, mark()))
        peaks.append(peak_mb() * 2**20 / 1e9 - base)
    fwd_s = median(gpu) / 1e3
    measure("wan dit forward", clip=f"{clip.pixels[0]}x{clip.pixels[1]} latent {tuple(v.shape)} r>=1",
            tokens=tokens, noisy_tokens=noisy, ms_median=round(median(gpu), 2), ms_all=[round(x, 2) for x in gpu],
            host_ms_median=round(median(host), 2), tokens_per_s=round(tokens / fwd_s, 1),
            flops=flops, flops_source="FlopCounterMode on meta (bench/wan_budget.py dit_flops)",
            formula_flops=wb.formula_flops(p, tokens, noisy, clip.frames),
            tflops=float(f"{flops / fwd_s / 1e12:.4g}"), of_matmul_peak=round(flops / fwd_s / 1e12 / peak, 3),
            weights_gb=round(weights_gb, 2), peak_gb=round(peak_mb() * 2**20 / 1e9, 2),
            peak_above_weights_gb=round(max(peaks), 2), predicted_above_weights_gb=round(predicted / 1e9, 2),
            reserved_gb=round(torch.cuda.max_memory_reserved(DEV) / 1e9, 2) if DEV.type == "cuda" else 0.0,
            output_finite=finite)

    # The handoff as a render does it: the clip's last Euler step (x0 = x_t - sigma * v), then the VAE decode of
    # its 20 latents continuing the timeline, both models resident on this GPU.
    vae = wb.random_init(wb.on_meta(WanVAE, vp, torch.float32), DEV, seed=2)
    z0 = torch.randn(1, vp.z_dim, clip.frames, clip.lat_h, clip.lat_w, device=DEV)  # (1, 16, F, h, w)
    _, cache = vae.decode_stream(z0)  # the clip before: a timeline to continue
    sigma = 0.05
    gaps = []
    for _ in range(size(2, 1)):  # the first also pays the profiler's start-up
        v = model(**inputs)  # returns while the GPU still runs it
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if DEV.type == "cuda"
                                                else torch.profiler.ProfilerActivity.CPU]) as prof:
            marker()
            x0 = inputs["x"] - sigma * v  # (16, F, h, w) fp32
            marker()
            frames, _ = vae.decode_stream(x0[None], cache)  # (1, 3, 4F, 8h, 8w)
            if DEV.type == "cuda":
                torch.cuda.synchronize(DEV)
        try:  # reading the profiler has never run on a GPU: a surprise there must not cost the VAE figures
            gaps.append(handoff_gap(timeline(prof)))
        except Exception as e:
            gaps.append({"gap_ms": float("nan"), "euler_ms": float("nan"), "first_kernel": f"failed: {e}"})
            FAILED.append("wan handoff")
    measure("wan handoff dit->vae", gap_ms=round(gaps[-1]["gap_ms"], 3), gap_ms_first=round(gaps[0]["gap_ms"], 3),
            euler_ms=round(gaps[-1]["euler_ms"], 3), first_kernel=gaps[-1]["first_kernel"],
            frames=int(frames.shape[2]))
    del model, v, inputs
    if DEV.type == "cuda":
        torch.cuda.empty_cache()

    for dtype in (torch.float32, torch.bfloat16):
        if dtype != vae.conv2.weight.dtype:
            vae = vae.to(dtype)
            _, cache = vae.decode_stream(z0)  # a timeline in this dtype to continue (and the warm-up)
        times, peaks = [], []
        for _ in range(size(2, 1)):
            reset_peak()
            base = gb_allocated()
            e0 = mark()
            frames, new_cache = vae.decode_stream(x0[None], cache)  # (1, 3, 4F, 8h, 8w) fp32
            times.append(ms_between(e0, mark()))
            peaks.append(peak_mb() * 2**20 / 1e9 - base)
        name = "fp32" if dtype == torch.float32 else "bf16"
        measure(f"wan vae decode {name}", latents=clip.frames, frames=int(frames.shape[2]),
                ms_median=round(median(times), 1), ms_all=[round(x, 1) for x in times],
                frames_per_s=round(frames.shape[2] / (median(times) / 1e3), 1),
                peak_above_resident_gb=round(max(peaks), 2), cache_gb=round(new_cache.nbytes() / 1e9, 2),
                cudnn_tf32=torch.backends.cudnn.allow_tf32)
        if dtype == torch.float32:  # every clip re-encodes its last 73 frames into the next clip's motion latents
            n = size(73, 5)
            video = torch.rand(1, 3, n, 8 * clip.lat_h, 8 * clip.lat_w, device=DEV) * 2 - 1  # (1, 3, T, H, W)
            vae.encode(video)  # warm-up
            times, peaks = [], []
            for _ in range(size(2, 1)):
                reset_peak()
                base = gb_allocated()
                e0 = mark()
                mu = vae.encode(video)  # (1, 16, 1 + (T - 1) / 4, h, w)
                times.append(ms_between(e0, mark()))
                peaks.append(peak_mb() * 2**20 / 1e9 - base)
            measure("wan vae encode fp32", frames=n, latents=int(mu.shape[2]), ms_median=round(median(times), 1),
                    peak_above_resident_gb=round(max(peaks), 2))
            del video, mu
    report("wan summary", f"DiT forward {median(gpu) / 1e3:.2f} s at {tokens} tokens "
                          f"({RESULTS['wan dit forward: tflops']} TFLOP/s, "
                          f"{RESULTS['wan dit forward: of_matmul_peak']:.0%} of the measured matmul peak), peak "
                          f"{RESULTS['wan dit forward: peak_gb']} GB; handoff {gaps[-1]['gap_ms']:.3f} ms; VAE decode "
                          f"of {clip.frames} latents fp32 {RESULTS['wan vae decode fp32: ms_median'] / 1e3:.2f} s, "
                          f"bf16 {RESULTS['wan vae decode bf16: ms_median'] / 1e3:.2f} s")


@torch.no_grad()
def weights() -> None:
    """runtime.weights: the wan DiT forward with bf16, int8 and fp8 block Linears, speed and error against bf16."""
    p, clip = (WanDiTParams.tiny(), wb.CLIP_TINY) if SMOKE else (WanDiTParams.full(), wb.CLIP_480P)
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32  # bf16 on the CPU is emulated and slow
    paths = dict(QUANTIZED)["dit"]
    inputs = wb.dit_inputs(p, clip, DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    ref = None
    for fmt in ("bf16", "int8", "fp8"):
        # The same random weights for each format (one seed), quantized where they are, as placement does on the host.
        model = wb.random_init(wb.on_meta(WanS2VDiT, p, dtype), DEV, seed=0)
        h0 = time.perf_counter()
        quantize_linears(model, fmt, paths)  # on this device, as a render's load does block by block on a GPU
        if DEV.type == "cuda":
            torch.cuda.synchronize(DEV)
            torch.cuda.empty_cache()
        quantize_s = time.perf_counter() - h0
        weights_gb = gb_allocated()
        v = model(**inputs)  # warm-up; (16, F, h, w) fp32
        times = []
        for _ in range(size(3, 2)):
            e0 = mark()
            v = model(**inputs)
            times.append(ms_between(e0, mark()))
        if ref is None:
            ref = v
        counted = quantized_bytes(wb.on_meta(WanS2VDiT, p, dtype), fmt, paths)
        measure(f"wan weights {fmt}", ms_median=round(median(times), 2), ms_all=[round(x, 2) for x in times],
                weights_gb=round(weights_gb, 2), counted_bytes=counted, quantize_s=round(quantize_s, 2),
                rel_l2_vs_bf16=float(f"{((v - ref).norm() / ref.norm()).item():.3g}"),
                max_abs_vs_bf16=float(f"{(v - ref).abs().max().item():.3g}"),
                speed_vs_bf16=round(RESULTS.get("wan weights bf16: ms_median", median(times)) / median(times), 3),
                output_finite=bool(torch.isfinite(v).all()))
        del model, v
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    report("weights summary", ", ".join(
        f"{f} {RESULTS[f'wan weights {f}: ms_median'] / 1e3:.2f} s/forward, {RESULTS[f'wan weights {f}: weights_gb']} GB"
        + (f", rel L2 {RESULTS[f'wan weights {f}: rel_l2_vs_bf16']}" if f != "bf16" else "")
        for f in ("bf16", "int8", "fp8")))


SR_SIZES = ((704, 384), (832, 448))  # (width, height) in: the streaming mode's size and the clip mode's, x2 out
SR_SIZES_SMOKE = ((64, 32), (96, 48))


def sr_models(directory: Path | None, dtype: torch.dtype, seed: int):
    """SwiftVR with random weights on DEV: built on the meta device at the release's size (directory None) or at a
    directory's (--smoke: the tiny one `avatar models init --family swiftvr` writes), as `avatar plan` counts it,
    then given storage on DEV, every parameter drawn from one seeded generator."""
    from avatar_cli.sr.swiftvr import stream

    m = sr_budget.on_meta(sr_budget.sizes(directory), dtype)
    return stream.SRModels(reae=wb.random_init(m.reae, DEV, seed), dit=wb.random_init(m.dit, DEV, seed + 1),
                           prompt=torch.randn(m.prompt.shape, generator=torch.Generator().manual_seed(seed + 2)
                                              ).to(DEV, dtype))


@torch.no_grad()
def sr() -> None:
    """SwiftVR at full size: per runtime.weights format and input size, the first chunk, the middle chunks' fps,
    peak memory against the plan's count, and every frame out."""
    from avatar_cli.sr.swiftvr import model_dir

    with tempfile.TemporaryDirectory() as tmp:
        directory = None
        if SMOKE:
            directory = Path(tmp) / "sr"
            model_dir.init_tiny(directory, seed=0)
        for fmt in ("bf16", "int8"):
            sr_format(directory, fmt)


def sr_format(directory: Path | None, fmt: str) -> None:
    from avatar_cli.sr.swiftvr import stream

    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32  # bf16 on the CPU is emulated and slow
    first_n, group = sr_budget.FIRST_FRAMES, sr_budget.GROUP_FRAMES
    frames = first_n + size(4, 1) * group + 5  # the first chunk, the middle chunks timed, a last chunk of 5
    models = sr_models(directory, dtype, seed=0)
    quantize_linears(models.dit, fmt, sr_budget.QUANTIZED)  # on this device, as a render's load does
    weights_gb = gb_allocated()
    for w, h in SR_SIZES_SMOKE if SMOKE else SR_SIZES:
        lq = torch.rand(frames, 3, h, w, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)  # (T, 3, h, w)
        s = stream.SRStream(models, (h, w), 2, DEV, dtype)
        reset_peak()
        base = gb_allocated()
        e0 = mark()
        first = s.push(lq[:first_n + 1])  # one frame more: the first chunk is not the last
        e1 = mark()
        middle = s.push(lq[first_n + 1:frames - 4])  # each middle chunk once the frame after it shows it is one
        e2 = mark()
        rest = torch.cat([s.push(lq[frames - 4:]), s.finish()])
        peak = peak_mb() * 2**20 / 1e9 - base
        out_h, out_w = s.out_hw
        middle_ms = ms_between(e1, e2)
        counted = sr_budget.sr_budget(directory, (w, h), 2, dtype, fmt)
        measure(f"sr {fmt} {w}x{h}->{out_w}x{out_h}", first_chunk_ms=round(ms_between(e0, e1), 1),
                first_frames_out=int(first.shape[0]), middle_frames_out=int(middle.shape[0]),
                fps=round(middle.shape[0] / (middle_ms / 1e3), 2), middle_ms=round(middle_ms, 1),
                frames_in=frames, frames_out=int(first.shape[0] + middle.shape[0] + rest.shape[0]),
                out_shape=list(first.shape[1:]), weights_gb=round(weights_gb, 2),
                counted_weights_gb=round(sum(m.total for m in counted.models.values()) / 1e9, 2),
                peak_above_weights_gb=round(peak, 2), predicted_above_weights_gb=round(counted.peak / 1e9, 2),
                output_finite=bool(torch.isfinite(first).all() and torch.isfinite(middle).all()))
        del s, first, middle, rest, lq
    del models
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    report(f"sr {fmt} summary", ", ".join(f"{k.removeprefix('sr ').removesuffix(': fps')} {v} fps"
                                          for k, v in RESULTS.items() if k.startswith(f"sr {fmt} ")
                                          and k.endswith(": fps")))


def markdown(command: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cell = lambda x: str(x).replace("|", "\\|")  # noqa: E731  ("max |diff|" must not split a row)
    rows = "\n".join(f"| {cell(k)} | {cell(v)} |" for k, v in RESULTS.items() if k not in ("GPU", "torch"))
    failed = f"\n\nFailed sections: {', '.join(FAILED)} (tracebacks in the run's output)" if FAILED else ""
    return (f"## GPU check, {now}\n\n- machine: {RESULTS.get('GPU')}; torch {RESULTS.get('torch')}\n"
            f"- command: `{command}`\n\n| measure | value |\n| --- | --- |\n{rows}{failed}\n")


DEFAULT_SECTIONS = ("handoff", "offload_overhead", "encode_fps", "renders")
ALL_SECTIONS = (*DEFAULT_SECTIONS, "wan", "weights", "decode", "live", "live_session", "sr")


def main() -> int:
    global DEV, SMOKE
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=270.0)
    ap.add_argument("--long-s", type=float, default=300.0)
    ap.add_argument("--markdown", type=Path, help="write the figures as a bench/results.md section here")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes: checks the script runs; figures mean nothing")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated, from {', '.join(ALL_SECTIONS)} (default: all but wan)")
    args = ap.parse_args()
    chosen = [x for x in args.sections.split(",") if x]
    unknown = [x for x in chosen if x not in ALL_SECTIONS]
    if unknown or not chosen:
        ap.error(f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(ALL_SECTIONS)}")
    if args.smoke:
        DEV, SMOKE = torch.device("cpu"), True
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --smoke to try the script on the CPU)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    report("GPU", torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "none (smoke run on the CPU)")
    report("torch", torch.__version__)
    sections = {"handoff": handoff, "offload_overhead": offload_overhead, "encode_fps": encode_fps,
                "renders": lambda: renders(args.long_s, deadline), "wan": wan, "weights": weights, "decode": decode,
                "live": lambda: live_gpu.live(sys.modules[__name__]), "live_session": live_session, "sr": sr}
    for name in chosen:
        section = sections[name]
        if time.monotonic() > deadline:
            print(f"skipped {name}: over budget", flush=True)
            FAILED.append(f"{name} (over budget)")
            continue
        try:
            section()
        except Exception:
            traceback.print_exc()
            FAILED.append(name)
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(RESULTS), flush=True)
    if args.markdown:
        args.markdown.write_text(markdown(shlex.join(["python", "bench/gpu_check.py", *sys.argv[1:]])))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
