"""The read-through cache the prompt step uses: `PromptCache` looks a prompt up before models load (the entry in
the store, else the text service's answer) and encodes it in the prompt step when neither has it, storing the
result for the next job.

Behind it, optionally, `avatar serve text` (`runtime.text_service.url`, avatar_cli/service/): a prompt the
cache lacks is asked of the service, whose answer is checked like an entry and written into the cache; the
render then loads no text encoder, exactly as for a hit. The service down or answering garbage: exit 2 at
validation, exit 1 during a render, each naming the URL; with `fallback: true` a note, and the prompt is
encoded here.
"""

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from avatar_cli.errors import InputError, RenderError
from avatar_cli.families.source import ModelSource
from avatar_cli.prompts.entry import EntryKey
from avatar_cli.prompts.identity import encoder_dtype, encoder_weights, entry_key, identity, prompt_components
from avatar_cli.prompts.store import TextCache, cache_folder
from avatar_cli.runtime.device import resolve_runtime
from avatar_cli.service import INSTALL_HINT


class PromptCache:
    """One model source's prompts through the cache: `lookup` before models load, `encode` in the prompt step
    (the cached encoding, else the family's prompt step, whose output is then stored).

    store None: no cache (runtime.text_cache: off). service: the job's runtime.text_service; with a url, a
    prompt the cache lacks is fetched from it. Neither: every prompt is encoded. write False: read only (the
    ranks other than 0: one writer per entry per job). note: where notes go (a corrupt entry, a failed write,
    a fallback). weights: the job's runtime.weights (a quantized encoder's encodings are other entries than a bf16
    one's: prompts/identity.py encoder_label).
    """

    def __init__(self, store: TextCache | None, source: ModelSource, dtype: torch.dtype,
                 note: Callable[[str], None] = lambda _: None, write: bool = True, service: Any = None,
                 weights: str = "bf16"):
        self.store = store
        self.family = source.family
        self.service = service if service is not None and service.url else None
        wanted = store is not None or self.service is not None
        self._identity = identity(source) if wanted else None
        if wanted and self._identity is None:
            note(f"note: the {self.family.name} family declares no prompt identity: its prompts are encoded for "
                 "every job, never cached")
        self.dtype = encoder_dtype(self.family, dtype)
        self.weights = encoder_weights(self.family, weights)  # the encoder's format; bf16 if the family keeps it
        self.note = note
        self.write = write
        self.known: dict[str, Any] = {}  # prompt -> its encoding, read or made in this process
        self.checked: set[str] = set()  # prompts looked up already (a miss, or a bad entry, is said once)
        self.encoded = 0  # runs of the family's prompt step (the text encoder)
        self.fetched = 0  # encodings the text service answered

    @property
    def enabled(self) -> bool:
        return self._identity is not None

    def key(self, prompt: str) -> EntryKey:
        return entry_key(self.family, self._identity, prompt, self.dtype, self.weights)

    def read(self, prompt: str) -> dict[str, torch.Tensor] | None:
        """The entry's tensors, else the text service's answer (then written into the cache), else None: no entry
        and no service, or an unusable entry, or a failed service with fallback on (each said in a note).
        RenderError naming the URL: the service failed and the job allows no fallback."""
        if not self.enabled:
            return None
        key = self.key(prompt)
        tensors = None
        if self.store is not None:
            tensors, problem = self.store.read(key)
            if problem is not None:
                self.note(f"note: text cache entry {self.store.path(key)} is unusable ({problem}): "
                          + ("asking the text service" if self.service is not None else
                             "encoding the prompt again and rewriting it"))
        if tensors is None and self.service is not None:
            tensors = self._fetch(key)
        return tensors

    def _fetch(self, key: EntryKey) -> dict[str, torch.Tensor] | None:
        from avatar_cli.service.text_client import ServiceError  # httpx: imported only when a job names a service

        try:
            with service_client(self.service) as client:
                tensors, device = client.encode(key)
        except ServiceError as e:
            if not self.service.fallback:
                raise RenderError(str(e)) from None
            self.note(f"note: {e}; encoding the prompt here instead (runtime.text_service.fallback)")
            return None
        self.fetched += 1
        self._store(key, tensors, device)
        return tensors

    def _store(self, key: EntryKey, tensors: Mapping[str, torch.Tensor], device: str) -> None:
        if self.store is None or not self.write:
            return
        try:
            self.store.write(key, tensors, device)
        except OSError as e:  # a full or read-only cache folder costs the next job an encode, not this render
            self.note(f"note: cannot write the text cache in {self.store.folder} ({e.strerror or e}); "
                      "the prompt will be encoded again next time")

    def remember(self, prompt: str, tensors: Mapping[str, torch.Tensor] | None, device: torch.device) -> None:
        """What a lookup found (None: nothing usable)."""
        self.checked.add(prompt)
        if tensors is not None:
            self.known[prompt] = self.family.prompt_from_tensors(dict(tensors), device, self.dtype)

    def lookup(self, prompt: str, device: torch.device) -> bool:
        """Whether the prompt's encoding is at hand: read from the cache once, then remembered."""
        if prompt not in self.checked:
            self.remember(prompt, self.read(prompt), device)
        return prompt in self.known

    def encode(self, models: Mapping[str, nn.Module], prompt: str, device: torch.device, dtype: torch.dtype) -> Any:
        """The prompt step through the cache: the known encoding, else the family's, stored for next time."""
        if self.lookup(prompt, device):
            return self.known[prompt]
        missing = [n for n in self.family.needs.get("prompt", ()) if n not in models]
        if missing:  # the runner skipped the encoder for a hit that is gone now; cannot happen within one process
            raise RenderError(f"the text cache lost the prompt's entry and the text encoder ({', '.join(missing)}) "
                              "was not loaded")
        out = self.family.prompt(models, prompt, device, dtype)
        self.encoded += 1
        self.known[prompt] = out
        tensors = self.family.prompt_tensors(out) if self.store is not None and self.enabled else None
        if tensors is not None:
            self._store(self.key(prompt), tensors, str(device))
        return out


