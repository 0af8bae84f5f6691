"""What a family's render needs, counted on the meta device at one frame size: the figures `avatar plan` sizes a
layout with (a family's `FamilySpec.budget` makes one; families/wan_s2v/budget.py for wan-s2v).

Bytes are exact counts of the models' parameters at the dtype each runs in, and of the tensors a forward allocates
on meta (runtime/meta_count.py); FLOPs are torch's FlopCounterMode over the same meta forwards (runtime/flops.py).
Nothing here is measured on a device.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelBytes:
    """One component's parameters at the dtype it runs in, split the way offload and FSDP2 see them."""

    total: int
    dtype: str  # the dtype it runs in: "bfloat16", "float32", ...
    blocks: int = 0  # its transformer blocks (0: none; then it is offloaded whole)
    block: int = 0  # the largest block's bytes
    blocks_total: int = 0  # all blocks together
    file_total: int = 0  # bytes of its checkpoint tensors (the dtype on disk); 0: not read from a safetensors file

    @property
    def root(self) -> int:
        """The parameters outside the blocks (embedders, heads): resident while the model runs under block offload."""
        return self.total - self.blocks_total


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
