"""`evaluate`: render held-out identities with held-out speech through the real pipeline and score them.

Identities come from `EVAL_IDENTITY_SEEDS`, speech from seeds >= `HELDOUT_AUDIO_SEED_START`: never trained on.
Every render goes through `job.resolve` / `render.render` on a generated job file, as `avatar render`
does.
"""

import datetime
import os
import platform
import sys
import tempfile
import time
import wave
from dataclasses import dataclass, replace
from pathlib import Path

import av
import numpy as np
import torch

from avatar_cli import render as rendering

from avatar_cli.job import resolve

from avatar_cli.evaluate import metrics as M
from avatar_cli.media.image import save_png
from avatar_cli.families.registry import load_modules, resolve_model
from avatar_cli.report import QuietReporter
from avatar_cli.spec import load_job
from avatar_cli.synth import EVAL_IDENTITY_SEEDS, HELDOUT_AUDIO_SEED_START, SAMPLE_RATE, make_clip, render_reference
from avatar_cli.synth.layout import box_slices
from avatar_cli.synth.speech import synth_speech
from avatar_cli.train.data import to_unit

MOUTH_REGION = (-0.28, 0.28, 0.05, 0.45)  # mouth and its corners: where "smiling" shows
TARGETS = {"lip_sync": ">= 0.6", "lip_sync_without_I": ">= 0.6", "drift": "<= 1.1", "seam_with_I": "<= 1.2",
           "seam_without_I": "<= 1.2",
           "vae_psnr": ">= 30 dB", "prompt_smile": "> 0", "prompt_lively": "> 1"}


@dataclass
class Rendered:
    frames: np.ndarray | None  # uint8 (T, S, S, 3), or None when only streamed
    reference: np.ndarray
    audio: np.ndarray
    wall_s: float
    boundaries: list[int]  # frames where the output passes from one chunk to the next (`chunk_boundaries`)
    transitions: bool  # whether I chunks ran (the job's chunking.transitions, `auto` resolved for this machine)


def write_wav(path: Path, audio: np.ndarray) -> None:
    """Mono 16-bit PCM at the generator's sample rate."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())


class Renderer:
    """Writes inputs and a job file into a temp folder and renders them through avatar_cli.render."""

    def __init__(self, model: str, work: Path, steps: int, seed: int, image_size: int, guidance: float = 1.0):
        self.model, self.work, self.steps, self.seed, self.size = model, work, steps, seed, image_size
        self.guidance = guidance
        self.count = 0

    def render(self, identity: int, audio: np.ndarray, prompt: str = "", transitions: bool | str = "auto",
               on_frame=None, keep: bool = True) -> Rendered:
        """transitions: auto renders as `avatar render` does on this machine (no I chunks on a CPU)."""
        self.count += 1
        d = self.work / f"job{self.count}"
        d.mkdir(parents=True)
        reference = render_reference(identity, self.size)
        save_png(d / "ref.png", reference)
        write_wav(d / "speech.wav", audio)
        (d / "job.yaml").write_text(
            f"reference: ref.png\naudio: speech.wav\noutput: out.mp4\nmodel: {self.model}\nseed: {self.seed}\n"
            f"prompt: \"{prompt}\"\nsampling:\n  steps: {self.steps}\n  guidance: {self.guidance}\nvideo:\n  crf: 12\n"
            f"chunking:\n  transitions: {str(transitions).lower()}\n")
        t0 = time.perf_counter()
        p = resolve(load_job(d / "job.yaml"), force=True)
        done = rendering.render(p, QuietReporter(0))
        wall = time.perf_counter() - t0
        frames = []
        with av.open(str(d / "out.mp4")) as c:
            for i, fr in enumerate(c.decode(video=0)):
                arr = fr.to_ndarray(format="rgb24")
                if on_frame is not None:
                    on_frame(i, arr)
                if keep:
                    frames.append(arr)
        (d / "out.mp4").unlink()
        chunking = replace(p.job.spec.chunking, transitions=done["transitions"])
        boundaries = M.chunk_boundaries(p.model.family.plan(chunking, p.frames))
        return Rendered(np.stack(frames) if keep else None, reference, audio, wall, boundaries, done["transitions"])


@torch.no_grad()
def vae_psnr(vae, identity: int, audio_seed: int, seconds: float = 2.0, size: int = 256) -> float:
    """Encode and decode a held-out clip at the native size, chunk by chunk with the decoder's cache."""
    x = to_unit(make_clip(identity, audio_seed, seconds, 25, size=size).frames)  # (T, 3, S, S)
    cache, out = None, []
    for i in range(0, x.shape[0], 8):
        y, cache = vae.decode(vae.encode(x[i:i + 8]), cache)
        out.append(y)
    return M.psnr(torch.cat(out), x)


