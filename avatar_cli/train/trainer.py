"""The resumable trainer: VAE -> latent cache -> SR -> DiT (with the audio and text encoders) -> decoder
polish (encoder frozen) -> model dir.

    train(out_dir, size="mini", work_dir=..., budget_minutes=90, seed=0)

Kill it at any time and call it again with the same work_dir: it continues from the last checkpoint
(written atomically every `plan.ckpt_every_s` seconds and at the end of every phase).
"""

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from avatar_cli.errors import InputError
from avatar_cli.families.mini.config import COMPONENTS, SIZES, FamilyConfig
from avatar_cli.modules.module import Module
from avatar_cli.families.registry import ModelSource, load_modules, resolve_model
from avatar_cli.train import checkpoint as ckpt
from avatar_cli.train.data import VAEFrames, build_dit_clip, downsample, build_sr_clip, load_clips, save_clip
from avatar_cli.train.losses import (decoder_loss, dit_batch, dit_loss, lr_at, normalize_latents, sr_batch, sr_loss,
                                     step_rngs, vae_batch, vae_loss)
from avatar_cli.train.plan import TrainPlan, plan_for

PHASES = ("vae", "cache", "sr", "dit", "decoder", "done")
# The models that the phases before a phase make (what `--start-from` takes from a model directory).
MADE_BEFORE = {"cache": ("vae",), "sr": ("vae",), "dit": ("vae", "sr"),
               "decoder": ("vae", "sr", "dit", "audio", "text")}
# The modules each phase trains, as "model" or "model.submodule".
TRAINED = {"vae": ("vae",), "sr": ("sr",), "dit": ("dit", "audio", "text"), "decoder": ("vae.decoder",)}


def init_models(cfg: FamilyConfig, seed: int) -> dict[str, nn.Module]:
    models = {}
    for i, (name, (_, cls)) in enumerate(COMPONENTS.items()):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1000 + i)
            m = cls(getattr(cfg, name))
            if hasattr(m, "init_weights"):
                m.init_weights(gen)
        models[name] = m.float()
    return models


def thin_init(wide: torch.Tensor, thin: torch.Tensor) -> torch.Tensor:
    """The leading slice of a wide layer's weight that fits the thin layer's shape (every dim at most as wide)."""
    if any(t > w for t, w in zip(thin.shape, wide.shape)) or wide.dim() != thin.dim():
        raise ValueError(f"cannot start a {tuple(thin.shape)} weight from a {tuple(wide.shape)} one")
    return wide[tuple(slice(0, n) for n in thin.shape)].clone()


