"""What a model family tells the renderer, and the few types it shares with it.

A family knows its own models. It declares
- its components (one model each, named; the runtime places, shards and offloads them by name),
- its chunk geometry (which chunk kinds it supports, native fps, native frame size),
- its chunk plan and its sampler,
- and how one chunk's model inputs are built, denoised, kept, refined and decoded.

The Pipeline runs these steps in its fixed order (`Step`: one name each, the same in `Family.needs`, the Stages'
`step` and the render summary's `compute_s`), timing each and bringing each step's components onto the device
(`Family.needs`); the Stages wrap them one step each. Neither knows any family: they see only this
interface, and a family imports nothing of pipeline/ or the CLI, of runtime/ only leaf helpers (the RingStore
that allocates its rings, the counters of its budget), and of media/ only the AudioSource protocol it reads audio
through (media/source.py, which imports nothing of the project).

The rolling state between chunks is a plain container of tensors (`RollingState`): what a family keeps in it
is its own business, and all of it is saved in resume checkpoints, so a resumed render continues exactly.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn

from avatar_cli.media.image import fit_image
from avatar_cli.media.source import AudioSource  # noqa: F401  (the families read audio through it)
from avatar_cli.runtime.rings import RingStore


class Step(str, Enum):
    """The six steps of a render, in the order the Pipeline runs them; a str, so a step is its name everywhere (the
    keys of `Family.needs`, a Stage's `step`, the render summary's `compute_s`)."""

    reference = "reference"  # once per job: the reference picture's conditioning (Family.reference)
    prompt = "prompt"  # once per job: the prompt's conditioning, through the text cache (Family.prompt)
    context = "context"  # per chunk: audio features, noise and the given frames (Family.context)
    a2v = "a2v"  # per chunk: audio-to-video, the sampler denoising the chunk's latents (Family.denoise)
    sr = "sr"  # per published stretch: the latents refined for the decoder, super-resolution (Family.refine)
    decode = "decode"  # per published stretch: latents to frames, handed on to the sink (Family.decode)


@dataclass(frozen=True)
class Chunk:
    kind: str  # a kind the family declares, e.g. "N" (carries the timeline) or "I" (smooths a seam)
    index: int
    start: int  # timeline frame of window position 0
    length: int  # window length in frames
    cond: tuple[int, ...]  # window positions given clean (motion frames, or the two anchors)
    keep: tuple[int, int]  # [s, e): timeline frames whose output this chunk keeps
    publish_to: int  # after this chunk, every frame before this index is final

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def name(self) -> str:
        return f"{self.kind}{self.index}"


@dataclass
class RollingState:
    """What survives between chunks; nothing here may grow with the video's length.

    tensors: the family's own (motion frames, anchors, its decoder cache, ...), saved whole in checkpoints, each
      in its own dtype.
    held: final but unpublished latents as (first timeline frame, end frame, latents); at most a few stretches.
      A family with one latent per frame holds (s, s + n, (n, ...)); one whose latents each make several frames
      (a temporal VAE) says which frames its latents become.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    held: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    published: int = 0  # frames handed to the encoder so far

    def take_final(self, upto: int) -> "Final | None":
        """Pop the held stretches that end at or before `upto`, in timeline order, as one stretch."""
        self.held.sort(key=lambda s: s[0])
        ready = [h for h in self.held if h[1] <= upto]
        self.held = [h for h in self.held if h[1] > upto]
        if not ready:
            return None
        return Final(ready[0][0], ready[-1][1], torch.cat([z for _, _, z in ready]))


