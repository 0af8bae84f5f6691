"""Text encodings computed once: a content-addressed cache of a family's prompt conditioning, on disk.

Why: the wan-s2v family's umT5-XXL is 11.4 GB of weights used once per prompt, and bulk renders repeat a
handful of prompts across hundreds of jobs and hosts. A job whose prompt is in the cache never loads its text
encoder (the runner asks `JobPrompts.ready` before `ModelCache.get` and skips the prompt-only components).

Key: sha256 over `EntryKey`: the family, the text encoder's weights digest, the tokenizer's digest, the exact
prompt, the family's negative prompt (wan-s2v encodes it with every prompt), and the dtype the encoder runs in
(bf16 and fp32 encodings differ). Not the device: an entry made on a GPU serves a CPU render (its metadata
names the device it was made on); a render on another device type than the entry's may then differ from an
uncached render there in the last bits of the text conditioning.
The weights digest is cheap and content-based, so copies of a model on several hosts share entries: the file's
size, its header (safetensors: every tensor's name, dtype, shape and offsets), its last 64 KiB (a torch .pth is
a zip whose central directory there holds each tensor's CRC-32) and 16 slices of 4 KiB spread over the file.
A weights change that leaves all of those bytes alone would go unseen; retraining or fine-tuning changes them.

Entry: `<folder>/<key>.safetensors`, the family's prompt output as flat named tensors (`Family.prompt_tensors`),
never a pickle. Its metadata holds every key field and `data_sha256` (over the tensors' names, dtypes, shapes
and bytes): a reader checks both, so a truncated, corrupt or misplaced entry is reported, encoded again and
rewritten, never used.
Writers on several hosts are safe: each writes a temp file of its own (host, pid, random) in the same folder,
fsyncs it and renames it over the entry (atomic on POSIX file systems, NFS included); the last one wins, and
every one of them wrote the same encoding.

Where: `runtime.text_cache` in the job: auto ($XDG_CACHE_HOME/avatar/text, else ~/.cache/avatar/text), off,
or a folder (e.g. on a shared file system; relative to the job file's folder).

Behind it, optionally, `avatar serve text` (`runtime.text_service.url`, avatar_cli/service/): a prompt the
cache lacks is asked of the service, whose answer is checked like an entry and written into the cache; the
render then loads no text encoder, exactly as for a hit. The service down or answering garbage: exit 2 at
validation, exit 1 during a render, each naming the URL; with `fallback: true` a note, and the prompt is
encoded here.
"""

import hashlib
import json
import os
import socket
import struct
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from avatar_cli.errors import InputError, RenderError
from avatar_cli.families.base import Family
from avatar_cli.families.registry import ModelSource

FORMAT = "avatar-text-cache/1"
AUTO, OFF = "auto", "off"


def default_folder() -> Path:
    """$XDG_CACHE_HOME/avatar/text, else ~/.cache/avatar/text (a relative XDG_CACHE_HOME is ignored, as the
    XDG spec says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache"
    return root / "avatar" / "text"


def cache_folder(setting: str, base_dir: Path) -> Path | None:
    """The job's `runtime.text_cache` -> its folder, or None when off. A relative folder is relative to the job
    file's folder, as the job's other paths are."""
    if not setting.strip():
        raise InputError("runtime.text_cache is empty: give auto, off or a folder")
    # YAML reads an unquoted off/no/false as a boolean, and the spec's string field then holds "False" (and
    # "True" for on/yes/true): both mean what the user wrote.
    if setting in (OFF, "False"):
        return None
    if setting in (AUTO, "True"):
        return default_folder()
    return base_dir / Path(setting).expanduser()


# --- the key -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EntryKey:
    family: str
    encoder: str  # digest of the text encoder's weights (or of its config and seed, for a random init)
    tokenizer: str  # digest of the tokenizer's files (or code and vocabulary)
    prompt: str
    negative: str  # the negative prompt the family encodes with it; "" if none
    dtype: str  # the dtype the encoder runs in

    def fields(self) -> dict[str, str]:
        return {"format": FORMAT, **asdict(self)}

    @property
    def digest(self) -> str:
        text = json.dumps(self.fields(), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def identity(source: ModelSource) -> tuple[str, str, str] | None:
    """What makes the source's prompt encodings equal (encoder digest, tokenizer digest, negative prompt): its
    family spec's prompt identity; None when the family declares none (its prompts are then never cached)."""
    of = source.spec.prompt_identity
    return of(source) if of is not None else None


def prompt_components(family: Family) -> tuple[str, ...]:
    """The components only the prompt step uses: what a job whose prompt is cached need not load."""
    others = {n for step, names in family.needs.items() if step != "prompt" for n in names}
    return tuple(n for n in family.needs.get("prompt", ()) if n not in others)


