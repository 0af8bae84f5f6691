"""What a resumed render must share with the interrupted one: spec, inputs and model."""

import hashlib
import json
import struct

from omegaconf import OmegaConf

from avatar_cli.modules.registry import ModelSource
from avatar_cli.pipeline.checkpoint import file_digest
from avatar_cli.spec import Job


def spec_digest(job: Job) -> str:
    spec = OmegaConf.to_container(OmegaConf.structured(job.spec), enum_to_str=True)
    spec.pop("output")  # the output path names the checkpoint; everything else must match
    for key in ("reference", "audio"):
        spec[key] = str(getattr(job, key))
    spec["model"] = job.model
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def model_digest(source: ModelSource) -> str:
    """Config plus each checkpoint's size, mtime and header: cheap even for multi-GB weights."""
    h = hashlib.sha256(source.fingerprint.encode())
    h.update(source.config.to_json().encode())
    for path in source.weight_files():
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(min(n, 1 << 24)))
    return h.hexdigest()


def job_fingerprint(job: Job, source: ModelSource) -> dict[str, str]:
    return {"spec": spec_digest(job), "reference": file_digest(job.reference), "audio": file_digest(job.audio),
            "model": model_digest(source)}


def describe_change(old: dict[str, str], new: dict[str, str]) -> str | None:
    """None if nothing changed, else which of spec/reference/audio/model changed."""
    names = {"spec": "the job spec", "reference": "the reference image", "audio": "the audio", "model": "the model"}
    changed = [names.get(k, k) for k in new if old.get(k) != new[k]]
    return ", ".join(changed) or None