@dataclass
class Final:
    """Consecutive final latents that become timeline frames [start, end)."""

    start: int
    end: int
    z: torch.Tensor

    @property
    def frames(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Geometry:
    kinds: tuple[str, ...]  # chunk kinds the family's plan can produce
    native_size: tuple[int, int]  # (width, height) the decoder outputs by default
    native_fps: float | None  # None: the family renders at any fps the job asks for
    sample_rate: int  # audio sample rate the family's audio features read


def check_degree(heads: int, degree: int) -> None:
    """Fail at start, not mid-render: Ulysses gives each rank heads/degree whole heads."""
    if degree < 1 or heads % degree:
        raise ValueError(f"sequence parallel: dit.heads={heads} is not divisible by the degree {degree} "
                         f"(the number of ranks); use a rank count that divides {heads}")


@dataclass(frozen=True)
class ParallelPlan:
    """How the runtime spreads the family's components over several ranks.

    sharded: FSDP2, one unit per transformer block (the big models); the rest are replicated.
    frame_parallel: components that work frame by frame, so each rank takes a share of the frames.
    sequence_parallel: the component whose forward the ranks split (Ulysses over heads), with the wrapper
      that does it (model, process group) -> module, and its head count (the rank count must divide it).
    quantized: (component, attribute paths) pairs: the nn.Linears under those paths are the ones
      `runtime.weights: fp8 | int8` quantizes (runtime/quantize.py; "*" is every child); components not listed
      stay in the runtime dtype whatever the setting.
    """

    sharded: tuple[str, ...] = ()
    frame_parallel: tuple[str, ...] = ()
    sequence_parallel: str | None = None
    sp_wrap: Callable[[nn.Module, Any], nn.Module] | None = None
    sp_heads: int = 1
    float32: tuple[str, ...] = ()
    bfloat16: tuple[str, ...] = ()  # computed in bfloat16 whatever the runtime dtype (runtime.vae_dtype: bfloat16)
    quantized: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def with_dtype(self, component: str, setting: str) -> "ParallelPlan":
        """This plan with `component` in float32 or bfloat16 (`runtime.vae_dtype`); auto: as the family chose."""
        if setting == "auto":
            return self
        f32 = tuple(n for n in self.float32 if n != component) + ((component,) if setting == "float32" else ())
        bf16 = tuple(n for n in self.bfloat16 if n != component) + ((component,) if setting == "bfloat16" else ())
        return replace(self, float32=f32, bfloat16=bf16)

    def quantized_paths(self, component: str) -> tuple[str, ...] | None:
        """The paths quantized in `component`, None when the family keeps it whole."""
        return dict(self.quantized).get(component)


@dataclass(frozen=True)
class Sampling:
    steps: int
    guidance: float
    shift: float


Models = Mapping[str, nn.Module]


class Family(ABC):
    """A model family: the unit that knows its own models (see the module docstring).

    `needs` says which components each step uses, so the Pipeline can bring them onto the device (and start
    copying the next step's in) around it. A step a family does not have (no super-resolution) needs ().
    """

    name: ClassVar[str]
    needs: ClassVar[Mapping[Step, tuple[str, ...]]]  # step -> the components it runs (every Step a key)
    # Later chunks are conditioned on decoded frames (re-encoded motion pixels): then every rank decodes, not
    # only the one that writes the file, and the decode step may update the rolling state.
    decode_feeds_back: ClassVar[bool] = False
    # The models' float32 results on a CPU have the same bits on any torch thread count (a GEMM over a few rows
    # can otherwise sum in another order on 1 thread than on 2): runtime.decode auto may then take a decode
    # thread, which borrows one of the loop's threads while it works, in float32 too (stages/decode_worker.py).
    thread_count_invariant: ClassVar[bool] = False
    mode: ClassVar[str] = "clip"  # the generation mode this object renders (wan-s2v has two: clip, streaming)
    # The chunk's denoising runs as separate steps on separate ranks (runtime.parallel: steps, pipeline/steps.py);
    # such a family also implements the StepPipeline protocol below.
    step_pipeline: ClassVar[bool] = False
    # Raised when a release of avatar changes what this family computes from the same inputs and weights: a resume
    # point written by another revision is refused (its frames and state would not continue the new ones).
    revision: ClassVar[int] = 0

    def is_decode_state(self, name: str) -> bool:
        """Whether the rolling-state tensor `name` is the decode step's own (its causal cache): `decode` reads and
        writes no other tensor, and no other step reads these. runtime.decode=worker keeps them in the worker
        process, which checks after each decode that every tensor it holds is declared here."""
        return False

    def job_defaults(self) -> dict[str, Any]:
        """Job-spec values this family renders with unless the job sets them ("sampling.steps": 40, ...)."""
        return {}

    def frame_size(self, image_wh: tuple[int, int], requested: tuple[int, int] | None) -> tuple[int, int]:
        """(width, height) the family generates at, for a reference image of size image_wh and the job's
        video.width/height (None: not set). The output is `requested` when set, else this size.
        Raise ValueError naming a size it cannot generate."""
        return self.geometry.native_size

    @property
    @abstractmethod
    def components(self) -> Mapping[str, tuple[type[nn.Module], Any]]:
        """name -> (model class, its params dataclass)."""

    @property
    @abstractmethod
    def geometry(self) -> Geometry: ...

    @property
    @abstractmethod
    def parallel(self) -> ParallelPlan: ...

    @abstractmethod
    def plan(self, chunking: Any, total_frames: int) -> list[Chunk]:
        """The whole chunk schedule of a video of `total_frames` frames (the job's `chunking` settings)."""

    @abstractmethod
    def check_job(self, chunking: Any, sampling: Sampling) -> None:
        """Raise ValueError naming a job setting this family cannot render (a spec error, exit 2)."""

    # Once per job.
    def fit_reference(self, image: np.ndarray, width: int, height: int) -> torch.Tensor:
        """The reference picture, uint8 (H, W, 3) as decoded, -> float32 (3, height, width) in [-1, 1], the size the
        family generates at. By default centre-cropped to the aspect and resized in float (media.image.fit_image); a
        family whose official preprocessing differs reproduces it here."""
        return fit_image(image, width, height)

    @abstractmethod
    def reference(self, models: Models, image: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Any:
        """image (3, H, W) in [-1, 1] at the native size -> the reference conditioning."""

    @abstractmethod
    def prompt(self, models: Models, prompt: str, device: torch.device, dtype: torch.dtype) -> Any:
        """The prompt's conditioning."""

    def prompt_overflow(self, prompt: str) -> tuple[int, int] | None:
        """(tokens the prompt makes, the most the text encoder reads) when it makes more, else None: the family
        cuts such a prompt (as the official code does), so the render warns and the text service refuses it."""
        return None

    # The text cache (avatar_cli/prompts/) stores the prompt's conditioning as flat named tensors (safetensors,
    # never a pickle), under the key its FamilySpec's prompt_identity gives (families/source.py). A family that
    # does not say how is not cached: its prompt is encoded for every job.
    def prompt_tensors(self, out: Any) -> dict[str, torch.Tensor] | None:
        """`prompt`'s output -> named tensors that `prompt_from_tensors` turns back into it; None: not cached."""
        return None

    def prompt_from_tensors(self, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Any:
        """The inverse of `prompt_tensors`: exactly the conditioning `prompt` returned (its dtype included)."""
        raise NotImplementedError(f"{self.name}: prompt_from_tensors")

    # Per chunk.
    @abstractmethod
    def context(self, models: Models, chunk: Chunk, audio: AudioSource, fps: float, text: Any,
                state: RollingState, seed: int, device: torch.device, dtype: torch.dtype) -> Any:
        """Everything the sampler needs for one chunk: audio features, noise, given frames."""

    @abstractmethod
    def release_audio(self, models: Models, audio: AudioSource, frame: int, fps: float) -> None:
        """No later chunk reads audio for frames before `frame`: let the reader drop it."""

    def audio_lookahead_s(self, models: Models) -> float:
        """How far past a frame's start its audio features read (a live session waits for that much more)."""
        return 0.0

    def resume_bytes(self, size: tuple[int, int], steps: int) -> int:
        """Bytes of the rolling state a resume point must copy from where it lives (the timestep pipeline's step
        ranks, the render process under a decode worker) at frame size (width, height): pipeline/checkpoint.py's
        `resume_schedule` spaces the copies by it. Small for most families."""
        return 0

    def audio_lookbehind_s(self, models: Models) -> float:
        """How far before a chunk's first frame its audio features read (what a live session's rank 0 sends the
        other ranks with the chunk); by default as far as they read ahead, a window centred on each frame."""
        return self.audio_lookahead_s(models)

    @abstractmethod
    def denoise(self, models: Models, inputs: Any, ref: Any, sampling: Sampling, state: RollingState,
                rings: RingStore = RingStore()) -> torch.Tensor:
        """Sample the chunk's latents (one per window position). `state`: the rolling state, for a family whose
        denoising reads and writes caches of its own there (LiveAvatar's key/value rings); others ignore it.
        rings: where such caches live (runtime.rings, the Placement's decision); others ignore it too."""

    @abstractmethod
    def keep(self, chunk: Chunk, z: torch.Tensor, state: RollingState, chunking: Any) -> None:
        """Hold the chunk's kept latents (state.held) and update what later chunks are conditioned on."""

    def refine(self, models: Models, z: torch.Tensor, ref: Any) -> torch.Tensor:
        """Final latents -> the latents the decoder takes (super-resolution); identity by default."""
        return z

    @abstractmethod
    def decode(self, models: Models, final: Final, state: RollingState,
               put: Callable[[torch.Tensor], None]) -> int:
        """Decode consecutive final latents (`final.z`, refined) into timeline frames [final.start, final.end),
        in order, carrying the decoder cache in `state.tensors`; hand each batch of frames (T, 3, H, W) in [-1, 1]
        to `put` as soon as it exists. Returns frames made (final.frames)."""


class StepPipeline(Protocol):
    """What the timestep pipeline (pipeline/steps.py) asks of a family with `step_pipeline = True`: one chunk's
    denoising in pieces that run on separate ranks (rank 1 + s runs step s, rank 0 decodes), and the pieces of
    the rolling state each rank holds and sends. `state` is always the rank's own rolling state, passed to the
    steps that read or write it."""

    sink_roll_block: int  # the block whose final latents give the sink frame (rolled_sink_frame) the others take

    def block_noise(self, inputs: Any, ref: Any, dtype: torch.dtype) -> torch.Tensor:
        """The chunk's starting noise."""

    def denoise_step(self, models: Models, inputs: Any, ref: Any, x: torch.Tensor, step: int, sampling: Sampling,
                     state: RollingState, own_ring: bool = False, rings: RingStore = RingStore()) -> torch.Tensor:
        """Denoising step `step` of the chunk: x -> x, reading and writing the step's caches in `state`. own_ring:
        the state holds this step's caches alone (a step rank), not every step's. rings: where the caches live."""

    def block_latents(self, inputs: Any, ref: Any, x: torch.Tensor) -> torch.Tensor:
        """The denoised x -> the chunk's latents, as `Family.denoise` returns them."""

    def step_state(self, state: RollingState, step: int) -> RollingState:
        """A step rank's own state out of a whole one (a resumed render's)."""

    def step_tensor_names(self, step: int, block: int) -> list[str]:
        """The state tensors step `step`'s rank sends the decode rank after block `block`."""

    def step_tensors(self, state: RollingState, step: int, block: int) -> dict[str, torch.Tensor]:
        """Those tensors, from the step rank's state."""

    def merge_step_tensors(self, state: RollingState, per_step: list[dict[str, torch.Tensor]], block: int) -> None:
        """The decode rank's state after block `block`, as one rank's would be, from every step rank's tensors."""

    def rolled_sink_frame(self, block: int, z: torch.Tensor) -> torch.Tensor | None:
        """Block `block`'s final latents -> the frame the other step ranks refresh their sink with, or None."""

    def needs_sink_frame(self, block: int, state: RollingState) -> bool:
        """Whether a step rank must receive the rolled sink frame before block `block`."""

    def put_sink_frame(self, state: RollingState, frame: torch.Tensor) -> None:
        """Keep a received sink frame in the step rank's state."""

    def drop_rings(self, state: RollingState) -> None:
        """The decode rank's copies of the step ranks' rings, once their resume point is written."""
