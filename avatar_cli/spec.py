"""The job spec: a typed OmegaConf schema (the one place its defaults live), and validation.

Precedence, lowest first: schema defaults < the model family's defaults < the job file < key=value
overrides < -o/--output. Unknown keys and wrong types are errors that name the key.
configs/default.yaml (and its packaged copy, avatar_cli/default.yaml) is the commented reference rendered from this
schema by spec_reference.py, which also holds each key's one-line comment.
"""

import math
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import (ConfigKeyError, GrammarParseError, InterpolationResolutionError, MissingMandatoryValue,
                              OmegaConfBaseException)

from avatar_cli.errors import SpecError

# libx264's presets. h264_nvenc ignores video.preset (the writer always uses its p4), so these are the whole set.
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
                "placebo")
# h264_nvenc's limit on recent GPUs (older ones stop at 4096). libx264 takes up to 16384 per side, but not
# 16384x16384 (FFmpeg's image-size check), so one limit that both encoders meet keeps validate honest.
MAX_SIDE = 8192


class Codec(str, Enum):
    auto = "auto"
    libx264 = "libx264"
    h264_nvenc = "h264_nvenc"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Offload(str, Enum):
    auto = "auto"
    none = "none"
    model = "model"
    block = "block"


class Shard(str, Enum):
    auto = "auto"
    shard = "shard"
    replicate = "replicate"


class OffloadHost(str, Enum):
    auto = "auto"
    pinned = "pinned"
    mmap = "mmap"


class Rings(str, Enum):
    auto = "auto"
    device = "device"
    host = "host"
    disk = "disk"


class Parallel(str, Enum):
    auto = "auto"
    sequence = "sequence"
    steps = "steps"


class Mode(str, Enum):
    """The generation modes a family may render in (families/registry.py says which each family has)."""

    clip = "clip"  # chunk by chunk, each chunk a whole sampled clip (mini; wan-s2v's official clip loop)
    streaming = "streaming"  # LiveAvatar's few-step blocks with key/value caches (wan-s2v)


class Decode(str, Enum):
    auto = "auto"
    inline = "inline"
    worker = "worker"


class Reshard(str, Enum):
    per_block = "per_block"
    per_stage = "per_stage"


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class VaeDType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class Weights(str, Enum):
    bf16 = "bf16"
    fp8 = "fp8"
    int8 = "int8"


@dataclass
class VideoSpec:
    fps: float = 25.0
    width: Optional[int] = None  # None: the model's native size
    height: Optional[int] = None
    crf: int = 20  # x264 quality, 0 (lossless) .. 51; nvenc uses it as its constant-quality target
    preset: str = "veryfast"
    codec: Codec = Codec.auto


@dataclass
class SamplingSpec:
    steps: int = 4
    guidance: float = 1.0  # classifier-free guidance on audio and text; 1.0 = off (one forward per step)
    shift: float = 3.0  # timestep shift: spends more of the few steps at high noise, where the layout forms


@dataclass
class ChunkingSpec:
    frames: int = 24  # new frames per N chunk
    motion_frames: int = 4  # frames of the previous N chunk each N chunk is conditioned on
    # I chunks: regenerate each seam between two anchors. auto: on where a GPU renders, off on a CPU, where their
    # cost outweighs the seam they smooth (bench/results.md; resolved in job.resolve).
    transitions: Union[bool, str] = "auto"
    transition_frames: int = 6  # frames an I chunk regenerates after each seam


@dataclass
class TextServiceSpec:
    """`avatar serve text` somewhere: prompt encodings fetched from it (the text cache in front)."""

    url: Optional[str] = None  # e.g. http://127.0.0.1:8765; None: encode in the render process
    fallback: bool = False  # the service down or answering garbage: encode locally, with a note (else: an error)
    timeout_s: float = 30.0  # per request
    retries: int = 2  # further attempts after a failed request (connection errors, 5xx), with backoff


