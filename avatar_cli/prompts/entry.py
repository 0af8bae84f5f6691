"""An entry of the text cache: its key, and its bytes (what the cache stores and `avatar serve text` answers).

Key: sha256 over `EntryKey`: the family, the text encoder's weights digest, the tokenizer's digest, the exact
prompt, the family's negative prompt (wan-s2v encodes it with every prompt), and the dtype the encoder runs in
with the format of its weights when `runtime.weights` quantizes them ("bfloat16", "bfloat16+int8": bf16, fp32 and
quantized encodings differ; prompts/identity.py encoder_label). Not the device: an entry made on a GPU serves a
CPU render (its metadata names the device it was made on); a render on another device type than the entry's may
then differ from an uncached render there in the last bits of the text conditioning.
The weights digest is cheap and content-based (modules/digest.py), so copies of a model on several hosts share
entries.

Entry: the family's prompt output as flat named tensors (`Family.prompt_tensors`), as safetensors bytes, never a
pickle. Its metadata holds every key field and `data_sha256` (over the tensors' names, dtypes, shapes and bytes):
a reader checks both, so a truncated, corrupt or misplaced entry is reported, encoded again and rewritten, never
used.
"""

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import safetensors.torch
import torch

from avatar_cli.modules.tensor_files import aligned, header_length

FORMAT = "avatar-text-cache/1"


@dataclass(frozen=True)
class EntryKey:
    family: str
    encoder: str  # digest of the text encoder's weights (or of its config and seed, for a random init; mini's: + code)
    tokenizer: str  # digest of the tokenizer's files (or code and vocabulary)
    prompt: str
    negative: str  # the negative prompt the family encodes with it; "" if none
    dtype: str  # the dtype the encoder runs in, "+int8" / "+fp8" when its weights are quantized

    def fields(self) -> dict[str, str]:
        return {"format": FORMAT, **asdict(self)}

    @property
    def digest(self) -> str:
        text = json.dumps(self.fields(), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def metadata(blob: bytes) -> dict[str, str]:
    """A safetensors blob's metadata, from its header alone; ValueError naming what is wrong."""
    n = header_length(blob)
    if 8 + n > len(blob):
        raise ValueError(f"truncated: its header says {n} bytes, the file has {len(blob) - 8} after the length")
    try:
        meta = json.loads(blob[8:8 + n]).get("__metadata__") or {}
    except Exception as e:  # JSON, UTF-8, or a header that is not an object
        raise ValueError(f"not a readable safetensors header ({type(e).__name__})")
    if not isinstance(meta, dict):
        raise ValueError("its safetensors metadata is not a mapping")
    return meta


def parse(blob: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
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
        meta, tensors = parse(blob)
    except ValueError as e:
        return None, str(e)
    if meta.get("format") != FORMAT:
        return None, f"its format is {meta.get('format')!r}, not {FORMAT!r}"
    wrong = [k for k, v in key.fields().items() if meta.get(k) != v]
    if wrong:
        return None, f"its header names another key ({', '.join(wrong)} differ)"
    if meta.get("data_sha256") != tensors_digest(tensors):
        return None, "its data does not match the digest in its header"
    # Tensors read from bytes may be unaligned, and unaligned inputs take other, differently rounding BLAS paths;
    # the encoder's own output never is.
    return aligned(tensors), None
