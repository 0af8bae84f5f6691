"""How far `runtime.weights: int8 | fp8` moves wan-s2v's output from the unquantized weights, on the CPU at the tiny size:

- the DiT forward on the golden tiny weights against the official WanModel_S2V's outputs (tests/golden/wan_s2v,
  cases a, b, c), with float32 and with bfloat16 activations (bf16 weights alone, for scale);
- the end-to-end golden (tests/test_wan_e2e_golden.py: two clips of the official WanS2V.generate on a tiny model):
  avatar's render with quantized weights against the official latents and frames;
- whole renders of the tiny random model (2 s, 4 steps, 64x64, lossless video) in the clip and the streaming mode,
  against the same render with unquantized float32 weights: mean and max |diff| of the frames in 8-bit levels.
- umT5's prompt encodings (the tiny random wan-s2v model's, two prompts and the negative prompt) with quantized
  weights against the unquantized encoder's, relative L2 (bf16 activations against float32, for scale);
And the bytes of the DiT and umT5 at full size (the 14B release's sizes, counted on the meta device), and the time
this host takes to quantize one of the DiT's FFN Linears (5120 -> 13824, bf16).

    python bench/quant_error.py [SECTION ...]   (dit, official, renders, text, bytes, speed; default: all)

The tiny models' weights are random: this says how the rounding behaves through the architecture, not what it does
to the released weights (bench/gpu_check.py --sections weights measures the full-size forward on a GPU)."""

import copy
import io
import os
import sys
import tempfile
from pathlib import Path