@dataclass
class RuntimeSpec:
    device: Device = Device.auto
    dtype: DType = DType.auto  # auto: bfloat16 on CUDA and on CPUs with native bf16, else float32
    threads: int = 0  # torch CPU threads; 0 = one per core
    offload: Offload = Offload.auto  # GPU: where idle models wait (auto decides from free GPU memory)
    # offload: block: where the DiT's blocks wait. pinned: a copy in pinned host memory; mmap: the checkpoint file
    # itself, memory-mapped (the page cache, shared by every process), copied block by block; auto: pinned when the
    # copies fit the host's available memory, else mmap.
    offload_host: OffloadHost = OffloadHost.auto
    # The wan-s2v streaming mode's key/value rings and sink (41.5 + 2.2 GB at 704x384): device | host (pinned host
    # memory, each layer's brought in for its attention: one rank only) | disk (a memory-mapped scratch file beside
    # the output, for a host too small to hold them) | auto: on the device where they fit beside the models, else
    # host where the host holds them, else disk (as `avatar plan` counts it).
    rings: Rings = Rings.auto
    reshard: Reshard = Reshard.per_block  # several GPUs: FSDP2 reshards after each block, or after each stage
    shard: Shard = Shard.auto  # several GPUs: shard the big models (FSDP2) or replicate them; auto: from memory
    # The DiT's (and wan-s2v's umT5's) weights in memory: bf16 = in the runtime dtype (`dtype`), as loaded; fp8 | int8
    # = the Linears of their transformer blocks quantized at load, weight-only (1 byte a parameter plus a scale per
    # output channel, dequantized layer by layer in the forward; torchao): about half the memory; a quantized
    # encoder's prompt encodings are cached apart. runtime/quantize.py.
    weights: Weights = Weights.bf16
    # The VAE (encode and decode): auto = the family's choice (wan-s2v: float32, as the official code; mini: the
    # runtime dtype) | float32 | bfloat16: about half the decode's memory peak, its error in docs/wan-s2v.md.
    vae_dtype: VaeDType = VaeDType.auto
    text_cache: str = "auto"  # prompt encodings: auto (user cache folder) | off | a folder (avatar_cli/prompts/)
    # Several ranks: how they split the work. sequence: every rank works on every chunk (Ulysses over heads);
    # steps: the timestep pipeline of the wan-s2v streaming mode (rank 0 decodes, rank i runs denoising step i);
    # auto: chosen per rank count and mode, said in one log line.
    parallel: Parallel = Parallel.auto
    # The VAE decode and the MP4 encoder: inline (in the render process) | worker (their own process, fed through a
    # bounded shared-memory queue while the DiT goes on) | auto (worker where it pays, inline otherwise).
    decode: Decode = Decode.auto
    text_service: TextServiceSpec = field(default_factory=TextServiceSpec)


@dataclass
class RawAudioSpec:
    """Headerless PCM on a live input (`audio: -`, a FIFO, a URL): FFmpeg cannot tell its format, so the job does."""

    format: Optional[str] = None  # s16le | s16be | s32le | f32le | f64le | u8; None: the input has a header
    rate: int = 16000
    channels: int = 1


@dataclass
class LiveSpec:
    """A live session: audio that keeps arriving (`audio: -`, a FIFO, a URL) and/or a live output (`output: -`,
    rtmp://, udp://, tcp://, a .m3u8 path, an http(s):// WHIP endpoint). avatar_cli/render/live.py."""

    # A live session's chunking.frames (null: chunking.frames). A chunk's first frame waits for the chunk's last
    # audio, so the chunk's length is part of every frame's latency; a file render keeps chunking.frames.
    chunk_frames: Optional[int] = 12
    stall_s: float = 1.0  # a chunk whose audio is this far past due on the session's clock renders on silence
    first_audio_s: float = 30.0  # a live input that sends nothing for this long fails the session (exit 1)
    # A file's frames leave at the stream's pace (as `ffmpeg -re`): auto = for a live output; a file output stays as
    # fast as the machine allows. A live input's frames always do, into a live output (the frame clock).
    realtime: Union[bool, str] = "auto"
    max_latency_s: float = 5.0  # warn when a chunk's frames leave later than this after its last audio arrived
    hls_keep_segments: bool = False  # HLS: keep every segment (and list it); else a rolling window of the newest
    # HLS: seconds per segment, a keyframe at each (rounded up to whole frames). A segment is listed once complete,
    # so a frame waits up to this long; shorter costs bits (more keyframes) and more playlist requests.
    hls_segment_s: float = 1.0
    record: Optional[str] = None  # also write the session to this MP4 (fragmented: playable even if killed)
    preview: bool = False  # serve the HLS output and a player page on loopback (media/preview/), URL printed
    raw_audio: RawAudioSpec = field(default_factory=RawAudioSpec)
    # WHIP: a file holding the endpoint's bearer token, sent as `Authorization: Bearer <token>` (relative to the job
    # file; the token is the file's content, whitespace stripped).
    bearer_token_file: Optional[str] = None