def job_prompts(cache_setting: str, base_dir: Path, source: ModelSource, dtype: torch.dtype,
                note: Callable[[str], None], write: bool = True, service: Any = None, *,
                weights: str) -> PromptCache:
    """The job's PromptCache. weights: its runtime.weights, always given (a default would key a quantized
    encoder's encodings as bf16 ones)."""
    folder = cache_folder(cache_setting, base_dir)
    return PromptCache(TextCache(folder) if folder is not None else None, source, dtype, note, write, service,
                       weights)


def ready(prompts: PromptCache, prompt: str, device: torch.device, dist: Any) -> bool:
    """Whether the prompt's encoding is at hand (cached, or answered by the text service), the same answer on
    every rank: rank 0 reads the entry (or asks the service) and hands its tensors, or its failure, to the
    others (ranks on several hosts may not share the cache folder, and a writer elsewhere must not make one rank
    load the encoder while another skips it: their collectives would no longer match)."""
    if not prompts.enabled:
        return False
    if not dist.enabled:
        return prompts.lookup(prompt, device)
    found: Any = None
    if dist.is_main:
        try:
            found = prompts.read(prompt)
        except RenderError as e:  # said on every rank, not left as rank 0's alone while the others wait
            found = str(e)
    found = dist.broadcast_object(found)
    if isinstance(found, str):
        raise RenderError(found)
    prompts.remember(prompt, found, device)
    return found is not None


def outcome(prompts: PromptCache, cached: bool) -> str:
    """The render summary's `text_cache`: hit, service (fetched from the text service), miss, or off."""
    if prompts.fetched:
        return "service"
    return "hit" if cached else "miss" if prompts.enabled else "off"


# --- the text service behind the cache (avatar_cli/service/) -------------------------------------------------

def service_client(service: Any) -> Any:
    """A TextServiceClient for the job's runtime.text_service (InputError: a bad URL, or httpx not installed)."""
    try:
        from avatar_cli.service.text_client import TextServiceClient  # httpx, optional: only when a job names one
    except ImportError as e:
        raise InputError(f"runtime.text_service.url: talking to a text service needs {e.name}, which is not "
                         f"installed: {INSTALL_HINT}") from None
    return TextServiceClient(service.url, service.timeout_s, service.retries)


def check_service(job: Any, source: ModelSource, runtime: Any = None) -> None:
    """At validation (job.resolve): a job that names a text service and whose prompt the cache lacks needs
    the service up and serving this model's encoder, tokenizer, dtype and weights format, else InputError naming
    the URL (and both keys' dtype fields, e.g. bfloat16 against bfloat16+int8).
    With fallback on, only the URL and the client are checked (a render then encodes locally, with a note).
    runtime: the job's, as job.resolve resolved it (None: resolved here)."""
    rt = job.spec.runtime
    service = rt.text_service
    if not service.url:
        return
    with service_client(service) as client:
        from avatar_cli.service.text_client import ServiceError  # httpx: importable now, service_client checked it

        if service.fallback:
            return
        if runtime is None:
            runtime = resolve_runtime(rt.device.value, rt.dtype.value, rt.threads)
        prompts = job_prompts(rt.text_cache, job.path.parent, source, runtime.dtype, lambda _: None,
                              service=service, weights=rt.weights.value)
        key = prompts.key(job.spec.prompt)
        if prompts.store is not None and prompts.store.read(key)[0] is not None:
            return  # cached: this job never asks the service
        try:
            client.check(key)
        except ServiceError as e:
            raise InputError(str(e)) from None


def skipped(prompts: PromptCache, prompt: str) -> Collection[str]:
    """The components a job need not load: the prompt-only ones, when its prompt is known."""
    return prompt_components(prompts.family) if prompt in prompts.known else ()
