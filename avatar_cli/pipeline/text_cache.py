"""Moved: the text cache is its own layer, avatar_cli/prompts/. This module re-exports its names for callers not
moved yet, and goes once they are."""

from avatar_cli.prompts.cache import (PromptCache, check_service, job_prompts, outcome, ready, service_client,
                                      skipped)
from avatar_cli.prompts.encode import FillReport, fill, load_prompt_step
from avatar_cli.prompts.entry import FORMAT, EntryKey, entry_bytes, metadata, tensors_digest, verify
from avatar_cli.prompts.identity import encoder_dtype, identity, prompt_components
from avatar_cli.prompts.store import AUTO, OFF, TextCache, cache_folder, default_folder

__all__ = ["PromptCache", "check_service", "job_prompts", "outcome", "ready", "service_client", "skipped",
           "FillReport", "fill", "load_prompt_step", "FORMAT", "EntryKey", "entry_bytes", "metadata",
           "tensors_digest", "verify", "encoder_dtype", "identity", "prompt_components", "AUTO", "OFF", "TextCache",
           "cache_folder", "default_folder"]