LIVE_SCHEMES = ("rtmp://", "rtmps://", "udp://", "tcp://", "http://", "https://")


def is_live_output(output: str) -> bool:
    """Whether `output` names a live stream (media/live.py opens it) rather than an MP4 file."""
    return output == "-" or output.lower().startswith(LIVE_SCHEMES) or output.lower().endswith(".m3u8")


def is_stream_input(audio: str) -> bool:
    """Whether `audio` is read as it arrives: stdin, a named pipe or a URL (media/live_audio.py)."""
    if audio == "-" or "://" in audio:
        return True
    import stat  # noqa: PLC0415 (a stat call only where the audio is a local path)

    try:
        return stat.S_ISFIFO(Path(audio).expanduser().stat().st_mode)
    except OSError:
        return False


@dataclass
class JobSpec:
    reference: str = MISSING
    audio: str = MISSING
    output: str = MISSING
    prompt: str = ""
    seed: int = 0
    model: str = "mini"
    mode: Mode = Mode.clip  # wan-s2v: clip (the official clip loop) | streaming (LiveAvatar's 4-step blocks)
    # wan-s2v: the DiT read from this one file instead of the model directory's (ComfyUI's single-file bf16 or
    # scaled-FP8 safetensors, a GGUF quantization); the directory gives the rest (docs/wan-s2v.md).
    dit: Optional[str] = None
    # A LoRA merged into the model's DiT once at load (wan-s2v: LiveAvatar's liveavatar.safetensors), a path
    # relative to the job file like `model`; its factors must have rank lora_rank; W <- W + lora_scale · B @ A
    # (None: LiveAvatar's alpha 64 / rank 128 = 0.5; the file carries no alpha, so another rank must set it).
    lora: Optional[str] = None
    lora_rank: int = 128
    lora_scale: Optional[float] = None
    video: VideoSpec = field(default_factory=VideoSpec)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    chunking: ChunkingSpec = field(default_factory=ChunkingSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    live: LiveSpec = field(default_factory=LiveSpec)


@dataclass(frozen=True)
class Job:
    """A validated job: the spec, with every path absolute."""

    spec: JobSpec
    path: Path  # the job file
    reference: Path
    audio: Path | str  # a str for stdin ("-") and URLs, read as they arrive (is_stream_input)
    output: Path | str  # a str for stdout ("-") and URLs (is_live_output)
    model: str  # a shipped name, or an absolute directory
    lora: Path | None = None  # the LoRA file, absolute
    dit: Path | None = None  # the DiT file, absolute
    record: Path | None = None  # live.record, absolute
    bearer_token_file: Path | None = None  # live.bearer_token_file, absolute
    # The model as resolved for its family's defaults (a families.registry.ModelSource in the job's mode; None
    # when it did not resolve): job.resolve_source goes on from it instead of resolving the model again.
    source: Any = field(default=None, compare=False, repr=False)

    @property
    def live(self) -> bool:
        """A live session: its audio arrives as it goes, or its output is a stream (avatar_cli/render/live.py)."""
        return is_stream_input(str(self.audio)) or is_live_output(str(self.output))

    @property
    def partial_output(self) -> Path:
        """Written while rendering; renamed to `output` only on success."""
        return self.output.with_name(self.output.stem + ".partial" + self.output.suffix)

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self.spec))


def _describe(e: OmegaConfBaseException, where: str) -> str:
    key = getattr(e, "full_key", None) or "?"
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, ConfigKeyError):
        return f"{where}: unknown key '{key}'"
    if isinstance(e, MissingMandatoryValue):
        return f"{where}: missing required key '{key}'"
    if isinstance(e, (InterpolationResolutionError, GrammarParseError)):
        return f"{where}: cannot resolve '{key}': {first}"
    choices = _choices(key)
    if choices:  # OmegaConf's own list is in [brackets], which Rich's markup would swallow on a terminal
        return f"{where}: invalid value for '{key}': {getattr(e, 'value', '?')!r}, expected one of {choices}"
    return f"{where}: invalid value for '{key}': {first}"


def _choices(key: str) -> str | None:
    """The allowed values of an enum-typed key ("video.codec"), comma-separated; None for other keys."""
    t = JobSpec
    for part in key.split("."):
        t = {f.name: f.type for f in fields(t)}.get(part) if is_dataclass(t) else None
    if isinstance(t, type) and issubclass(t, Enum):
        return ", ".join(m.value for m in t)
    return None


