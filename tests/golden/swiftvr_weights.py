"""The seeded weights of the SwiftVR goldens (tests/golden/make_swiftvr_goldens.py), as a rule rather than a file.

The ReAE that the official loader builds has its full size (40,946,364 parameters, 164 MB in float32), too large to
commit, so its golden weights are drawn from this rule and the golden keeps only the rule's parameters and the sha256
of what it drew (tests/golden/swiftvr/official.json, `reae_rule`). The tiny DiT's weights come from the same rule (and
are committed as well, in the release layout). A test regenerates them with `seeded_weights(shapes, seed)`, the
shapes taken from tests/golden/swiftvr/release/keys.json, and checks `tensor_sha256` against the recorded one.
"""

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

GOLDEN = Path(__file__).parent / "swiftvr"

GAIN = 1.0
# Offsets on 1-d tensors: the ReAE's last bias on 0.5, so the decoder's output sits inside its clamp to [0, 1] rather
# than on it. Norm gains (NORM_SUFFIXES) are centred on 1.
OFFSETS = {"decoder.22.bias": 0.5}
NORM_SUFFIXES = ("norm_q.weight", "norm_k.weight", "norm2.weight")
# Extra factors: the DiT's head smaller, so its prediction has the size of the ReAE latents it is subtracted from
# rather than swamping them.
SCALES = {"proj_out.weight": 0.15, "proj_out.bias": 0.15}
RULE = {"gain": GAIN, "offsets": OFFSETS, "norm_suffixes": list(NORM_SUFFIXES), "scales": SCALES}


def seeded_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """One CPU generator seeded with `seed`; the keys in sorted order, each drawn `torch.randn(shape)` in float32;
    `scale_shift_table` divided by sqrt(shape[-1]); other tensors of 2 or more dims times GAIN / sqrt(prod(shape[1:]));
    1-d tensors 0.1 * x plus 1 (NORM_SUFFIXES) or OFFSETS[key] (else 0); then times SCALES[key] where given."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in sorted(shapes):
        shape = tuple(shapes[key])
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        if key.endswith("scale_shift_table"):
            x = x / math.sqrt(shape[-1])
        elif len(shape) >= 2:
            x = x * (GAIN / math.sqrt(math.prod(shape[1:])))
        else:
            base = 1.0 if key.endswith(NORM_SUFFIXES) else OFFSETS.get(key, 0.0)
            x = base + 0.1 * x
        out[key] = x * SCALES.get(key, 1.0)
    return out


def tensor_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the keys in sorted order: each key (utf-8), then its tensor's float32 bytes in C order."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def write_release(dest: Path) -> Path:
    """The golden's tiny release directory at `dest`, in the published layout: the transformer (config.json and
    weights) and the prompt embedding as the official code wrote them, and reae.safetensors drawn from the rule,
    checked against the sha256 the golden recorded."""
    shutil.copytree(GOLDEN / "release", dest, ignore=shutil.ignore_patterns("keys.json"))
    shapes = json.loads((GOLDEN / "release" / "keys.json").read_text())["reae.safetensors"]
    rule = json.loads((GOLDEN / "official.json").read_text())["reae_rule"]
    state = seeded_weights(shapes, rule["seed"])
    if tensor_sha256(state) != rule["sha256"]:
        raise AssertionError("the ReAE rule no longer draws the golden's weights")
    save_file(state, str(dest / "reae.safetensors"))
    return dest
