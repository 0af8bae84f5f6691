"""What survives between chunks. Nothing here grows with the video's length."""

from dataclasses import dataclass, field

import torch


@dataclass
class RollingState:
    tail: torch.Tensor | None = None  # (M', C, h, w) last frames of the latest N chunk: the next N chunk's motion frames
    anchors: torch.Tensor | None = None  # (2, C, h, w) the pending I chunk's two anchors
    # Final-but-unpublished low-res latents, as (first timeline frame, (n, C, h, w)); at most two stretches.
    held: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    decode_cache: torch.Tensor | None = None  # the VAE decoder's temporal cache (last decoded latent)
    published: int = 0  # frames handed to the encoder so far

    def take_final(self, upto: int) -> torch.Tensor | None:
        """Pop the held stretches that end at or before `upto`, in timeline order, as one tensor."""
        self.held.sort(key=lambda s: s[0])
        ready = [z for start, z in self.held if start + z.shape[0] <= upto]
        self.held = [(s, z) for s, z in self.held if s + z.shape[0] > upto]
        return torch.cat(ready) if ready else None