def write_model_dir(out_dir: Path, cfg: FamilyConfig, models: dict[str, nn.Module]) -> None:
    """The registry's format: config.json + one safetensors per component; swapped in whole."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, (filename, _) in COMPONENTS.items():
        Module(name, models[name].eval(), "trained").save(tmp / filename)
    (tmp / "config.json").write_text(cfg.to_json() + "\n")
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


class _Halt(Exception):
    pass


def to_device(batch, device: torch.device):
    """A batch (tensors, possibly inside dicts, tuples and lists) on `device`; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def pick_device(name: str) -> torch.device:
    """auto: the first CUDA device when there is one, else the CPU. Batches are made on the CPU either way."""
    if name not in ("auto", "cpu", "cuda"):
        raise InputError(f"unknown device '{name}' (choose from auto, cpu, cuda)")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda': no CUDA device is available here")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Trainer:
    def __init__(self, cfg: FamilyConfig, plan: TrainPlan, work_dir: Path, budget_s: float, seed: int,
                 log: Callable[[dict], None], halt_after_steps: int | None, device: torch.device = torch.device("cpu")):
        self.cfg, self.plan, self.work, self.budget_s, self.seed = cfg, plan, work_dir, budget_s, seed
        self.log_fn, self.halt_after, self.device = log, halt_after_steps, device
        # Initialised on the CPU (the same weights whatever the device), then moved.
        self.models = {k: m.to(device) for k, m in init_models(cfg, seed).items()}
        self.state: dict = {"phase": "vae", "step": 0, "seconds": {}, "seed": seed, "size": cfg.size,
                            "probe": {}, "latent_scale": None, "plan": {k: v for k, v in plan.__dict__.items()}}
        self.opt: torch.optim.Optimizer | None = None
        self.steps_this_run = 0
        self._last_save = time.perf_counter()

    # --- bookkeeping ----------------------------------------------------------------------------

    def log(self, **event) -> None:
        event = {"phase": self.state["phase"], **event}
        with open(self.work / "train_log.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
        self.log_fn(event)

    def trained(self, phase: str) -> list[nn.Module]:
        out = []
        for path in TRAINED[phase]:
            name, *rest = path.split(".")
            m = self.models[name]
            for attr in rest:
                m = getattr(m, attr)
            out.append(m)
        return out

    def make_opt(self, phase: str, lr: float) -> torch.optim.Optimizer:
        params = [p for m in self.trained(phase) for p in m.parameters()]
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def save(self) -> None:
        ckpt.save(self.work, self.models, self.opt, self.state)
        self._last_save = time.perf_counter()

    def resume(self) -> bool:
        found = ckpt.load(self.work)
        if found is None:
            return False
        state, model_states, opt_state = found
        for name, sd in model_states.items():
            self.models[name].load_state_dict(sd, strict=True)
        self.state = state
        phase = state["phase"]
        if phase in TRAINED:
            self.opt = self.make_opt(phase, 0.0)
            if opt_state is not None:
                self.opt.load_state_dict(opt_state)
        return True

    def start_from(self, src: ModelSource, phase: str) -> None:
        """Begin at `phase` as a from-scratch run would: with the source directory's weights for what the
        earlier phases make, fresh ones for the rest.

        A decoder polish may start from a directory whose decoder is wider than this size's (a thinner,
        faster decoder distilled onto the same frozen encoder): the thin decoder starts from the leading
        channels of the wide one's weights, which decode far better than a random init."""
        for name, module in load_modules(src).items():
            if name not in MADE_BEFORE[phase]:
                continue
            sd = module.model.float().state_dict()
            if name == "vae" and src.config.vae.decoder_channels != self.cfg.vae.decoder_channels:
                sd = {k: (thin_init(v, self.models[name].state_dict()[k]) if k.startswith("decoder.") else v)
                      for k, v in sd.items()}
            self.models[name].load_state_dict(sd, strict=True)
        self.state.update(phase=phase, step=0, start_from=str(src.path))
        self.save()

    def next_phase(self, phase: str) -> None:
        self.state["phase"], self.state["step"] = phase, 0
        self.opt = None
        self.save()

    # --- phases ---------------------------------------------------------------------------------

    def run_phase(self, phase: str, steps: int, share: float, lr: float,
                  batch_fn: Callable[[int, np.random.Generator, torch.Generator], object],
                  loss_fn: Callable[[object], torch.Tensor]) -> None:
        models = self.trained(phase)
        for m in models:
            m.train()
        if self.opt is None:
            self.opt = self.make_opt(phase, lr)
        seconds = self.state["seconds"]
        budget = phase_budget(share, self.budget_s, seconds, phase)
        if self.state["step"] == 0 and phase not in self.state["probe"]:
            self.state["probe"][phase] = {"before": self.probe(batch_fn, loss_fn)}
        while self.state["step"] < steps and seconds.get(phase, 0.0) < budget:
            step = self.state["step"]
            t0 = time.perf_counter()
            rng, gen = step_rngs(self.seed, phase, step)
            batch = to_device(batch_fn(step, rng, gen), self.device)
            progress = max(step / steps, seconds.get(phase, 0.0) / budget)
            for g in self.opt.param_groups:
                g["lr"] = lr_at(progress, step, lr, self.plan.warmup)
            loss = loss_fn(batch)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for m in models for p in m.parameters()], self.plan.grad_clip)
            self.opt.step()
            self.state["step"] = step + 1
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t0
            self.steps_this_run += 1
            if step % 25 == 0 or step + 1 == steps:
                self.log(step=step, loss=round(float(loss.detach()), 5), s_per_step=round(time.perf_counter() - t0, 3))
            if time.perf_counter() - self._last_save > self.plan.ckpt_every_s:
                self.save()
            if self.halt_after is not None and self.steps_this_run >= self.halt_after:
                self.save()
                raise _Halt
        for m in models:
            m.eval()
        self.state["probe"][phase]["after"] = self.probe(batch_fn, loss_fn)
        self.state.setdefault("steps_done", {})[phase] = self.state["step"]
        self.log(event="phase_done", steps=self.state["step"], seconds=round(seconds.get(phase, 0.0), 1),
                 probe=self.state["probe"][phase])

    def probe(self, batch_fn, loss_fn) -> float:
        """Mean loss over fixed batches (the same before and after a phase), without gradients."""
        losses = []
        with torch.no_grad():
            for i in range(self.plan.probes):
                rng, gen = step_rngs(self.seed, "probe", i)
                losses.append(float(loss_fn(to_device(batch_fn(i * 7, rng, gen), self.device))))
        return float(np.mean(losses))

    def phase_vae(self) -> None:
        p, cfg, vae = self.plan, self.cfg, self.models["vae"]
        frames = VAEFrames(cfg, p.vae_clip_s)
        self.run_phase("vae", p.vae_steps, p.vae_share, p.vae_lr,
                       lambda step, rng, gen: (vae_batch(frames, p, cfg, step, rng), gen),
                       lambda b: vae_loss(vae, b[0], p, b[1]))
        # Unit-RMS latents, measured on the first training clips at both resolutions.
        x = torch.cat([frames.clip(j)[::4] for j in range(3)])
        s = normalize_latents(vae, [x.to(self.device), downsample(x, cfg.low_size).to(self.device)])
        self.state["latent_scale"] = [round(float(v), 6) for v in s]

    def phase_cache(self) -> None:
        """Encode every training clip once with the final VAE; each clip is its own atomically written file.
        Clips already there are kept, so the SR and DiT phases call this too (a run started at them)."""
        p, vae = self.plan, self.models["vae"].eval()
        t0, built = time.perf_counter(), 0
        for kind, count, clip_s, build in (("sr", p.sr_clips, p.sr_clip_s, build_sr_clip),
                                           ("dit", p.dit_clips, p.dit_clip_s, build_dit_clip)):
            folder = self.work / "cache" / kind
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(count):
                path = folder / f"{k:05d}.safetensors"
                if not path.exists():
                    save_clip(path, build(vae, self.cfg, k, clip_s))
                    built += 1
        if built or self.state["phase"] == "cache":
            self.state["seconds"]["cache"] = self.state["seconds"].get("cache", 0.0) + time.perf_counter() - t0
            self.log(event="cache_done", clips_built=built, seconds=round(time.perf_counter() - t0, 1))

    def cache(self, kind: str, count: int) -> dict[str, torch.Tensor]:
        folder = self.work / "cache" / kind
        return load_clips([folder / f"{k:05d}.safetensors" for k in range(count)])

    def phase_sr(self) -> None:
        p, sr = self.plan, self.models["sr"]
        self.phase_cache()
        data = self.cache("sr", p.sr_clips)
        self.run_phase("sr", p.sr_steps, p.sr_share, p.sr_lr,
                       lambda step, rng, gen: sr_batch(data, p, rng), lambda b: sr_loss(sr, b))

    def phase_dit(self) -> None:
        p, cfg, m = self.plan, self.cfg, self.models
        self.phase_cache()
        data = self.cache("dit", p.dit_clips)
        self.run_phase("dit", p.dit_steps, p.dit_share, p.dit_lr,
                       lambda step, rng, gen: dit_batch(data, p, cfg, rng, gen),
                       lambda b: dit_loss(m["dit"], m["audio"], m["text"], b, cfg, p.dit_autocast,
                                          p.dit_mouth_weight))

    def phase_decoder(self) -> None:
        p, cfg, vae = self.plan, self.cfg, self.models["vae"]
        frames = VAEFrames(cfg, p.vae_clip_s, kind="decoder")
        vae.encoder.eval()
        vae.to(memory_format=torch.channels_last)  # oneDNN's fast conv layout; checkpoints store contiguous copies
        self.run_phase("decoder", p.decoder_steps, p.decoder_share, p.decoder_lr,
                       lambda step, rng, gen: (vae_batch(frames, p, cfg, step, rng, native_only=True)[cfg.image_size],
                                               gen),
                       lambda b: decoder_loss(vae, b[0], p, b[1]))
        vae.to(memory_format=torch.contiguous_format)

    def run(self) -> None:
        actions = {"vae": self.phase_vae, "cache": self.phase_cache, "sr": self.phase_sr, "dit": self.phase_dit,
                   "decoder": self.phase_decoder}
        while self.state["phase"] != "done":
            phase = self.state["phase"]
            actions[phase]()
            self.next_phase(PHASES[PHASES.index(phase) + 1])


