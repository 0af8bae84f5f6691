"""Make the Wan2.2-S2V DiT goldens: the official `WanModel_S2V` at a tiny size (TINY below), in float32.

    git -C $REPO archive HEAD wan | tar -x -C /tmp/wan22_dit
    OMP_NUM_THREADS=1 nice -n 19 $OFFICIAL_VENV/bin/python tests/golden/make_wan_dit_goldens.py --wan-repo /tmp/wan22_dit --official-git $REPO

$REPO is a git clone of Wan-Video/Wan2.2; $OFFICIAL_VENV its own environment (tests/golden/official_env.py create):
the script refuses to run under versions outside that repository's requirements.txt and records the commit and
the versions it ran with in every safetensors file it writes (header metadata `official`).

Writes to tests/golden/wan_s2v/ (safetensors and JSON only):
  dit_tiny_weights.safetensors  the tiny random weights in the official key layout
  dit_tiny_config.json          its config.json as diffusers' ConfigMixin writes it, plus the fields that the official
                                class keeps out of its config (ignore_for_config) and the pipeline's motion_frames
  dit_cases.safetensors         inputs and official outputs, tensors named "<case>.<name>":
    a    clip 0: motion dropped (drop_motion_frames=True), t=999
    b    a later clip with motion, t=501
    c    the unconditional half of CFG for b: negative-prompt context and audio * 0
    d, e b's inputs through config variants (not the release's): add_last_motion=False in "padd" mode, the same in
         "drop" mode. (zero_timestep=False cannot be run: the official block calls .item() on the int 0 it then gets.)
The official code needs a few patches to run on a CPU (see import_official); they are applied here at run time, never in the repository.
This script documents how the goldens were made; tests never run it.
"""

import argparse
import contextlib
import json
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from official_env import as_metadata, provenance  # tests/golden/, on sys.path as the script's folder

META: dict[str, str] = {}  # the official commit and versions, set in main()


def save_file_with_provenance(tensors, path) -> None:
    save_file(tensors, str(path), metadata=META)

OUT = Path(__file__).resolve().parent / "wan_s2v"

# The tiny configuration: keyword arguments of the official WanModel_S2V.__init__.
TINY = dict(
    cond_dim=16, audio_dim=32, num_audio_token=4, enable_adain=True, adain_mode="attn_norm", audio_inject_layers=[0, 2],
    zero_init=True, zero_timestep=True, enable_motioner=False, add_last_motion=True, enable_framepack=True,
    framepack_drop_mode="padd", model_type="s2v", patch_size=(1, 2, 2), text_len=16, in_dim=16, dim=64, ffn_dim=128,
    freq_dim=32, text_dim=32, out_dim=16, num_heads=2, num_layers=3, window_size=(-1, -1), qk_norm=True,
    cross_attn_norm=True, eps=1e-6,
)
MOTION_FRAMES = 73  # wan/configs/wan_s2v_14B.py transformer.motion_frames; the pipeline passes [73, (73 + 3) // 4]


def sdpa_flash_attention(q, k, v, q_lens=None, k_lens=None, dropout_p=0.0, softmax_scale=None, q_scale=None,
                         causal=False, window_size=(-1, -1), deterministic=False, dtype=torch.bfloat16, version=None):
    """CPU stand-in for wan.modules.attention.flash_attention: SDPA in the inputs' dtype, k_lens as a key mask."""
    assert q_lens is None and not causal and tuple(window_size) == (-1, -1) and q_scale is None
    b, lk = k.shape[0], k.shape[1]
    mask = None
    if k_lens is not None and bool((k_lens < lk).any()):
        mask = (torch.arange(lk)[None, :] < k_lens[:, None])[:, None, None, :]  # (B, 1, 1, Lk)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=softmax_scale)
    return out.transpose(1, 2).type(q.dtype)


def import_official(wan_repo: Path):
    """Import WanModel_S2V from an extracted Wan2.2 tree without running the heavy package __init__s (they import
    every pipeline and CUDA-only packages)."""
    for name, sub in [("wan", "wan"), ("wan.modules", "wan/modules"), ("wan.modules.s2v", "wan/modules/s2v")]:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(wan_repo / sub)]
        sys.modules[name] = pkg
    real_current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # evaluated in an import-time default of t5.py, should it get imported
    try:
        import wan.modules.model as wan_model
        import wan.modules.s2v.model_s2v as model_s2v
    finally:
        torch.cuda.current_device = real_current_device
    wan_model.flash_attention = sdpa_flash_attention
    model_s2v.flash_attention = sdpa_flash_attention
    return model_s2v.WanModel_S2V