def encoder_dtype(family: Family, dtype: torch.dtype) -> torch.dtype:
    """The dtype the prompt step's components run in (placement keeps the family's float32 ones float32)."""
    names = family.needs.get("prompt", ())
    return torch.float32 if names and all(n in family.parallel.float32 for n in names) else dtype


# --- the store -----------------------------------------------------------------------------------------------

def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def metadata(blob: bytes) -> dict[str, str]:
    """A safetensors blob's metadata, from its header alone; ValueError naming what is wrong."""
    if len(blob) < 8:
        raise ValueError(f"{len(blob)} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise ValueError(f"truncated: its header says {n} bytes, the file has {len(blob) - 8} after the length")
    try:
        meta = json.loads(blob[8:8 + n]).get("__metadata__") or {}
    except Exception as e:  # JSON, UTF-8, or a header that is not an object
        raise ValueError(f"not a readable safetensors header ({type(e).__name__})")
    if not isinstance(meta, dict):
        raise ValueError("its safetensors metadata is not a mapping")
    return meta


def _parse(blob: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file's metadata and tensors; ValueError naming what is wrong."""
    meta = metadata(blob)
    try:
        tensors = safetensors.torch.load(blob)
    except Exception as e:  # safetensors' own error type, JSON, UTF-8: all mean the same here
        raise ValueError(f"not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    return meta, tensors


def entry_bytes(key: EntryKey, tensors: Mapping[str, torch.Tensor], device: str) -> bytes:
    """An entry: the tensors as safetensors bytes, the key's fields and their digest in the metadata (what the
    cache stores and what `avatar serve text` answers)."""
    flat = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    meta = {**key.fields(), "data_sha256": tensors_digest(flat), "device": device}
    return safetensors.torch.save(flat, metadata=meta)


def verify(blob: bytes, key: EntryKey) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """(tensors, None) when `blob` is a valid entry for `key`, else (None, what is wrong with it)."""
    try:
        meta, tensors = _parse(blob)
    except ValueError as e:
        return None, str(e)
    if meta.get("format") != FORMAT:
        return None, f"its format is {meta.get('format')!r}, not {FORMAT!r}"
    wrong = [k for k, v in key.fields().items() if meta.get(k) != v]
    if wrong:
        return None, f"its header names another key ({', '.join(wrong)} differ)"
    if meta.get("data_sha256") != tensors_digest(tensors):
        return None, "its data does not match the digest in its header"
    # Fresh storage: tensors read from bytes may be unaligned, and unaligned inputs take other, differently
    # rounding BLAS paths (modules.module.load_module); the encoder's own output never is.
    return {k: v.clone() for k, v in tensors.items()}, None


class TextCache:
    """The folder of entries. Reads verify, writes are atomic; neither ever raises on a bad entry."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, key: EntryKey) -> Path:
        return self.folder / f"{key.digest}.safetensors"

    def read(self, key: EntryKey) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """(tensors, None) for a valid entry; (None, None) when there is none; (None, why) when the entry there
        cannot be used (it is then encoded again and rewritten)."""
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None, None
        except OSError as e:
            return None, f"cannot read it ({e.strerror})"
        return verify(blob, key)

    def write(self, key: EntryKey, tensors: Mapping[str, torch.Tensor], device: str) -> Path:
        """Write the entry atomically; OSError if the folder cannot take it."""
        blob = entry_bytes(key, tensors, device)
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(key)
        tmp = self.folder / f".{key.digest}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "xb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        try:  # the rename itself survives a crash only once the folder is synced too
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass  # some file systems refuse to fsync a folder; the entry is written either way
        return final


# --- what the prompt step uses ---------------------------------------------------------------------------------

class PromptCache:
    """One model source's prompts through the cache: `lookup` before models load, `encode` in the prompt step
    (the cached encoding, else the family's prompt step, whose output is then stored).

    store None: no cache (runtime.text_cache: off). service: the job's runtime.text_service; with a url, a
    prompt the cache lacks is fetched from it. Neither: every prompt is encoded. write False: read only (the
    ranks other than 0: one writer per entry per job). note: where notes go (a corrupt entry, a failed write,
    a fallback).
    """

    def __init__(self, store: TextCache | None, source: ModelSource, dtype: torch.dtype,
                 note: Callable[[str], None] = lambda _: None, write: bool = True, service: Any = None):
        self.store = store
        self.family = source.family
        self.service = service if service is not None and service.url else None
        wanted = store is not None or self.service is not None
        self._identity = identity(source) if wanted else None
        if wanted and self._identity is None:
            note(f"note: the {self.family.name} family declares no prompt identity: its prompts are encoded for "
                 "every job, never cached")
        self.dtype = encoder_dtype(self.family, dtype)
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
        encoder, tokenizer, negative = self._identity
        return EntryKey(self.family.name, encoder, tokenizer, prompt, negative, str(self.dtype).removeprefix("torch."))

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
        from avatar_cli.service.text_client import ServiceError

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
                note: Callable[[str], None], write: bool = True, service: Any = None) -> PromptCache:
    folder = cache_folder(cache_setting, base_dir)
    return PromptCache(TextCache(folder) if folder is not None else None, source, dtype, note, write, service)


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
        from avatar_cli.service.text_client import TextServiceClient
    except ImportError as e:
        from avatar_cli.service import INSTALL_HINT

        raise InputError(f"runtime.text_service.url: talking to a text service needs {e.name}, which is not "
                         f"installed: {INSTALL_HINT}") from None
    return TextServiceClient(service.url, service.timeout_s, service.retries)


def check_service(job: Any, source: ModelSource) -> None:
    """At validation (runner.prepare): a job that names a text service and whose prompt the cache lacks needs
    the service up and serving this model's encoder, tokenizer and dtype, else InputError naming the URL.
    With fallback on, only the URL and the client are checked (a render then encodes locally, with a note)."""
    from avatar_cli.runtime.device import resolve_runtime

    rt = job.spec.runtime
    service = rt.text_service
    if not service.url:
        return
    with service_client(service) as client:
        from avatar_cli.service.text_client import ServiceError  # importable now: service_client checked it

        if service.fallback:
            return
        runtime = resolve_runtime(rt.device.value, rt.dtype.value, rt.threads)
        prompts = job_prompts(rt.text_cache, job.path.parent, source, runtime.dtype, lambda _: None,
                              service=service)
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


# --- avatar prompts encode -------------------------------------------------------------------------------------

@dataclass
class FillReport:
    jobs: int = 0  # jobs given
    distinct: int = 0  # distinct (model, dtype, cache folder, prompt) among them
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
    from avatar_cli.errors import AvatarError
    from avatar_cli.families.registry import check_model, resolve_model
    from avatar_cli.runtime.device import resolve_runtime
    from avatar_cli.spec import load_job

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
            source = resolve_model(job.model, job.path.parent)
            check_model(source)
            rt = job.spec.runtime
            runtime = resolve_runtime(rt.device.value, rt.dtype.value, rt.threads)
        except AvatarError as e:
            report.bad.append((str(path), e.exit_code, f"{path}: {e}"))
            continue
        service = rt.text_service
        key = (source.fingerprint, str(runtime.device), str(runtime.dtype), str(folder), service.url,
               service.fallback, service.timeout_s, service.retries)
        groups.setdefault(key, (source, runtime, folder, service, set()))[4].add(job.spec.prompt)
    for source, runtime, folder, service, texts in groups.values():
        prompts = PromptCache(TextCache(folder), source, runtime.dtype, note, service=service)
        report.distinct += len(texts)
        todo = [t for t in sorted(texts) if not prompts.lookup(t, runtime.device)]
        cached = len(texts) - len(todo) - prompts.fetched
        report.cached += cached
        report.fetched += prompts.fetched
        report.new += prompts.fetched
        if todo and prompts.enabled:
            _encode_all(prompts, source, runtime, todo)
            report.new += len(todo)
        by = f" ({prompts.fetched} from the text service at {service.url})" if prompts.fetched else ""
        note(f"{source.name}: {len(texts)} prompt(s), {len(todo) + prompts.fetched} new{by}, {cached} already "
             f"cached in {folder}")
    return report


def load_prompt_step(source: ModelSource, runtime: Any) -> Mapping[str, nn.Module]:
    """Only the prompt step's components, loaded and placed as a render places them (so their encodings are
    the render's, bit for bit)."""
    from avatar_cli.families.registry import load_modules
    from avatar_cli.runner import plan_for
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.runtime.placement import place
    from avatar_cli.stages.base import ModelView

    family = source.family
    needed = family.needs.get("prompt", ())
    modules = load_modules(source, skip=[n for n in family.components if n not in needed])
    place(modules, runtime, Dist(), "none", plan=plan_for(family.parallel, modules))
    return ModelView(modules)


def _encode_all(prompts: PromptCache, source: ModelSource, runtime: Any, texts: list[str]) -> None:
    """Load and place only the prompt step's components, encode (and store) each prompt, let them go."""
    models = load_prompt_step(source, runtime)
    with torch.no_grad():
        for text in texts:
            prompts.encode(models, text, runtime.device, runtime.dtype)
