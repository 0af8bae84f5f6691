"""What a resumed render must share with the interrupted one: spec, inputs, model and LoRA."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf

from avatar_cli.families.registry import ModelSource
from avatar_cli.modules.tensor_files import header_length
from avatar_cli.pipeline.checkpoint import file_digest
from avatar_cli.spec import Job

LORA_KEYS = ("lora", "lora_rank", "lora_scale")


def spec_digest(job: Job) -> str:
    spec = OmegaConf.to_container(OmegaConf.structured(job.spec), enum_to_str=True)
    spec.pop("output")  # the output path names the checkpoint; everything else must match
    for key in ("reference", "audio"):
        spec[key] = str(getattr(job, key))
    spec["model"] = job.model
    if spec.get("mode") == "clip":  # the default: such a job digests as before the key existed
        spec.pop("mode")
    if spec["runtime"].get("shard") == "auto":  # the default, as for mode
        spec["runtime"].pop("shard")
    if spec["runtime"].get("weights") == "bf16":  # the default, as for mode; fp8 and int8 change the frames
        spec["runtime"].pop("weights")
    if spec["runtime"].get("vae_dtype") == "auto":  # the default, as for mode; another dtype changes the frames
        spec["runtime"].pop("vae_dtype")
    # Where prompt encodings come from, how ranks split the work, which process decodes and where the rings wait
    # change no frame.
    for key in ("text_cache", "text_service", "parallel", "decode", "rings"):
        spec["runtime"].pop(key)
    spec.pop("live")  # a live session's settings: a render that can resume is not one
    if job.sr_model is None:  # no super-resolution: such a job digests as before the keys existed
        spec.pop("sr")
    else:
        spec["sr"]["model"] = str(job.sr_model)
    if spec.get("dit") is None:  # the model directory's own DiT: such a job digests as before the key existed
        spec.pop("dit", None)
    else:
        spec["dit"] = str(job.dit)
    if job.lora is None:  # rank and scale mean nothing without a LoRA: such a job digests as before these keys
        for key in LORA_KEYS:
            spec.pop(key)
    else:
        spec["lora"] = str(job.lora)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _stamp(h, path: Path) -> None:
    """A file's name, size, mtime and (safetensors) header into `h`: cheap even for multi-GB weights."""
    st = path.stat()
    h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            h.update(f.read(min(header_length(f.read(8)), 1 << 24)))


def model_digest(source: ModelSource) -> str:
    """Config plus each checkpoint's size, mtime and header."""
    h = hashlib.sha256(source.fingerprint.encode())
    h.update(source.config.to_json().encode())
    for path in source.weight_files():
        _stamp(h, path)
    return h.hexdigest()


def lora_digest(job: Job) -> str:
    """The LoRA file (path, size, mtime, header) and the rank and scale it is merged with."""
    s = job.spec
    h = hashlib.sha256(f"{job.lora}:{s.lora_rank}:{s.lora_scale!r}".encode())
    try:
        _stamp(h, job.lora)
    except OSError:  # gone since: differs from any digest of the file, and job.resolve says why
        h.update(b"missing")
    return h.hexdigest()


def sr_digest(job: Job) -> str:
    """Frame super-resolution's identity: its scale and every file of its model directory (name, size, mtime,
    safetensors header)."""
    h = hashlib.sha256(f"{job.sr_model}:{job.spec.sr.scale}".encode())
    try:
        for path in sorted(p for p in job.sr_model.rglob("*") if p.is_file()):
            _stamp(h, path)
    except OSError:  # gone since: differs from any digest of the folder, and job.resolve says why
        h.update(b"missing")
    return h.hexdigest()


def job_fingerprint(job: Job, source: ModelSource) -> dict[str, str]:
    """The model digest is the base weights' (a job with a LoRA gets its own "lora" entry, one with frame
    super-resolution an "sr" entry), so an interrupted render without them resumes as before."""
    out = {"spec": spec_digest(job), "reference": file_digest(job.reference), "audio": file_digest(job.audio),
           "model": model_digest(_without_lora(source))}
    if job.lora is not None:
        out["lora"] = lora_digest(job)
    if job.sr_model is not None:
        out["sr"] = sr_digest(job)
    if source.family.revision:  # revision 0 adds nothing: such a family's points resume as before the key existed
        out["family"] = f"{source.family.name}/{source.family.revision}"
    return out


def _without_lora(source: ModelSource) -> ModelSource:
    """The source as resolved from the model alone (job.resolve_source adds the job's LoRA, which has its own
    entry)."""
    return source if source.lora is None else replace(source, lora=None)


def describe_change(old: dict[str, str], new: dict[str, str]) -> str | None:
    """None if nothing changed, else which of spec/reference/audio/model/lora changed."""
    names = {"spec": "the job spec", "reference": "the reference image", "audio": "the audio", "model": "the model",
             "lora": "the LoRA", "sr": "the super-resolution model or scale",
             "family": "the model family's computation (this version of avatar renders it differently)"}
    changed = [names.get(k, k) for k in (*new, *(k for k in old if k not in new)) if old.get(k) != new.get(k)]
    return ", ".join(changed) or None