def same_size(src: FamilyConfig, size: FamilyConfig, phase: str) -> bool:
    """Whether a directory can start `phase` of this size: the same config, except that a decoder polish may
    start from another decoder width (see Trainer.start_from)."""
    if phase == "decoder":
        src = dataclasses.replace(src, vae=dataclasses.replace(src.vae, decoder_channels=size.vae.decoder_channels))
    return src == size


def phase_budget(share: float, budget_s: float, seconds: dict[str, float], phase: str) -> float:
    """Seconds of step time a phase may spend: its share of the budget, but never past the whole budget once
    the other phases' time (the fixed-size latent cache included) is counted."""
    spent_elsewhere = sum(v for k, v in seconds.items() if k != phase)
    return min(share * budget_s, budget_s - spent_elsewhere)


def train(out_dir: str | Path, size: str = "mini", work_dir: str | Path | None = None, budget_minutes: float = 90.0,
          seed: int = 0, resume: bool = True, plan: TrainPlan | None = None,
          log: Callable[[dict], None] = lambda e: print(json.dumps(e), flush=True),
          halt_after_steps: int | None = None, start_from: str | Path | None = None,
          start_phase: str = "decoder", device: str = "auto") -> dict | None:
    """Train a model of size `size` and write its model directory to `out_dir`.

    work_dir holds the checkpoint, the latent cache and train_log.jsonl (default: `<out_dir>.work`).
    resume: continue from work_dir's checkpoint when there is one (False: start over, clearing it).
    halt_after_steps: stop (checkpointed) after this many optimizer steps in this call, as a kill would;
    returns None then. Otherwise returns the summary that is also written to work_dir/summary.json.
    start_from: a model directory to begin with, at phase `start_phase`: what the earlier phases make is taken
    from it, the rest starts fresh (e.g. to re-run the decoder polish on trained weights); ignored when work_dir
    holds a checkpoint to resume.
    device: auto | cpu | cuda, where the models train (auto: CUDA when there is one); batches are made on the
    CPU and moved, so the data and the init are the same on any device.
    """
    if size not in SIZES:
        raise InputError(f"unknown size '{size}' (choose from {', '.join(SIZES)})")
    if start_phase not in PHASES[1:-1]:
        raise InputError(f"unknown phase '{start_phase}' to start at (choose from {', '.join(PHASES[1:-1])})")
    dev = pick_device(device)
    src = None
    if start_from is not None:  # checked before anything is written
        src = resolve_model(str(start_from), Path.cwd())
        if not same_size(src.config, SIZES[size], start_phase):
            raise InputError(f"{start_from}: its config.json is not the '{size}' size's")
    out_dir = Path(out_dir)
    work = Path(work_dir) if work_dir is not None else out_dir.with_name(out_dir.name + ".work")
    if not resume:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    cfg = SIZES[size]
    trainer = Trainer(cfg, plan or plan_for(size), work, budget_minutes * 60.0, seed, log, halt_after_steps, dev)
    if resume and trainer.resume():
        log({"event": "resumed", "phase": trainer.state["phase"], "step": trainer.state["step"]})
    elif src is not None:
        trainer.start_from(src, start_phase)
        log({"event": "started_from", "model": str(start_from), "phase": start_phase})
    try:
        trainer.run()
    except _Halt:
        return None
    write_model_dir(out_dir, cfg, trainer.models)  # Module.save writes CPU copies
    st = trainer.state
    summary = {"size": size, "seed": seed, "out_dir": str(out_dir), "seconds": st["seconds"],
               "steps": st.get("steps_done", {}), "probe": st["probe"], "latent_scale": st["latent_scale"],
               "total_minutes": round(sum(st["seconds"].values()) / 60, 2), "start_from": st.get("start_from"),
               "device": str(dev)}
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