@torch.no_grad()
def rerandomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Make every parameter non-trivial (a random init alone leaves some zero): zero_init and init_weights leave the head, cond_encoder, the
    injector outputs, AdaIN, the token-type embedding and all Linear biases at zero, and the norms at one."""
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name == "casual_audio_encoder.weights":
            p.copy_(noise)  # layer-mixing logits: uneven, so the 25 layers are told apart
        elif name.endswith("padding_tokens"):
            p.copy_(0.5 * noise)
        elif name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or name.endswith("norm3.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("modulation"):
            continue  # already randn / sqrt(dim)
        elif name.startswith(("text_embedding.", "time_embedding.")) and p.ndim == 2:
            p.copy_(noise / p.shape[1] ** 0.5)  # std 0.02 at init leaves the text path nearly silent at this size
        elif bool((p == 0).all()):
            if p.ndim == 1:
                p.copy_(0.02 * noise)
            elif name == "trainable_cond_mask.weight":
                p.copy_(0.1 * noise)
            else:
                fan_in = p[0].numel()
                p.copy_(noise / fan_in ** 0.5)
    for name, p in model.named_parameters():
        assert not bool((p == 0).all()), name


def run(model, inp: dict, drop: bool) -> torch.Tensor:
    lat_motion = (MOTION_FRAMES + 3) // 4
    out = model([inp["x"]], inp["t"], [inp["context"]], None, [inp["ref"]], [inp["motion"]], [inp["cond"]],
                audio_input=inp["audio"], motion_frames=[MOTION_FRAMES, lat_motion], add_last_motion=2,
                drop_motion_frames=drop)
    return out[0]


@contextlib.contextmanager
def attrs(obj, **values):
    old = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wan-repo", type=Path, required=True, help="folder holding the extracted wan/ package")
    ap.add_argument("--official-git", type=Path, required=True,
                    help="a git clone of Wan-Video/Wan2.2: its commit and requirements.txt pins are checked and recorded")
    args = ap.parse_args()
    global META
    META = as_metadata(provenance(args.official_git, "Wan-Video/Wan2.2"))  # refuses outside the official pins
    WanModel_S2V = import_official(args.wan_repo.resolve())
    torch.manual_seed(0)
    model = WanModel_S2V(**TINY).float().eval()
    rerandomise(model, torch.Generator().manual_seed(1))

    gen = torch.Generator().manual_seed(2)
    # infer_frames 16 -> (16 + 3 + 73) // 4 - 19 = 4 latent frames. A non-square latent larger than 8x8, so
    # that the sparse FramePack RoPE positions (linspace, truncated) and the h/w order are exercised.
    F_lat, h, w = 4, 16, 24

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    base = dict(
        x=randn(16, F_lat, h, w), ref=randn(16, 1, h, w), motion=randn(16, 19, h, w),
        cond=randn(16, F_lat, h, w, scale=0.5),
        context=randn(7, TINY["text_dim"]), audio=randn(1, 25, TINY["audio_dim"], 4 * F_lat),
    )
    neg_context = randn(9, TINY["text_dim"])
    cases = {
        "a": (dict(base, t=torch.tensor([999], dtype=torch.long)), True, {}, {}),
        "b": (dict(base, t=torch.tensor([501], dtype=torch.long)), False, {}, {}),
        "c": (dict(base, t=torch.tensor([501], dtype=torch.long), context=neg_context, audio=base["audio"] * 0), False,
              {}, {}),
        "d": (dict(base, t=torch.tensor([501], dtype=torch.long)), False, dict(add_last_motion=False), {}),
        "e": (dict(base, t=torch.tensor([501], dtype=torch.long)), False, dict(add_last_motion=False),
              dict(drop_mode="drop")),
    }
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, (inp, drop, model_attrs, packer_attrs) in cases.items():
            with attrs(model, **model_attrs), attrs(model.frame_packer, **packer_attrs):
                t0 = time.perf_counter()
                out = run(model, inp, drop)
                dt = time.perf_counter() - t0
            print(f"case {key}: out {tuple(out.shape)} {out.dtype} max|out| {out.abs().max():.4f} ({dt:.3f} s)")
            for name, v in inp.items():
                if key in "de" and name != "t":
                    continue  # d, e reuse b's inputs
                tensors[f"{key}.{name}"] = v.clone()  # cloned: safetensors refuses shared storage
            tensors[f"{key}.out"] = out.contiguous()
            tensors[f"{key}.drop_motion"] = torch.tensor(drop)
        # every path is live: what zeroing one input changes (mean |delta out|), to show each input reaches the output
        ref_out = tensors["b.out"]
        b_in = cases["b"][0]
        for name in ("audio", "motion", "ref", "cond", "context", "t"):
            out = run(model, dict(b_in, **{name: b_in[name] * 0}), False)
            print(f"zeroing {name}: mean |delta out| {(out - ref_out).abs().mean():.3e}")

    OUT.mkdir(parents=True, exist_ok=True)
    save_file_with_provenance({k: v.contiguous() for k, v in model.state_dict().items()}, OUT / "dit_tiny_weights.safetensors")
    config = json.loads(model.to_json_string())
    # The official loader never reads these from config.json (WanModel_S2V.ignore_for_config): it always takes the
    # class's own values. The tiny text_dim differs from them, so they are written out for our from_config.
    for k in ("patch_size", "text_dim", "window_size", "qk_norm", "cross_attn_norm"):
        config[k] = list(TINY[k]) if isinstance(TINY[k], tuple) else TINY[k]
    config["motion_frames"] = MOTION_FRAMES
    (OUT / "dit_tiny_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file_with_provenance(tensors, OUT / "dit_cases.safetensors")
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {OUT}: {n:,} params, {len(tensors)} case tensors")


if __name__ == "__main__":
    main()
