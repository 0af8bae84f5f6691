"""Training checkpoints: one safetensors file holding every model, the phase's optimizer and the JSON state.

The JSON state (phase, step, seconds spent per phase, plan) rides in the safetensors metadata, so a
checkpoint is a single file replaced atomically (`os.replace`): a run killed at any moment leaves
either the previous checkpoint or the new one, never half of each. `state.json` beside it is a
human-readable copy. Randomness is derived from (seed, phase, step) at every step, so the step
counter is the whole RNG state and a resumed run draws exactly what an uninterrupted one would.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from avatar_cli.files import atomic_path
from avatar_cli.modules.module import save_safetensors

CKPT = "train_ckpt.safetensors"


def save(work_dir: Path, models: dict[str, nn.Module], opt: torch.optim.Optimizer | None, state: dict) -> None:
    tensors = {f"model.{name}.{k}": v.detach().cpu().contiguous() for name, m in models.items()
               for k, v in m.state_dict().items()}
    groups = None
    if opt is not None:
        sd = opt.state_dict()
        for idx, st in sd["state"].items():
            for key, v in st.items():
                tensors[f"opt.{idx}.{key}"] = torch.as_tensor(v).detach().cpu().clone().contiguous()
        groups = sd["param_groups"]
    meta = {"state": json.dumps(state), "param_groups": json.dumps(groups)}
    work_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(work_dir / CKPT) as tmp:
        save_safetensors(tensors, tmp, metadata=meta)
    with atomic_path(work_dir / "state.json") as tmp:
        tmp.write_text(json.dumps(state, indent=2) + "\n")


def load(work_dir: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]], dict | None] | None:
    """-> (state, model state dicts by name, optimizer state dict or None); None when there is no checkpoint."""
    path = work_dir / CKPT
    if not path.is_file():
        return None
    models: dict[str, dict[str, torch.Tensor]] = {}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = f.metadata()
        for key in f.keys():
            kind, rest = key.split(".", 1)
            if kind == "model":
                name, k = rest.split(".", 1)
                models.setdefault(name, {})[k] = f.get_tensor(key)
            else:
                idx, k = rest.split(".", 1)
                opt_state.setdefault(int(idx), {})[k] = f.get_tensor(key)
    groups = json.loads(meta["param_groups"])
    opt = None if groups is None else {"state": opt_state, "param_groups": groups}
    return json.loads(meta["state"]), models, opt
