"""What a family's render needs, counted on the meta device at one frame size: the figures `avatar plan` sizes a
layout with (a family's `FamilySpec.budget` makes one; families/wan_s2v/budget.py for wan-s2v), and the two
decisions a render and `avatar plan` both take from them: the working set one rank keeps free beside its weights
(`working_set`) and where the streaming mode's key/value rings wait (`rings_place`). runtime/job_budget.py applies
them to one job.

Bytes are exact counts of the models' parameters at the dtype each runs in, and of the tensors a forward allocates
on meta (runtime/meta_count.py); FLOPs are torch's FlopCounterMode over the same meta forwards (runtime/flops.py).
Nothing here is measured on a device.
"""

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from avatar_cli.runtime.device import dtype_name
from avatar_cli.runtime.quantize import tensor_bytes

GB = 1e9
HOST_RESERVE = 4 * GB  # the process itself, its libraries, the audio and the encoder: not counted in a budget


@dataclass(frozen=True)
class ModelBytes:
    """One component's parameters at the dtype it runs in, split the way offload and FSDP2 see them."""

    total: int
    dtype: str  # the dtype it runs in: "bfloat16", "float32", ...
    blocks: int = 0  # its transformer blocks (0: none; then it is offloaded whole)
    block: int = 0  # the largest block's bytes
    blocks_total: int = 0  # all blocks together
    file_total: int = 0  # bytes of its checkpoint tensors (the dtype on disk); 0: not read from a safetensors file
    stored_quantized: bool = False  # holds weights quantized as its file stores them (GGUF, scaled FP8): never sharded

    @property
    def root(self) -> int:
        """The parameters outside the blocks (embedders, heads): resident while the model runs under block offload."""
        return self.total - self.blocks_total


def blocked_bytes(model: torch.nn.Module, blocks: Iterable[torch.nn.Module], dtype: torch.dtype, weights: str = "bf16",
                  paths: tuple[str, ...] | None = None) -> ModelBytes:
    """A model's bytes and its blocks', under `runtime.weights` (the Linears under `paths` quantized as torchao lays
    them out, counted on meta by runtime/quantize.py; None: the model is kept in `dtype`)."""
    per_name = tensor_bytes(model, weights if paths is not None else "bf16", paths or (), dtype)
    label = weights if paths is not None and weights != "bf16" else dtype_name(dtype)
    return grouped_bytes(model, blocks, per_name, label)


def grouped_bytes(model: torch.nn.Module, blocks: Iterable[torch.nn.Module], per_name: dict[str, int], label: str,
                  **kw) -> ModelBytes:
    """ModelBytes of a model from its tensors' bytes (state-dict name -> bytes), its blocks apart (none: whole)."""
    where = {id(m): name for name, m in model.named_modules()}
    sizes = []
    for b in blocks:
        prefix = where[id(b)] + "."
        sizes.append(sum(n for name, n in per_name.items() if name.startswith(prefix)))
    return ModelBytes(sum(per_name.values()), label, len(sizes), max(sizes, default=0), sum(sizes), **kw)


@dataclass(frozen=True)
class Budget:
    """A family's work per chunk at one frame size, and the device memory it takes beside the weights.

    a2v_peak: activations of one DiT forward on one rank, whole sequence (sequence parallelism divides it by the
      rank count); decode_peak: the decode and re-encode of one chunk; state: the DiT's rolling state kept on the
      device between chunks by one rank (key/value rings and sink; sequence parallelism divides it by heads);
      decode_state: the decoder's (its causal cache, and motion latents), kept whole where the decode runs;
      step_state: what one rank of the timestep pipeline keeps (its step's ring and the sink; 0 without one);
      ring_layer: where the rings wait in host memory (runtime.rings: host), what one layer's attention brings in.
    forward_flops: one DiT forward; forwards: DiT forwards per chunk (steps x guidance branches); chunk_frames: new
    video frames per chunk; decode_flops: decode (and re-encode) per chunk, in the VAE's dtype.
    """

    family: str
    mode: str
    size: tuple[int, int]  # (width, height) generated
    fps: float
    models: Mapping[str, ModelBytes]
    a2v_peak: int
    decode_peak: int
    state: int
    decode_state: int
    forward_flops: float
    forwards: int
    chunk_frames: int
    decode_flops: float
    step_state: int = 0
    ring_layer: int = 0  # one layer's ring and sink, brought in for one forward where they wait in host memory
    sink: int = 0  # of `state`, the sink (in host memory when the rings wait in a file)
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class SRBudget:
    """Frame-space super-resolution (`sr.model`) at one input size: it runs where the decode runs, on the decoded
    frames, chunk by chunk with a state of its own.

    models: its components' parameters at the dtype each runs in; peak: the most bytes one chunk's upscale, encode,
    transformer pass and decode allocate at once, at the output size (the largest chunk: the first); state: what it
    carries between chunks (its autoencoder's last frames, the previous chunk's latents, the input frames it holds
    back); flops: that chunk's; chunk_frames: the input frames of that chunk."""

    name: str
    scale: int
    size: tuple[int, int]  # (width, height) in: the family's frames
    out_size: tuple[int, int]  # (width, height) out
    models: Mapping[str, ModelBytes]
    peak: int
    state: int
    flops: float
    chunk_frames: int


