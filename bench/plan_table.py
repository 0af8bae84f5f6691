"""The README's "What runs where" table: `avatar plan` for Wan2.2-S2V-14B (named by size, no weights) on four
machines, in the clip mode at 832x448 and the streaming mode at 704x384, with the job's defaults otherwise; its last
column the same job with SwiftVR x2 super-resolution (`sr.model: swiftvr`, the release's size) on the same machine.

    python bench/plan_table.py [KEY=VALUE ...]     # e.g. runtime.weights=int8 runtime.vae_dtype=bfloat16

Seconds on a CPU (every model counted on the meta device once). Prints a Markdown table.
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from avatar_cli.plan import GB, machine, make_plan  # noqa: E402
from avatar_cli.spec import load_job  # noqa: E402

MACHINES = [("1x24GB", "32GB"), ("1x48GB", "64GB"), ("5x24GB", "128GB"), ("8x80GB", "1024GB")]
MODES = [("clip", ["video.width=832", "video.height=448"]),
         ("streaming", ["mode=streaming", "video.width=704", "video.height=384"])]


def table(extra: list[str]) -> list[str]:
    """The table's lines (docs/plan.md carries them; tests/test_plan.py checks it still does)."""
    lines = ["| machine | mode | split | DiT | offload | decode | per GPU | host | speed (40 % of bf16 peak) | "
             "with SwiftVR x2: per GPU, host, speed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        job = Path(d) / "job.yaml"
        job.write_text("reference: ref.png\naudio: speech.wav\noutput: out.mp4\n")
        for gpus, host in MACHINES:
            for mode, keys in MODES:
                p = make_plan(load_job(job, ["model=wan-s2v-14b", *keys, *extra]), machine(gpus, host))
                r = next(r for r in p.ranks if "dit" in r.models)
                dit = "sharded" if "dit" in r.sharded else "replicated" if p.ranks[0].count > 1 else "whole"
                offload = r.offload + (f" ({p.host_tier})" if p.host_tier and r.offload == "block" else "")
                sr = make_plan(load_job(job, ["model=wan-s2v-14b", *keys, "sr.model=swiftvr", *extra]),
                               machine(gpus, host))
                lines.append(f"| {gpus}, {host} host | {mode} | {p.parallel} | {dit} | {offload} | {p.decode} | "
                             f"{_memory(p, ' | ')} | {_speed(p)} | {_memory(sr, ', ')} host, {_speed(sr)}"
                             + (f", decode {sr.decode}" if sr.decode != p.decode else "") + " |")
    return lines


def _memory(p, sep: str) -> str:
    """The fullest GPU, then the host, each marked where it does not fit."""
    gpu_fits = "" if p.gpu_bytes <= p.gpu_capacity else " **does not fit**"
    host_fits = "" if p.host_capacity is None or p.host_bytes <= p.host_capacity else " **does not fit**"
    return f"{p.gpu_bytes / GB:.1f} GB{gpu_fits}{sep}{p.host_bytes / GB:.0f} GB{host_fits}"


def _speed(p) -> str:
    return (f"{p.speed['fps']:.1f} fps" if "fps" in p.speed
            else f"{p.speed['clip_s']:.0f} s per {p.speed['video_s_per_clip']:g} s clip")


def main() -> None:
    print("\n".join(table(sys.argv[1:])))


if __name__ == "__main__":
    main()