import av
import numpy as np
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from avatar_cli.families import registry  # noqa: E402
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT  # noqa: E402
from avatar_cli.families.wan_s2v.family import QUANTIZED  # noqa: E402
from avatar_cli.modules.module import build_meta  # noqa: E402
from avatar_cli.runtime.quantize import quantize_linears, quantized_bytes  # noqa: E402
from tests.conftest import write_reference, write_wav  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "wan_s2v"
PATHS = dict(QUANTIZED)["dit"]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def dit_errors() -> None:
    base = WanS2VDiT(WanDiTParams.tiny()).eval()
    base.load_state_dict(load_file(GOLDEN / "dit_tiny_weights.safetensors"), strict=True)
    cases = load_file(GOLDEN / "dit_cases.safetensors")
    print("| activations | weights | rel. L2 vs official, cases a / b / c |\n|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        c = {k: v.to(dtype) if v.is_floating_point() else v for k, v in cases.items()}
        for weights in ("bf16", "int8", "fp8"):
            m = copy.deepcopy(base).to(dtype)
            quantize_linears(m, weights, PATHS)
            errs = []
            for key in "abc":  # each case's own inputs (tests/test_wan_dit.py CASES)
                g = lambda n: c[f"{key}.{n}"]  # noqa: E731
                motion = None if bool(cases[f"{key}.drop_motion"]) else g("motion")
                out = m(g("x"), g("t"), g("context"), g("ref"), motion, g("cond"), g("audio"))
                errs.append(rel_l2(out, cases[f"{key}.out"]))
            name = {"bf16": "runtime dtype"}.get(weights, weights)
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | " + " / ".join(f"{e:.2e}" for e in errs) + " |")


def tiny_job(root: Path) -> Path:
    """A tiny random wan-s2v model and a 2 s, 4-step, 64x64 job of it (float32, lossless video) in `root`."""
    wan = root / "Wan2.2-S2V-tiny"
    registry.init_family_dir(wan, "tiny", seed=0, family="wan-s2v")
    write_reference(root / "ref.png")
    write_wav(root / "speech.wav", 2.0)
    (root / "job.yaml").write_text(
        f"reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: {wan}\nprompt: a person talking\n"
        "seed: 3\nvideo: {width: 64, height: 64, crf: 0}\nsampling: {steps: 4}\n"
        "runtime: {dtype: float32, text_cache: off, threads: 1, decode: inline}\n")
    return root / "job.yaml"


def render_frames(job: Path, weights: str, mode: str) -> np.ndarray:
    """One render of `job` in this process with runtime.weights and mode -> its frames as 0..255 floats."""
    from avatar_cli.report import JsonReporter
    from avatar_cli.job import resolve
    from avatar_cli.render import render
    from avatar_cli.spec import load_job

    out = job.parent / f"{mode}-{weights}.mp4"
    p = resolve(load_job(job, [f"runtime.weights={weights}", f"output={out}", f"mode={mode}"]), force=True)
    render(p, JsonReporter(io.StringIO()))
    return frames_of(out)


def frames_of(video: Path) -> np.ndarray:
    """A video's frames, (n, H, W, 3) 0..255 floats."""
    with av.open(str(video)) as f:
        return np.stack([x.to_ndarray(format="rgb24") for x in f.decode(video=0)]).astype(np.float32)


def render_errors() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        job = tiny_job(Path(tmp))
        print("\n| mode | weights | mean \\|diff\\| (8-bit levels) | max |\n|---|---|---|---|")
        for mode in ("clip", "streaming"):
            frames = {weights: render_frames(job, weights, mode) for weights in ("bf16", "int8", "fp8")}
            for weights in ("int8", "fp8"):
                d = np.abs(frames[weights] - frames["bf16"])
                print(f"| {mode} | {weights} | {d.mean():.3f} | {d.max():.0f} |")


def official_errors(folder: Path, formats: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """The end-to-end golden's job rendered in this process with each runtime.weights format (the official audio
    windows put back, as tests/test_wan_e2e_golden.py does) -> per format: relative L2 of clip 0's and clip 1's
    latents against the official ones, and mean and max |diff| of clip 0's frames (in [-1, 1])."""
    import json

    import pytest
    from safetensors import safe_open

    from avatar_cli.families.wan_s2v.family import LEAD, WanS2VFamily
    from tests.conftest import avatar
    from tests.test_wan_e2e_golden import E2E, write_job, write_model_dir

    meta = json.loads((E2E / "official.json").read_text())
    with safe_open(str(E2E / "official.safetensors"), "pt") as f:
        official = {k: f.get_tensor(k) for k in f.keys()}
    model = folder / "Wan2.2-S2V-e2e"
    write_model_dir(model, meta["files"])
    write_job(folder / "e2e.yaml", model, meta["job"])
    clip_audio, decode = WanS2VFamily.clip_audio, WanS2VFamily.decode
    index = official["frame_index"]
    clip0 = index < 77
    out = {}
    for weights in formats:
        seen: dict[str, list] = {"z": [], "frames": []}

        def tapped(self, models, final, state, put):
            seen["z"].append(final.z.clone())  # (n, 16, h, w)

            def tap(x):  # (t, 3, H, W)
                seen["frames"].append(x.float().clone())
                put(x)

            return decode(self, models, final, state, tap)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(WanS2VFamily, "clip_audio", lambda self, models, audio, start, length, fps: clip_audio(
                self, models, audio, start + LEAD, length, fps))
            mp.setattr(WanS2VFamily, "decode", tapped)
            r = avatar("render", str(folder / "e2e.yaml"), "--json", "--force", f"runtime.weights={weights}")
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-2000:])
        z = torch.cat(seen["z"]).transpose(0, 1)  # (16, 41, h, w): [ref, clip 0, clip 1]
        frames = torch.cat(seen["frames"]).clamp(-1, 1).transpose(0, 1)  # (3, 157, 64, 64)
        d = (frames[:, index[clip0]] - official["frames"][:, clip0]).abs()
        out[weights] = {"latents_0": rel_l2(z[:, 1:21], official["latents_0"]),
                        "latents_1": rel_l2(z[:, 21:], official["latents_1"]),
                        "frames_0_mean": float(d.mean()), "frames_0_max": float(d.max())}
    return out


TEXT_PROMPTS = ("a person talking", "a woman smiling warmly at the camera, speaking")


