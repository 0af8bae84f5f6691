"""Prompt encode, once per job: the prompt's conditioning, through the text cache (prompts/)."""

from collections.abc import Mapping
from typing import Any

from avatar_cli.families.base import Family, Step
from avatar_cli.modules.module import Module
from avatar_cli.prompts.cache import PromptCache
from avatar_cli.runtime.device import Runtime
from avatar_cli.stages.base import ModelView, Stage


class PromptEncode(Stage):
    """prompts: the text cache (prompts/cache.py PromptCache), or None to encode every time. When the
    runner found the job's prompt there it did not load the encoder: this stage then needs nothing."""

    step = Step.prompt

    def __init__(self, family: Family, modules: Mapping[str, Module], runtime: Runtime,
                 prompts: PromptCache | None = None):
        self.prompts = prompts
        if prompts is not None and any(n not in modules for n in family.needs.get(self.step, ())):
            # Not loaded: the runner found the prompt in the cache. Nothing to bring onto the device.
            self.family, self.runtime, self.needs, self.models = family, runtime, (), ModelView({})
            return
        super().__init__(family, modules, runtime)

    def needs_for(self, prompt: str) -> tuple[str, ...]:
        """The components to bring onto the device for this prompt: none when its encoding is at hand."""
        return () if self.prompts is not None and prompt in self.prompts.known else self.needs

    def run(self, prompt: str) -> Any:
        rt = self.runtime
        if self.prompts is None:
            return self.family.prompt(self.models, prompt, rt.device, rt.dtype)
        return self.prompts.encode(self.models, prompt, rt.device, rt.dtype)
