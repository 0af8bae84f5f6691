"""Context generation: the prompt's conditioning once per job; per chunk, audio features, noise and the
frames the chunk is given (the family builds them)."""

from typing import Any

from avatar_cli.families.base import AudioSource, Chunk, RollingState
from avatar_cli.stages.base import Stage


class PromptEncode(Stage):
    step = "prompt"

    def run(self, prompt: str) -> Any:
        return self.family.prompt(self.models, prompt, self.runtime.device, self.runtime.dtype)


class ContextGen(Stage):
    step = "context"

    def run(self, chunk: Chunk, audio: AudioSource, fps: float, text: Any, state: RollingState, seed: int) -> Any:
        rt = self.runtime
        return self.family.context(self.models, chunk, audio, fps, text, state, seed, rt.device, rt.dtype)

    def release_before(self, audio: AudioSource, frame: int, fps: float) -> None:
        """No later chunk reads audio for frames before `frame`: let the reader drop it."""
        self.family.release_audio(self.models, audio, frame, fps)