@torch.no_grad()
def text_encodings(model_dir: Path, dtype: str, weights: str) -> dict[str, torch.Tensor]:
    """The tiny wan-s2v model's umT5 encodings of TEXT_PROMPTS (and of its negative prompt), loaded and placed with
    runtime.weights as a render does, on the CPU in `dtype` -> {"PROMPT-INDEX.text" / ".negative": (L, dim)}."""
    from avatar_cli.prompts.encode import load_prompt_step
    from avatar_cli.runtime.device import resolve_runtime

    source = registry.resolve_model(str(model_dir), model_dir.parent)
    runtime = resolve_runtime("cpu", dtype)
    models = load_prompt_step(source, runtime, weights)
    out = {}
    for i, prompt in enumerate(TEXT_PROMPTS):
        for name, t in source.family.prompt(models, prompt, runtime.device, runtime.dtype).items():
            out[f"{i}.{name}"] = t.float()
    return out


def text_errors() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wan = Path(tmp) / "wan"
        registry.init_family_dir(wan, "tiny", seed=0, family="wan-s2v")
        ref = text_encodings(wan, "float32", "bf16")
        names = " / ".join(ref)
        print(f"\n| umT5 activations | weights | rel. L2 vs float32 unquantized: {names} |\n|---|---|---|")
        for dtype, weights in (("bfloat16", "bf16"), ("float32", "int8"), ("float32", "fp8"), ("bfloat16", "int8"),
                               ("bfloat16", "fp8")):
            got = text_encodings(wan, dtype, weights)
            errs = " / ".join(f"{rel_l2(got[k], ref[k]):.2e}" for k in ref)
            print(f"| {dtype} | {weights if weights != 'bf16' else 'runtime dtype'} | {errs} |")


def full_size_bytes() -> None:
    from avatar_cli.families.wan_s2v.components import UMT5Text
    from avatar_cli.families.wan_s2v.text import UMT5_XXL

    meta = build_meta(WanS2VDiT, WanDiTParams.full())
    t5 = build_meta(UMT5Text, UMT5_XXL)
    print("\n| weights at full size | DiT GB | umT5 GB |\n|---|---|---|")
    for weights in ("bf16", "int8", "fp8"):
        print(f"| {weights} | {quantized_bytes(meta, weights, PATHS, torch.bfloat16) / 1e9:.3f} | "
              f"{quantized_bytes(t5, weights, dict(QUANTIZED)['text'], torch.bfloat16) / 1e9:.3f} |")


def quantize_speed() -> None:
    import time

    from torch import nn

    print("\n| quantizing on this host (threads) | s per 70.8 M-param Linear | s for the DiT's 15.3 B |\n|---|---|---|")
    for weights in ("int8", "fp8"):
        quantize_linears(nn.Linear(8, 8, dtype=torch.bfloat16), weights, ("",))  # torchao's first call: imports
        layer = nn.Linear(5120, 13824, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        quantize_linears(layer, weights, ("",))
        dt = time.perf_counter() - t0
        print(f"| {weights} ({torch.get_num_threads()}) | {dt:.2f} | {dt * 15_309_209_600 / layer.weight.numel():.0f} |")


def official_table() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print("\n| weights | latents rel. L2, clip 0 / clip 1 | clip 0 frames mean / max \\|diff\\| (in [-1, 1]) |"
              "\n|---|---|---|")
        for weights, e in official_errors(Path(tmp), ("bf16", "int8", "fp8")).items():
            print(f"| {weights} | {e['latents_0']:.2e} / {e['latents_1']:.2e} | {e['frames_0_mean']:.2e} / "
                  f"{e['frames_0_max']:.2e} |")


def speed() -> None:
    torch.set_num_threads(os.cpu_count() or 1)  # a load uses every core
    quantize_speed()


SECTIONS = {"dit": dit_errors, "official": official_table, "renders": render_errors, "text": text_errors,
            "bytes": full_size_bytes, "speed": speed}

if __name__ == "__main__":
    chosen = sys.argv[1:] or list(SECTIONS)
    unknown = [c for c in chosen if c not in SECTIONS]
    if unknown:
        sys.exit(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    torch.set_num_threads(1)
    for name in chosen:
        SECTIONS[name]()
