"""The official code's own environment for the golden makers, kept apart from the project's venv.

A golden made under the project's dependencies tests the project against itself wherever the official code hands work
to a library (transformers 5 changed what wav2vec2's `hidden_states` returns, for one). So every maker here runs the
official code under the pins of that repository's requirements file, and records what it ran with.

Build the environment once (a venv of its own; torch is taken from the project's pin, which both repositories'
`torch>=2.4.0` admit):

    python3 tests/golden/official_env.py create /tmp/official-venv --repo /work/.mirror/Wan-Video+Wan2.2/repo

It installs, with the pins of the repository's requirements.txt, only the packages the makers' code paths import
(IMPORTED below; both requirements files pin them alike). The rest of the file (flash_attn, deepspeed, decord, the
speech and pose tooling) is never imported by the tiny runs and is not installed. Where a requirement is a range, the
newest release it admits is taken, except diffusers: its range (`>=0.31.0`) is open above, so a golden would depend on
the day it was made; it is held at 0.33.1, a release inside the range from before the official code was published.

SwiftVR (H-oliday/SwiftVR) pins every requirement with `==`, torch included, so its environment takes torch from that
pin (2.10.0, the PyPI wheel: a CUDA build, which runs on a CPU with its nvidia libraries installed beside it), not
from the project's. Its makers import only torch, diffusers (with accelerate, which diffusers' loader needs for the
release's fp32-module rule), safetensors, numpy, pillow, decord and imageio (both imported by `swiftvr/io.py` at
import time); transformers, torchvision, einops and imageio-ffmpeg are never imported and not installed:

    python3 tests/golden/official_env.py create /tmp/swiftvr-venv --profile swiftvr \
        --repo /work/.mirror/H-oliday+SwiftVR/repo

Each maker calls `provenance(repo)` before it writes: it refuses to run when an installed version falls outside the
requirements file's pin (the check that would have caught a golden made under transformers 5), and returns the
versions and the commit to store in each golden's metadata (`official` in the safetensors header, a JSON key elsewhere).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# The distributions the makers' official code paths import, as named in the requirements files.
IMPORTED = ("torch", "transformers", "tokenizers", "diffusers", "numpy", "ftfy", "easydict", "peft", "safetensors")
HELD = {"diffusers": "0.33.1"}  # see the module docstring
TORCH = ("torch==2.14.1", "torchvision==0.29.1", "torchaudio==2.11.0")  # the project's pin, inside `torch>=2.4.0`
EXTRA = ("safetensors", "pillow", "packaging")  # what the makers themselves use to read and write files
# SwiftVR's makers: what its code paths import (huggingface-hub comes unpinned with diffusers and is recorded as such).
SWIFTVR_IMPORTED = ("torch", "diffusers", "accelerate", "huggingface-hub", "safetensors", "numpy", "pillow", "decord",
                    "imageio")
PROFILES = {"wan": IMPORTED, "swiftvr": SWIFTVR_IMPORTED}


def requirements(repo: Path) -> dict[str, str]:
    """{distribution: specifier} of the repository's requirements.txt at its HEAD (name lower-cased, extras dropped)."""
    text = subprocess.run(["git", "-C", str(repo), "show", "HEAD:requirements.txt"], check=True, capture_output=True,
                          text=True).stdout
    out = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(3).strip()
    return out


def commit(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def provenance(repo: Path, name: str, imported: tuple[str, ...] = IMPORTED) -> dict[str, str]:
    """The official commit, the versions the run imports and the pins they satisfy; raises when one is outside its pin."""
    from packaging.specifiers import SpecifierSet

    pins = requirements(repo)
    out = {"repository": name, "commit": commit(repo), "python": platform.python_version()}
    bad = []
    for dist in imported:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        out[dist] = version
        spec = pins.get(dist, "")
        if spec:
            out[f"{dist}_pin"] = spec
            if version not in SpecifierSet(spec):
                bad.append(f"{dist} {version} (requirements.txt: {dist}{spec})")
    if bad:
        raise SystemExit(f"not the official environment of {name}: " + ", ".join(bad) +
                         "; build it with tests/golden/official_env.py create")
    return out


def as_metadata(prov: dict[str, str]) -> dict[str, str]:
    """The safetensors header metadata that carries a provenance (string values only)."""
    return {"official": json.dumps(prov, sort_keys=True)}


def create_swiftvr(venv: Path, repo: Path) -> None:
    """SwiftVR's environment: every imported distribution at its `==` pin, torch with its own (nvidia) dependencies."""
    pins = requirements(repo)
    wanted = [f"{d}{pins.get(d, '')}" for d in SWIFTVR_IMPORTED]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    subprocess.run([*pip, *wanted, "packaging"], check=True)
    print(f"{venv}: {' '.join(wanted)}")


def create(venv: Path, repo: Path) -> None:
    pins = requirements(repo)
    wanted = [f"{d}{HELD.get(d) and '==' + HELD[d] or pins.get(d, '')}" for d in IMPORTED
              if d != "torch" and (d in pins or d in EXTRA)]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    subprocess.run([*pip, *TORCH], check=True)
    subprocess.run([*pip, *wanted, *EXTRA], check=True)
    print(f"{venv}: {' '.join(wanted)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="build the official environment in a new venv")
    c.add_argument("venv", type=Path)
    c.add_argument("--repo", type=Path, required=True, help="a git clone of the official repository")
    c.add_argument("--profile", choices=sorted(PROFILES), default="wan")
    s = sub.add_parser("show", help="print what this interpreter would record (and check the pins)")
    s.add_argument("--repo", type=Path, required=True)
    s.add_argument("--profile", choices=sorted(PROFILES), default="wan")
    args = ap.parse_args()
    if args.command == "create":
        (create_swiftvr if args.profile == "swiftvr" else create)(args.venv, args.repo)
    else:
        print(json.dumps(provenance(args.repo, args.repo.name, PROFILES[args.profile]), indent=2))


if __name__ == "__main__":
    main()
