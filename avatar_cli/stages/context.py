"""Context generation, per chunk: audio features, noise and the frames the chunk is given (the family builds
them)."""

from typing import Any

from avatar_cli.families.base import Chunk, RollingState, Step
from avatar_cli.media.source import AudioSource
from avatar_cli.stages.base import Stage


class ContextGen(Stage):
    step = Step.context

    def run(self, chunk: Chunk, audio: AudioSource, fps: float, text: Any, state: RollingState, seed: int) -> Any:
        rt = self.runtime
        return self.family.context(self.models, chunk, audio, fps, text, state, seed, rt.device, rt.dtype)

    def release_before(self, audio: AudioSource, frame: int, fps: float) -> None:
        """No later chunk reads audio for frames before `frame`: let the reader drop it."""
        self.family.release_audio(self.models, audio, frame, fps)
