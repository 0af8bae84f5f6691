"""The job spec's commented reference, rendered from the schema in spec.py.

The schema's dataclasses hold every default; this module holds one comment per key and writes the two together as
YAML: configs/default.yaml in the repository and avatar_cli/default.yaml, its copy in the installed package.
tests/test_spec_reference.py fails when either file differs from what `reference_yaml()` renders now, or when a key
lacks its comment, so a default changed in the schema is a default changed in the reference.

    python -m avatar_cli.spec_reference            # print the reference (works in any install)
    python -m avatar_cli.spec_reference --write    # regenerate both files (in a checkout)
"""

import json
import sys
from dataclasses import MISSING as NO_DEFAULT, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import yaml  # PyYAML, which omegaconf depends on
from omegaconf import MISSING

from avatar_cli.spec import JobSpec

PACKAGED = Path(__file__).resolve().parent / "default.yaml"
REPOSITORY = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

HEADER = """\
# The job spec: every key, its default and what it does.
# Generated from the schema (avatar_cli/spec.py) by `python -m avatar_cli.spec_reference --write`; edit the
# schema's defaults or the comments in avatar_cli/spec_reference.py, not this file.
# A job file sets any of these; `avatar render job.yaml key=value` overrides the job file. A model family may
# bring its own defaults for a few keys (wan-s2v: fps, steps, guidance, chunking; docs/wan-s2v.md): they sit
# between these and the job file, so a key the job sets always wins."""

# Sections: a comment line above each group of keys.
SECTIONS = {
    "video": "The output video.",
    "sampling": "The diffusion sampler.",
    "chunking": "How the timeline is cut into chunks (docs/design.md).",
    "runtime": "Where and how the render runs (docs/multi-gpu.md for the several-GPU keys).",
    "runtime.text_service": "A shared text encoder (`avatar serve text`, docs/text-service.md).",
    "live": "Live sessions: audio that keeps arriving, and/or a live output (docs/live.md).",
    "live.raw_audio": "Headerless PCM on a live input: FFmpeg cannot tell its format, so the job does.",
}

# One line per key, beside it where it fits, else above it. Details belong in docs/, which these point to.
COMMENTS = {
    "reference": "the reference picture: png, jpg or webp, any size (relative paths: to the job file's folder)",
    "audio": "the speech: anything PyAV decodes; its length sets the video's. Live: - (stdin), a FIFO or a URL",
    "output": "the MP4 to write; live: - (MPEG-TS on stdout), rtmp://, udp://, tcp://, .m3u8 (HLS), http(s):// (WHIP)",
    "prompt": "words steering the expression (\"smiling, lively\"); cut at the text encoder's length, with a warning",
    "seed": "noise is drawn per chunk from this seed and the chunk index, never from the rank count",
    "model": "a shipped model's name (`avatar models`), or a model directory (relative to the job file's folder)",
    "mode": "clip | streaming (wan-s2v only: streaming is LiveAvatar's 4-step blocks; docs/wan-s2v.md)",
    "dit": "wan-s2v only: the DiT from this one file (ComfyUI .safetensors, FP8-scaled, .gguf); null: the model's",
    "lora": "wan-s2v only: a LoRA file merged into the DiT once at load (LiveAvatar's liveavatar.safetensors)",
    "lora_rank": "the rank every LoRA factor pair must have (LiveAvatar: 128)",
    "lora_scale": "W <- W + lora_scale * B @ A; null: LiveAvatar's alpha 64 / rank 128 = 0.5 (set it for another rank)",
    "video.fps": "frames per second of the output",
    "video.width": "null: the family's own size (mini: 256 x 256); even, at most 8192, set together with height",
    "video.height": "null: as width",
    "video.crf": "quality: 0 (lossless) .. 51; h264_nvenc takes it as its constant-quality target",
    "video.preset": "x264 preset, ultrafast .. placebo (h264_nvenc ignores it)",
    "video.codec": "auto | libx264 | h264_nvenc (auto: nvenc on a GPU where it works, else libx264)",
    "sampling.steps": "denoising steps per chunk",
    "sampling.guidance": "classifier-free guidance on audio and prompt; 1.0 = off (one forward per step)",
    "sampling.shift": "timestep shift toward the noisy end, where the layout forms",
    "chunking.frames": "new frames per N chunk",
    "chunking.motion_frames": "frames of the previous N chunk each N chunk continues from",
    "chunking.transitions": "I chunks that regenerate each seam: true | false | auto (on with a GPU, off on a CPU)",
    "chunking.transition_frames": "frames each I chunk regenerates after a seam",
    "runtime.device": "auto | cpu | cuda",
    "runtime.dtype": "auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA and CPUs with native bf16, else float32)",
    "runtime.threads": "torch CPU threads; 0 = one per core",
    "runtime.offload": "GPU: auto | none | model | block (where idle models wait: pinned host memory)",
    "runtime.offload_host": "offload block: auto | pinned | mmap (blocks in pinned copies, or the mapped checkpoint)",
    "runtime.rings": "wan-s2v streaming: auto | device | host | disk (where the key/value rings wait)",
    "runtime.reshard": "several GPUs (FSDP2): per_block (least memory) | per_stage (fewer all-gathers)",
    "runtime.shard": "several GPUs: auto | shard | replicate the big models (auto: replicas where they fit)",
    "runtime.weights": "bf16 (the runtime dtype) | fp8 | int8: DiT and umT5 block Linears in 1 byte (docs/speed.md)",
    "runtime.vae_dtype": "auto (the family's: wan-s2v float32) | float32 | bfloat16 (half the decode's memory; "
                         "docs/wan-s2v.md)",
    "runtime.text_cache": "prompt encodings kept for reuse: auto (the user cache folder) | off | a folder "
                          "(docs/text-service.md)",
    "runtime.parallel": "several ranks: auto | sequence (Ulysses over heads) | steps (wan-s2v streaming: a rank per "
                        "step + 1)",
    "runtime.decode": "auto | inline | worker (the VAE decode and MP4 encoder in their own process; "
                      "docs/decode-worker.md)",
    "runtime.text_service.url": "`avatar serve text` at this URL (token: AVATAR_TEXT_TOKEN); null: encode here",
    "runtime.text_service.fallback": "service down or answering garbage: encode here with a note (false: exit 1)",
    "runtime.text_service.timeout_s": "seconds per request",
    "runtime.text_service.retries": "further attempts after a connection error, a timeout or a 5xx, with backoff",
    "live.chunk_frames": "a live session's chunking.frames (shorter: lower latency); null: chunking.frames",
    "live.stall_s": "a chunk whose audio is this far past due on the session's clock renders on silence",
    "live.first_audio_s": "a live input that sends nothing for this long fails the session (exit 1)",
    "live.realtime": "a file's frames leave at the stream's pace: true | false | auto (auto: for a live output)",
    "live.max_latency_s": "warn when a chunk's frames leave later than this after its last audio arrived",
    "live.hls_keep_segments": "HLS: keep and list every segment; false: a rolling window of the newest",
    "live.hls_segment_s": "HLS: seconds per segment, a keyframe at each (shorter: listed sooner, more bits)",
    "live.record": "also write the session to this MP4 (fragmented: playable even if the session is killed)",
    "live.preview": "serve the HLS output and a player page on loopback, URL printed (`--preview`)",
    "live.raw_audio.format": "s16le | s16be | s32le | f32le | f64le | u8; null: the input has a header",
    "live.raw_audio.rate": "its sample rate (Hz)",
    "live.raw_audio.channels": "its channel count",
    "live.bearer_token_file": "WHIP: a file holding the endpoint's token, sent as `Authorization: Bearer <token>`",
}

