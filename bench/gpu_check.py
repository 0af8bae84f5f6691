"""GPU check for a session with a CUDA device (issue 3). NOT RUN YET: written on a machine with no GPU.

One prepared script, under 5 minutes on one GPU; prints one line per figure and a JSON summary:
  1. stage handoff overhead (A2V -> SR -> VAE -> next chunk's A2V), CUDA events, block and model offload,
     with and without the next stage's prefetch;
  2. block offload vs everything resident: time per DiT forward, on a large synthetic DiT;
  3. time to first frame and render fps at 512x512 (the real `render`, in process);
  4. peak GPU memory, a 30 s vs a long render (5 min if the time budget allows, else shorter: printed);
  5. h264_nvenc vs libx264 encode fps at 512x512.
Each section is guarded: a failure prints its error and the rest still run.

    python bench/gpu_check.py [--budget-s 270] [--long-s 300]

Record the results with date, GPU and command in bench/results.md.
"""

import argparse
import json
import sys
import tempfile
import time
import traceback
import wave
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from avatar_cli.models.dit import DiT, DiTParams  # noqa: E402
from avatar_cli.models.family import COMPONENTS, SIZES  # noqa: E402
from avatar_cli.modules.module import random_module  # noqa: E402
from avatar_cli.runtime.offload import BlockOffloader, CudaTransfer, ModelOffloader  # noqa: E402

DEV = torch.device("cuda", 0)
RESULTS: dict[str, object] = {}


def report(key: str, value: object, unit: str = "") -> None:
    RESULTS[key] = value
    print(f"{key}: {value}{(' ' + unit) if unit else ''}", flush=True)


def gpu_ms(fn, repeats: int = 1) -> float:
    """Mean GPU-timeline ms of fn() (CUDA events on the current stream)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


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
    cfg, t = SIZES["mini"], CudaTransfer(DEV)
    models = {n: random_module(n, cls, getattr(cfg, n), 0).model.to(torch.bfloat16) for n, (_, cls) in COMPONENTS.items()}
    x = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16)

    def compute() -> None:
        for _ in range(20):
            x @ x  # ~1 ms each on a recent GPU

    for kind in ("block", "model"):
        for prefetch in (True, False):
            offs = {n: (BlockOffloader(m, t) if kind == "block" and hasattr(m, "blocks") else ModelOffloader(m, t))
                    for n, m in models.items() if n in ("dit", "sr", "vae")}
            order = ["dit", "sr", "vae", "dit"]
            offs["dit"].begin()
            times = []
            for _ in range(20):
                for a, b in zip(order[:-1], order[1:]):
                    if prefetch:
                        offs[b].prefetch()
                    compute()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    h0 = time.perf_counter()
                    offs[a].end()
                    offs[b].begin()
                    host = (time.perf_counter() - h0) * 1e3
                    e1.record()
                    e1.synchronize()
                    times.append((f"{a}->{b}", e0.elapsed_time(e1), host))
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
    p = DiTParams(latent_channels=16, latent_size=64, patch=2, dim=2048, depth=16, heads=16, audio_dim=128,
                  text_dim=128, ref_hi_patch=4)
    model = DiT(p).eval().to(torch.bfloat16)
    args = dit_inputs(p, frames=4)
    off = BlockOffloader(model, CudaTransfer(DEV))
    with off.stage():
        out_streamed = model(*args)  # warm-up
        streamed = gpu_ms(lambda: model(*args), repeats=5)
    off.remove()
    resident_model = model.to(DEV)
    out_resident = resident_model(*args)
    resident = gpu_ms(lambda: resident_model(*args), repeats=5)
    # Same weights, same kernels: any difference means a block ran before its copy landed.
    report("block offload output max |diff| vs resident", float((out_streamed - out_resident).abs().max()))
    report("DiT params (B)", round(sum(x.numel() for x in model.parameters()) / 1e9, 3))
    report("DiT forward resident ms", round(resident, 2))
    report("DiT forward block-offload ms", round(streamed, 2))
    report("block offload overhead %", round(100 * (streamed / resident - 1), 1))


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


def render(seconds: float, work: Path) -> dict:
    from avatar_cli.report import JsonReporter
    from avatar_cli.runner import prepare, render as run_render
    from avatar_cli.spec import load_job

    audio = speech(seconds, work / f"speech_{int(seconds)}.wav")
    job = load_job(ROOT / "sample_inputs" / "job.yaml",
                   [f"audio={audio}", "video.width=512", "video.height=512", "runtime.device=cuda"],
                   output=str(work / f"out_{int(seconds)}.mp4"))
    torch.cuda.reset_peak_memory_stats(DEV)
    with open(work / "events.jsonl", "w") as events:
        summary = run_render(prepare(job, force=True), JsonReporter(events))
    summary["peak_gpu_mb"] = torch.cuda.max_memory_allocated(DEV) / 2**20
    return summary


def renders(long_s: float, deadline: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        short = render(30.0, work)
        report("TTFF s (30 s clip, 512x512)", short["ttff_s"])
        report("render fps (30 s clip, 512x512)", short["render_fps"])
        report("peak GPU MB, 30 s render", round(short["peak_gpu_mb"], 1))
        per_s = short["generate_s"] / 30.0
        fits = (deadline - time.monotonic() - 20) / max(per_s, 1e-6)  # keep 20 s for the encoder check
        long_s = min(long_s, fits)
        if long_s < 60:
            report("peak GPU MB, long render", "skipped (time budget)")
            return
        long = render(long_s, work)
        report(f"peak GPU MB, {long_s:.0f} s render", round(long["peak_gpu_mb"], 1))
        report("peak GPU ratio long / 30 s", round(long["peak_gpu_mb"] / short["peak_gpu_mb"], 3))


def encode_fps() -> None:
    import av

    frames = [np.random.default_rng(i).integers(0, 255, (512, 512, 3), dtype=np.uint8) for i in range(8)]
    for codec in ("h264_nvenc", "libx264"):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                out = av.open(str(Path(tmp) / "x.mp4"), "w")
                s = out.add_stream(codec, rate=25)
                s.width, s.height, s.pix_fmt = 512, 512, "yuv420p"
                n, t0 = 300, time.perf_counter()
                for i in range(n):
                    for pkt in s.encode(av.VideoFrame.from_ndarray(frames[i % 8], format="rgb24")):
                        out.mux(pkt)
                for pkt in s.encode():
                    out.mux(pkt)
                out.close()
                report(f"encode fps {codec} 512x512", round(n / (time.perf_counter() - t0), 1))
            except Exception as e:  # nvenc needs the driver's libnvidia-encode
                report(f"encode fps {codec} 512x512", f"failed: {e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=270.0)
    ap.add_argument("--long-s", type=float, default=300.0)
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    report("GPU", torch.cuda.get_device_name(DEV))
    report("torch", torch.__version__)
    for section in (handoff, offload_overhead, encode_fps, lambda: renders(args.long_s, deadline)):
        if time.monotonic() > deadline:
            print(f"skipped {getattr(section, '__name__', 'renders')}: over budget", flush=True)
            continue
        try:
            section()
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
    print(json.dumps(RESULTS), flush=True)


if __name__ == "__main__":
    main()