def evaluate(model: str = "mini", out_md: str | Path = "bench/results.md",
             contact_sheet: str | Path = "bench/contact_sheet.png", long_minutes: float = 10.0, identities: int = 2,
             clip_s: float = 8.0, steps: int = 4, seed: int = 0, command: str | None = None,
             log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    """Render and score; append a table to `out_md`, write the contact sheet; returns the numbers."""
    source = resolve_model(model, Path.cwd())
    model_ref = model if source.path is None or model in ("mini",) else str(Path(model).resolve())
    cfg = source.config
    vae = load_modules(source)["vae"].model.float().eval()
    res: dict[str, float] = {}
    t_start = time.perf_counter()

    res["vae_psnr"] = float(np.mean([vae_psnr(vae, EVAL_IDENTITY_SEEDS[1 + k], HELDOUT_AUDIO_SEED_START + 100 + k,
                                              size=cfg.image_size) for k in range(2)]))
    log(f"vae psnr {res['vae_psnr']:.2f} dB")

    with tempfile.TemporaryDirectory() as tmp:
        r = Renderer(model_ref, Path(tmp), steps, seed, cfg.image_size)
        sync, sync_without_i, with_i, without_i = [], [], [], []
        for k in range(identities):
            ident, aud = EVAL_IDENTITY_SEEDS[10 + k], HELDOUT_AUDIO_SEED_START + k
            audio = synth_speech(aud, clip_s, SAMPLE_RATE)
            a = r.render(ident, audio, transitions=True)
            b = r.render(ident, audio, transitions=False)
            sync.append(M.lip_sync(a.frames, a.reference, audio, SAMPLE_RATE, 25.0))
            sync_without_i.append(M.lip_sync(b.frames, b.reference, audio, SAMPLE_RATE, 25.0))
            with_i.append(M.seam_ratio(M.frame_changes(a.frames), a.boundaries))
            without_i.append(M.seam_ratio(M.frame_changes(b.frames), b.boundaries))
            log(f"identity {ident}: lip sync {sync[-1]:.3f}, seams {with_i[-1]:.3f} / {without_i[-1]:.3f} "
                f"({a.wall_s:.1f} s render)")
        res["lip_sync"] = float(np.mean(sync))
        res["lip_sync_without_I"] = float(np.mean(sync_without_i))  # what a CPU's `auto` renders
        # The same meter on the generator's own frames of the same identity and speech: the ceiling.
        res["lip_sync_truth"] = float(np.mean([
            M.lip_sync(c.frames.numpy(), c.reference, c.audio, SAMPLE_RATE, 25.0)
            for c in (make_clip(EVAL_IDENTITY_SEEDS[10 + k], HELDOUT_AUDIO_SEED_START + k, clip_s, 25,
                                size=cfg.image_size) for k in range(identities))]))
        res["seam_with_I"] = float(np.mean(with_i))
        res["seam_without_I"] = float(np.mean(without_i))

        # Prompt: does the word move the output the way the generator moves a face for the same word?
        ident, aud = EVAL_IDENTITY_SEEDS[20], HELDOUT_AUDIO_SEED_START + 20
        audio = synth_speech(aud, clip_s, SAMPLE_RATE)
        out = {w: r.render(ident, audio, prompt=w).frames for w in ("smiling", "neutral", "lively", "calm")}
        truth = {w: make_clip(ident, aud, clip_s, 25, size=cfg.image_size, expression=w).frames.numpy()
                 for w in ("smiling", "neutral")}
        rows, cols = box_slices(MOUTH_REGION, cfg.image_size)
        mean = {w: f[:, rows, cols].mean(axis=0) for w, f in {**out, **{f"gt_{k}": v for k, v in truth.items()}}.items()}
        res["prompt_smile"] = M.direction_score(mean["smiling"], mean["neutral"], mean["gt_smiling"], mean["gt_neutral"])
        ref = render_reference(ident, cfg.image_size)
        res["prompt_lively"] = M.motion_energy(out["lively"], ref) / max(M.motion_energy(out["calm"], ref), 1e-6)
        log(f"prompt: smile direction {res['prompt_smile']:.3f}, lively/calm motion {res['prompt_lively']:.3f}")

        # Identity over length: one long render, streamed (never all frames in memory).
        ident, aud = EVAL_IDENTITY_SEEDS[30], HELDOUT_AUDIO_SEED_START + 30
        audio = synth_speech(aud, long_minutes * 60.0, SAMPLE_RATE)
        total = int(round(long_minutes * 60 * 25))
        picks = set(np.linspace(0, total - 1, 12).astype(int).tolist())
        ref = render_reference(ident, cfg.image_size)
        errors, sheet = [], [ref]

        def on_frame(i: int, frame: np.ndarray) -> None:
            errors.append(float(M.face_error(frame[None], ref)[0]))
            if i in picks:
                sheet.append(frame)

        long = r.render(ident, audio, on_frame=on_frame, keep=False)
        res["long_transitions"] = long.transitions  # the prompt and long renders run as `auto` chooses here
        res["drift"], res["face_err_early"], res["face_err_late"] = M.drift_ratio(np.array(errors), 25.0)
        # The floor: the generator's own first 10 s of this identity and speech (head sway, mouth, blinks).
        truth = make_clip(ident, aud, 10.0, 25, size=cfg.image_size)
        res["face_err_truth"] = float(M.face_error(truth.frames.numpy(), ref).mean())
        res["long_rtf"] = len(errors) / 25.0 / long.wall_s
        log(f"drift {res['drift']:.3f} over {long_minutes:g} min ({long.wall_s:.0f} s render)")

    Path(contact_sheet).parent.mkdir(parents=True, exist_ok=True)
    save_png(contact_sheet, M.contact_sheet(sheet[:13], columns=5))
    write_table(out_md, res, model, long_minutes, command, time.perf_counter() - t_start)
    return res


def _passes(name: str, v: float) -> str:
    checks = {"lip_sync": v >= 0.6, "lip_sync_without_I": v >= 0.6, "drift": v <= 1.1, "seam_with_I": v <= 1.2,
              "seam_without_I": v <= 1.2, "vae_psnr": v >= 30.0,
              "prompt_smile": v > 0, "prompt_lively": v > 1}
    return ("yes" if checks[name] else "**no**") if name in checks else ""


def write_table(out_md: str | Path, res: dict, model: str, long_minutes: float, command: str | None,
                wall_s: float) -> None:
    cpu = platform.processor() or platform.machine()
    lines = [f"\n## Eval {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}: model `{model}`\n",
             f"- machine: {platform.node()}, {cpu}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
             f"(CPU capability {torch.backends.cpu.get_cpu_capability()})",
             f"- command: `{command or 'avatar_cli.evaluate.evaluate(...)'}`",
             f"- long render: {long_minutes:g} min; eval wall time {wall_s / 60:.1f} min",
             f"- prompt and long renders: chunking.transitions auto, which chose "
             f"{'I chunks' if res.get('long_transitions') else 'no I chunks'} here; dtype auto\n",
             "| metric | value | target | met |", "|---|---|---|---|"]
    names = {"lip_sync": "lip sync (Pearson r, loudness vs mouth opening)",
             "lip_sync_without_I": "lip sync without I chunks",
             "drift": "identity drift (face error, last min / first 10 s)",
             "seam_with_I": "seams with I chunks (change into a chunk's first kept frame / elsewhere; both "
                            "ends of each I chunk count)",
             "seam_without_I": "seams without I chunks", "vae_psnr": "VAE PSNR, held-out frames (dB)",
             "prompt_smile": "prompt 'smiling' vs 'neutral' (cosine with generator's smile)",
             "prompt_lively": "prompt 'lively' vs 'calm' (head-motion ratio)",
             "lip_sync_truth": "lip sync of the generator's own frames (the meter's ceiling)",
             "face_err_early": "face error, first window (0-255)", "face_err_late": "face error, last window (0-255)",
             "face_err_truth": "face error of the generator's own first 10 s (the floor)",
             "long_rtf": "long render speed (x real time)"}
    for k, label in names.items():
        if k in res:
            lines.append(f"| {label} | {res[k]:.3f} | {TARGETS.get(k, '')} | {_passes(k, res[k])} |")
    path = Path(out_md)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
