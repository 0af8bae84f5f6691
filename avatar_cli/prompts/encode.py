"""`avatar prompts encode JOB...`: fill the text cache ahead of the renders, loading each model's text encoder once
(and nothing else of it)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from avatar_cli.errors import AvatarError, InputError
from avatar_cli.job import job_runtime, resolve_source
from avatar_cli.families.registry import load_modules
from avatar_cli.families.source import ModelSource
from avatar_cli.prompts.cache import PromptCache
from avatar_cli.prompts.store import TextCache, cache_folder
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.placement import place, plan_for
from avatar_cli.runtime.quantize import check_setting
from avatar_cli.spec import load_job
from avatar_cli.stages.base import ModelView


@dataclass
class FillReport:
    jobs: int = 0  # jobs given
    distinct: int = 0  # distinct (model, dtype, weights, cache folder, prompt) among them
    new: int = 0  # encoded now (here, or by the text service: `fetched` of them)
    fetched: int = 0  # answered by the jobs' runtime.text_service
    cached: int = 0  # already in the cache
    off: int = 0  # jobs with runtime.text_cache: off (nothing to fill)
    bad: list[tuple[str, int, str]] = field(default_factory=list)  # (job, exit code, message)


def fill(paths: list[Path], overrides: list[str], note: Callable[[str], None]) -> FillReport:
    """Encode every distinct prompt of these jobs that its cache lacks, loading each model's text encoder once
    (and nothing else of it), on the device and in the dtype the job's runtime settings give on this host.
    Jobs with a runtime.text_service ask it instead, as their renders would (so this host loads no encoder for
    them; with `fallback: true` what the service fails is encoded here). A bad job is reported in `bad` and the
    others are still filled; a failed service is the RenderError a render would get."""
    report = FillReport(jobs=len(paths))
    groups: dict[tuple, tuple[ModelSource, Any, Path, Any, set[str]]] = {}
    for path in paths:
        try:
            job = load_job(path, overrides, None)
            folder = cache_folder(job.spec.runtime.text_cache, job.path.parent)
            if folder is None:
                report.off += 1
                note(f"note: {path}: runtime.text_cache is off: nothing to fill")
                continue
            source = resolve_source(job)  # the job's model as a render resolves it (job.py)
            rt = job.spec.runtime
            runtime = job_runtime(job)
            try:  # as job.resolve: a format the family cannot quantize, or torchao missing, before any load
                check_setting(rt.weights.value, source.family.name, source.family.parallel.quantized)
            except ValueError as e:
                raise InputError(f"{path}: {e}") from None
        except AvatarError as e:
            report.bad.append((str(path), e.exit_code, f"{path}: {e}"))
            continue
        service = rt.text_service
        weights = rt.weights.value
        key = (source.fingerprint, str(runtime.device), str(runtime.dtype), weights, str(folder), service.url,
               service.fallback, service.timeout_s, service.retries)
        groups.setdefault(key, (source, runtime, weights, folder, service, set()))[5].add(job.spec.prompt)
    for source, runtime, weights, folder, service, texts in groups.values():
        prompts = PromptCache(TextCache(folder), source, runtime.dtype, note, service=service, weights=weights)
        report.distinct += len(texts)
        todo = [t for t in sorted(texts) if not prompts.lookup(t, runtime.device)]
        cached = len(texts) - len(todo) - prompts.fetched
        report.cached += cached
        report.fetched += prompts.fetched
        report.new += prompts.fetched
        if todo and prompts.enabled:
            _encode_all(prompts, source, runtime, todo, weights)
            report.new += len(todo)
        by = f" ({prompts.fetched} from the text service at {service.url})" if prompts.fetched else ""
        note(f"{source.name}: {len(texts)} prompt(s), {len(todo) + prompts.fetched} new{by}, {cached} already "
             f"cached in {folder}")
    return report


def load_prompt_step(source: ModelSource, runtime: Any, weights: str) -> Mapping[str, nn.Module]:
    """Only the prompt step's components, loaded, quantized (`runtime.weights`: weights) and placed as a render
    places them (so their encodings are the render's, bit for bit)."""
    family = source.family
    needed = family.needs.get("prompt", ())
    modules = load_modules(source, skip=[n for n in family.components if n not in needed])
    place(modules, runtime, Dist(), "none", plan=plan_for(family.parallel, modules), weights=weights)
    return ModelView(modules)


def _encode_all(prompts: PromptCache, source: ModelSource, runtime: Any, texts: list[str], weights: str) -> None:
    """Load and place only the prompt step's components, encode (and store) each prompt, let them go."""
    models = load_prompt_step(source, runtime, weights)
    with torch.no_grad():
        for text in texts:
            prompts.encode(models, text, runtime.device, runtime.dtype)