def working_set(b: Budget, split: str, world: int, rank: int, decode: str, decode_models: Collection[str],
                rings_host: bool = False, sr: SRBudget | None = None) -> tuple[int, int, int]:
    """(state, activations, decode worker) bytes one rank's GPU holds beside its weights: what the layout choice
    keeps free (`working_bytes`), for `avatar plan` and for a render alike. split: `runtime.parallel` resolved
    (single | sequence | steps); decode: inline | worker; decode_models: the components the family's decode needs.

    The timestep pipeline: a step rank its step's ring and the sink, and one forward's activations; the decode
    rank the decoder cache and the decode's peak. Otherwise: the DiT's rolling state divided by heads over the
    ranks, a forward's activations divided by tokens, and the decode's cache and peak where the decode runs in the
    render process (inline); a decode worker (rank 0's GPU, its own process) holds the decode's models, cache and
    peak beside. rings_host: the rings and sink wait off the device (runtime.rings: host or disk), one layer's at
    a time here.

    sr: the job's frame super-resolution, run with the decode: its state and its chunk's peak beside the decode's
    where the decode runs (the decode rank; rank 0 inline; a decode worker, which also holds its models). Its
    models, where they run in the render process, are placed with the rank's others (not counted here)."""
    sr_state, sr_peak = (sr.state, sr.peak) if sr is not None else (0, 0)
    if split == "steps":
        return (b.step_state, b.a2v_peak, 0) if rank else (b.decode_state + sr_state, max(b.decode_peak, sr_peak), 0)
    inline, here = decode == "inline", decode == "inline" and rank == 0  # here: the super-resolution runs on it
    state = (0 if rings_host else b.state // world) + (b.decode_state if inline else 0) + (sr_state if here else 0)
    work = max(b.a2v_peak // world + (b.ring_layer if rings_host else 0), b.decode_peak if inline else 0,
               sr_peak if here else 0)
    worker = 0
    if decode == "worker" and rank == 0:
        # the worker decodes, then super-resolves: both models and states held, one of the two peaks at a time
        worker = sum(b.models[n].total for n in decode_models) + b.decode_state + max(b.decode_peak, sr_peak)
        if sr is not None:
            worker += sum(m.total for m in sr.models.values()) + sr_state
    return state, work, worker


def rings_place(setting: str, world: int, need: int, free: int | None, rings: int, host_free: int | None
                ) -> tuple[str, str]:
    """`runtime.rings` -> ("device" | "host" | "disk", why). need: the device bytes of this rank's models and working
    set with the rings on the device; free: the device's free memory (None: unknown, a CPU); rings: their bytes;
    host_free: the host's available memory (None: unknown). auto, on one rank where they do not fit the device: host
    (cheaper than streaming the DiT's blocks: a forward brings in its step's ring and the sink, a fraction of the
    blocks' bytes, and it may spare that), or disk where the host cannot hold them with a quarter to spare (the page
    cache keeps what it can)."""
    if setting != "auto":
        return setting, "asked for"
    if world > 1 or free is None or need <= free:
        return "device", "auto: on the device" + (" (several ranks share them out)" if world > 1 else "")
    why = f"auto: the models and the rings need {need / GB:.1f} GB on the device, {free / GB:.1f} GB is free"
    if host_free is not None and rings + HOST_RESERVE > 0.75 * host_free:
        return "disk", why + f"; the rings' {rings / GB:.1f} GB crowd the host's {host_free / GB:.1f} GB"
    return "host", why