WIDTH = 118  # the repository's line length
COLUMN = 23  # where a beside-the-key comment starts


def schema_keys(cls: type = JobSpec, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted, in declaration order."""
    keys = []
    for f in fields(cls):
        if is_dataclass(f.type):
            keys += schema_keys(f.type, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _scalar(value: Any) -> str:
    """A default as YAML that loads back to the same value."""
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return text if text and yaml.safe_load(text) == text else json.dumps(text)


def _render(cls: type, prefix: str, depth: int, out: list[str]) -> None:
    indent = "  " * depth
    for f in fields(cls):
        key = prefix + f.name
        if is_dataclass(f.type):
            out.append("")
            out.append(f"{indent}# {SECTIONS[key]}")
            out.append(f"{indent}{f.name}:")
            _render(f.type, key + ".", depth + 1, out)
            continue
        default = f.default if f.default is not NO_DEFAULT else f.default_factory()  # type: ignore[misc]
        if default == MISSING:
            continue  # the required keys: listed in the header
        line = f"{indent}{f.name}: {_scalar(default)}"
        comment = COMMENTS[key]
        beside = f"{line.ljust(COLUMN - 1)} # {comment}"
        if len(beside) > WIDTH:
            out += [f"{indent}# {comment}", line]
        else:
            out.append(beside)


def reference_yaml() -> str:
    """The commented reference of every job key and its default, as configs/default.yaml holds it."""
    required = [f.name for f in fields(JobSpec) if f.default == MISSING]
    out = HEADER.splitlines() + ["#", "# Required in every job (no default):"]
    out += [f"#   {name.ljust(10)} {COMMENTS[name]}" for name in required]
    out.append("")
    _render(JobSpec, "", 0, out)
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    text = reference_yaml()
    if argv == ["--write"]:
        in_checkout = (REPOSITORY.parent.parent / "pyproject.toml").is_file()  # not in an installed wheel
        targets = [PACKAGED] + ([REPOSITORY] if in_checkout else [])
        for path in targets:
            path.write_text(text)
            print(f"wrote {path}")
        return 0
    if argv:
        print("usage: python -m avatar_cli.spec_reference [--write]", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