def _merge(base, layer, where: str):
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as e:
        raise SpecError(_describe(e, where)) from None


def load_job(job_path: str | Path, overrides: list[str] | None = None, output: str | None = None) -> Job:
    path = Path(job_path)
    if not path.is_file():
        raise SpecError(f"job: {path}: no such file")
    try:
        job_cfg = OmegaConf.load(path)
    except GrammarParseError as e:  # valid YAML, but a broken ${...}: say so rather than "not valid YAML"
        raise SpecError(_describe(e, str(path))) from None
    except Exception as e:  # YAML syntax errors come in several types
        raise SpecError(f"job: {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not OmegaConf.is_dict(job_cfg):
        raise SpecError(f"job: {path}: expected a mapping of keys at the top level")
    raw = OmegaConf.to_container(job_cfg, resolve=False)
    for key in ("audio", "output"):  # `audio: -` unquoted is YAML's list of one null: it means stdin (stdout)
        if raw.get(key) == [None]:
            job_cfg[key] = "-"

    # Layers, lowest first, over the schema's defaults. A model family's own defaults (wan-s2v: 16 fps, 40 steps,
    # ...) go below the job file, so whatever the user wrote still wins.
    layers = [(job_cfg, str(path))]
    cli_keys: set[str] = set()
    for item in overrides or []:
        if "=" not in item:
            raise SpecError(f"override '{item}': expected key=value")
        key, value = item.split("=", 1)
        try:
            # A bare "-" (stdin, stdout) would be read as a YAML list: it is the string "-".
            layer = OmegaConf.from_dotlist([item if value != "-" else f"{key}='-'"])
        except OmegaConfBaseException as e:
            raise SpecError(f"override '{item}': {str(e).splitlines()[0]}") from None
        layers.append((layer, f"override '{item}'"))
        cli_keys.add(key)

    def merged(layers) -> OmegaConf:
        cfg = OmegaConf.structured(JobSpec)
        for layer, where in layers:
            cfg = _merge(cfg, layer, where)
        return cfg

    cfg = merged(layers)
    # The model is resolved here once (its family's defaults are needed now); the Job carries it on to job.py.
    base = Path.cwd() if "model" in cli_keys else path.resolve().parent
    shipped = cfg.model in _shipped_names()
    source = _model_source(cfg.model if shipped else str((base / Path(cfg.model).expanduser()).resolve()), base,
                           cfg.mode)
    values = source.family.job_defaults() if source is not None else {}
    if values:
        layers.insert(0, (OmegaConf.from_dotlist(
            [f"{k}={v}" for k, v in values.items()]), f"the {source.family.name} family's defaults"))
        cfg = merged(layers)
    if output is not None:
        cfg.output = output
        cli_keys.add("output")
    try:
        spec: JobSpec = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as e:  # interpolations (output: out/${seed}.mp4) resolve here, and can fail
        raise SpecError(_describe(e, str(path))) from None

    # Paths written in the job file are relative to its folder; paths typed on the command line, to the shell's.
    def resolve(key: str, value: str) -> Path:
        base = Path.cwd() if key in cli_keys else path.resolve().parent
        return (base / Path(value).expanduser()).resolve()

    def resolve_stream(key: str, value: str) -> Path | str:  # stdin/stdout and URLs stay as written
        return value if value == "-" or "://" in value else resolve(key, value)

    validate(spec)
    model = spec.model
    if spec.model not in _shipped_names():
        model = str(resolve("model", spec.model))
    return Job(spec=spec, path=path.resolve(), reference=resolve("reference", spec.reference),
               audio=resolve_stream("audio", spec.audio), output=resolve_stream("output", spec.output), model=model,
               lora=resolve("lora", spec.lora) if spec.lora is not None else None, source=source,
               dit=resolve("dit", spec.dit) if spec.dit is not None else None,
               record=resolve("live.record", spec.live.record) if spec.live.record is not None else None,
               bearer_token_file=resolve("live.bearer_token_file", spec.live.bearer_token_file)
               if spec.live.bearer_token_file is not None else None)


def _model_source(model: str, base: Path, mode: str):
    """The job's model (a families.registry.ModelSource) in its mode, or None when it does not resolve
    (job.resolve_source then says why, with exit 2)."""
    from avatar_cli.families.registry import model_for_spec  # local import, as below

    return model_for_spec(model, base, mode)


def _shipped_names() -> set[str]:
    """Model names that are no path: shipped models and the sizes `avatar plan` counts without weights."""
    from avatar_cli.families.registry import preset_names, shipped_names  # local: spec must not pull in torch at import

    return shipped_names() | preset_names()


def validate(s: JobSpec) -> None:
    """Value rules the types can't express. Each failure names the key."""
    v, c, sm = s.video, s.chunking, s.sampling
    rules = [
        (v.fps > 0, "video.fps must be positive"),
        (v.fps <= 240, "video.fps must be at most 240"),
        (v.width is None or (v.width > 0 and v.width % 2 == 0), "video.width must be a positive even number"),
        (v.height is None or (v.height > 0 and v.height % 2 == 0), "video.height must be a positive even number"),
        (v.width is None or v.width <= MAX_SIDE, f"video.width must be at most {MAX_SIDE} (the encoders' limit)"),
        (v.height is None or v.height <= MAX_SIDE, f"video.height must be at most {MAX_SIDE} (the encoders' limit)"),
        ((v.width is None) == (v.height is None), "video.width and video.height must be set together"),
        (0 <= v.crf <= 51, "video.crf must be in 0..51"),
        (v.preset in X264_PRESETS, f"video.preset must be one of {', '.join(X264_PRESETS)}"),
        (c.frames > 0, "chunking.frames must be positive"),
        (c.motion_frames >= 0, "chunking.motion_frames must not be negative"),
        (c.motion_frames < c.frames or c.frames == 0, "chunking.motion_frames must be smaller than chunking.frames"),
        (c.transitions in (True, False, "auto"), "chunking.transitions must be true, false or auto"),
        (not c.transitions or c.transition_frames > 0, "chunking.transition_frames must be positive when transitions are on"),
        (not c.transitions or c.motion_frames + c.transition_frames <= c.frames,
         "chunking.motion_frames + chunking.transition_frames must not exceed chunking.frames "
         "(an I chunk would rewrite frames the next N chunk is conditioned on)"),
        (sm.steps > 0, "sampling.steps must be positive"),
        (sm.guidance >= 0, "sampling.guidance must not be negative"),
        (sm.shift > 0, "sampling.shift must be positive"),
        (s.runtime.threads >= 0, "runtime.threads must not be negative"),
        (s.lora is None or s.lora.strip() != "", "lora must be a LoRA file's path, or null for none"),
        (s.dit is None or s.dit.strip() != "", "dit must be a DiT file's path, or null for the model's own"),
        (s.lora_rank > 0, "lora_rank must be positive"),
        (s.lora_scale is None or math.isfinite(s.lora_scale), "lora_scale must be a finite number"),
        (Path(s.output).suffix.lower() == ".mp4" or is_live_output(s.output),
         "output must end in .mp4, or be a live output: -, rtmp://, rtmps://, udp://, tcp://, http(s):// (WHIP) "
         "or a .m3u8 path"),
        (s.live.bearer_token_file is None or s.output.lower().startswith(("http://", "https://")),
         "live.bearer_token_file is for a WHIP output (an http:// or https:// URL)"),
        (s.live.record is None or Path(s.live.record).suffix.lower() == ".mp4", "live.record must end in .mp4"),
        (not s.live.preview or s.output.lower().endswith(".m3u8"),
         "live.preview (--preview) serves an HLS output: give the output as a .m3u8 path, e.g. -o out/live.m3u8"),
        (s.live.chunk_frames is None or s.live.chunk_frames > 0, "live.chunk_frames must be positive"),
        (s.live.stall_s > 0, "live.stall_s must be positive"),
        (s.live.first_audio_s > 0, "live.first_audio_s must be positive"),
        (s.live.max_latency_s > 0, "live.max_latency_s must be positive"),
        (0 < s.live.hls_segment_s <= 10, "live.hls_segment_s must be positive and at most 10 (seconds per segment)"),
        (s.live.realtime in (True, False, "auto"), "live.realtime must be true, false or auto"),
        (s.live.raw_audio.format in (None, "s16le", "s16be", "s32le", "f32le", "f64le", "u8"),
         "live.raw_audio.format must be one of s16le, s16be, s32le, f32le, f64le, u8 (or null)"),
        (s.live.raw_audio.rate > 0 and 1 <= s.live.raw_audio.channels <= 8,
         "live.raw_audio needs a positive rate and 1 to 8 channels"),
    ]
    for ok, message in rules:
        if not ok:
            raise SpecError(message)
