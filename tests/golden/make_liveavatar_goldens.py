"""Make the LiveAvatar streaming goldens: THEIR block-causal `CausalWanModel_S2V` at the tiny size of the DiT goldens,
float32 on the CPU, over 2 clips x 4 blocks x 4 Euler steps, driven the way their TPP pipeline drives it.

    git -C $REPO archive HEAD liveavatar | tar -x -C /tmp/la
    OMP_NUM_THREADS=1 nice -n 19 $OFFICIAL_VENV/bin/python tests/golden/make_liveavatar_goldens.py --la-repo /tmp/la --official-git $REPO

$REPO is a git clone of Alibaba-Quark/LiveAvatar; $OFFICIAL_VENV its own environment (tests/golden/official_env.py create):
the script refuses to run under versions outside that repository's requirements.txt and records the commit and
the versions it ran with in every safetensors file it writes (header metadata `official`).

(git reports examples/boy.wav missing from the mirror; all 104 files of liveavatar/ come out.) Their code:
Alibaba-Quark/LiveAvatar at commit LA_COMMIT below. Weights: tests/golden/wan_s2v/dit_tiny_weights.safetensors (the
official tiny WanModel_S2V, already re-randomised), so their model and ours share every parameter. Regenerating gives
a byte-identical file (checked).

The driver (`run_stream`) follows liveavatar/models/wan/causal_s2v_pipeline_tpp.py `generate` (:937-1140), with the 4
step ranks folded into one process as its single-GPU twin causal_s2v_pipeline.py does (one KV cache per step):
- per clip r: noise randn(16, 12, h, w) from a CPU Generator seeded seed + r (their device generator); 12 latent frames
  = infer_frames 48, i.e. 4 blocks of 3 latent frames;
- clip 0 and clip 1: sink prefill (`sink_flag=True`, t = 0, current_start 0) into each of the 4 step caches; at clip 1
  the reference is the rolled sink frame, the first latent of clip 0 block 0's final latents (their VAE rank's
  `block_latents[:, :, 0:1]`, broadcast before clip 1's prefill); motion latents stay those of the job (TPP never
  re-encodes them);
- per block: audio slice of 12 video frames, pose zeros, context[0:1]; step i calls the model with kv_cache[i],
  t = [t_i] * 3, current_start = (4r + block) * 3 * frame_seqlen, then diffusers' FlowMatchEulerDiscreteScheduler
  (1000, shift=3, set_timesteps(4)) steps with `_step_index` forced to i, as their TPP does;
- the KV cache of a step holds one clip (max_seq_len = 12 latent frames of tokens), a ring once current_start passes it;
  the cond cache has 3000 slots in their code (for 720x400), 256 here; only the first cond_end are used.
- the sink RoPE offset: their `_forward_inference` draws `random.randint(4, 30)` on every call; here `random.randint` is
  replaced for the run by a planned list (drawn from numpy seed OFFSET_SEED, one per (block, step)); every call is
  checked to be randint(4, 30) and the offsets used are saved.

Patches (applied at run time; their files are never edited), to run their code on a CPU in float32:
1. causal_model_s2v.py `self.freqs = ....to("cuda")` in __init__ -> kept on the CPU;
2. `_forward_sink`'s `torch.zeros([1,5120,nf,...]).to(dtype=torch.bfloat16,...)` -> self.dim channels, model dtype;
3. `self.norm3(x.to(torch.bfloat16))` -> `self.norm3(x)` (float32 throughout);
4. `attention` (cuDNN SDPA, CUDA only) and `flash_attention` (flash-attn, CUDA only) -> torch SDPA in the inputs'
   dtype with k_lens as a key mask (make_wan_dit_goldens.sdpa_flash_attention; in these calls k_lens always equals
   the key count);
5. ENABLE_COMPILE=false (their inference_utils compiles _forward_inference with inductor at import otherwise);
6. the liveavatar package __init__s are skipped (stub packages, __path__ set): they import the whole training stack.
Patches 1-3 are exact string replacements on the source of causal_model_s2v.py, each asserted to match once; the
module is then executed from the patched text under its own name.

Writes tests/golden/liveavatar/stream_tiny.safetensors and stream_tiny.json. Tests never run this script.
"""

import argparse
import json
import os
import random
import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from official_env import as_metadata, provenance  # tests/golden/, on sys.path as the script's folder

META: dict[str, str] = {}  # the official commit and versions, set in main()


def save_file_with_provenance(tensors, path) -> None:
    save_file(tensors, str(path), metadata=META)

HERE = Path(__file__).resolve().parent
OUT = HERE / "liveavatar"
WEIGHTS = HERE / "wan_s2v" / "dit_tiny_weights.safetensors"
LA_COMMIT = "9c2c38de1715e553127b42c82cb959f756b02595"  # Alibaba-Quark/LiveAvatar HEAD in the mirror, 2026-07-26

# The DiT goldens' tiny configuration and the SDPA stand-in of the S2V DiT goldens (this folder is on sys.path when run as above).
# The extra causal arguments of CausalWanModel_S2V keep their defaults, as in their scripts (slide_motion_frames=False,
# local_attn_size=-1).
from make_wan_dit_goldens import TINY, sdpa_flash_attention as sdpa_attention  # noqa: E402

MOTION_FRAMES = 73
LAT_MOTION = (MOTION_FRAMES + 3) // 4  # 19
INFER_FRAMES = 48  # their scripts' --infer_frames: (48 + 3 + 73) // 4 - 19 = 12 latent frames per clip
FRAMES_PER_BLOCK = 3
CLIPS = 2
STEPS = 4
LAT_H, LAT_W = 8, 16  # non-square (h != w catches a swapped axis); multiples of 8 for FramePack's 4x kernel
SEED = 420  # their --base_seed
INPUT_SEED = 7
OFFSET_SEED = 11

PATCHES = [  # (old, new): exact text in causal_model_s2v.py at LA_COMMIT, replaced once
    ('dim=1).to("cuda")', "dim=1)"),
    ("x = [torch.zeros([1,5120,nf,height//2,width//2]).to(dtype=torch.bfloat16,device=x[0].device)]*bs",
     "x = [torch.zeros([1,self.dim,nf,height//2,width//2]).to(dtype=self.patch_embedding.weight.dtype,"
     "device=x[0].device)]*bs"),
    ("self.norm3(x.to(torch.bfloat16))", "self.norm3(x)"),
]


def import_causal(la_repo: Path):
    """Import CausalWanModel_S2V from an extracted LiveAvatar tree with the patches above."""
    os.environ["ENABLE_COMPILE"] = "false"  # read by liveavatar/models/wan/inference_utils.py at import
    root = la_repo / "liveavatar"
    for name in ["liveavatar", "liveavatar.models", "liveavatar.models.wan", "liveavatar.models.wan.wan_2_2",
                 "liveavatar.models.wan.wan_2_2.modules", "liveavatar.models.wan.wan_2_2.modules.s2v",
                 "liveavatar.models.wan.wan_2_2.distributed"]:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = pkg
    import liveavatar.models.wan.wan_2_2.modules.model as la_model

    path = root / "models" / "wan" / "causal_model_s2v.py"
    src = path.read_text()
    for old, new in PATCHES:
        assert src.count(old) == 1, f"patch target not found exactly once: {old!r}"
        src = src.replace(old, new)
    name = "liveavatar.models.wan.causal_model_s2v"
    mod = types.ModuleType(name)
    mod.__file__, mod.__package__ = str(path), "liveavatar.models.wan"
    sys.modules[name] = mod
    exec(compile(src, str(path), "exec"), mod.__dict__)
    la_model.flash_attention = sdpa_attention  # WanCrossAttention (text and audio injector) looks it up here
    mod.attention = sdpa_attention  # the streaming self-attention and sink prefill
    mod.flash_attention = sdpa_attention
    return mod.CausalWanModel_S2V


class PlannedRandint:
    """Stands in for random.randint during the run: returns the planned sink offsets in order, checking every call is
    their randint(4, 30)."""

    def __init__(self, offsets: list[int]):
        self.offsets = list(offsets)
        self.used: list[int] = []

    def __call__(self, a, b):
        assert (a, b) == (4, 30), f"unexpected random.randint({a}, {b})"
        v = self.offsets[len(self.used)]
        self.used.append(v)
        return v


def new_cache(model, ring: int, cond: int) -> list[dict]:
    """Their _initialize_kv_cache with the tiny shapes (their code hard-codes [.., 40, 128] and 3000 cond slots)."""
    h, dh = model.num_heads, model.dim // model.num_heads
    return [{"k": torch.zeros(1, ring, h, dh), "v": torch.zeros(1, ring, h, dh),
             "cond_k": torch.zeros(1, cond, h, dh), "cond_v": torch.zeros(1, cond, h, dh),
             "cond_end": torch.tensor([0], dtype=torch.long)} for _ in range(model.num_layers)]


def run_stream(model, inp: dict, randint: PlannedRandint) -> dict:
    """Their TPP loop over CLIPS clips in one process; returns the recorded tensors."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3)
    sched.set_timesteps(STEPS)
    timesteps, sigmas = sched.timesteps, sched.sigmas
    lat_frames = (INFER_FRAMES + 3 + MOTION_FRAMES) // 4 - LAT_MOTION  # 12
    num_blocks = lat_frames // FRAMES_PER_BLOCK  # 4
    frame_seq = LAT_H // 2 * LAT_W // 2
    ring = lat_frames * frame_seq  # their max_seq_len = prod(target_shape) // 4
    cond_slots = 256  # their code hard-codes 3000 slots for 720x400 and uses the first cond_end of them
    caches = [new_cache(model, ring, cond_slots) for _ in range(STEPS)]
    cross = [{"k": torch.zeros(1, 0), "v": torch.zeros(1, 0), "is_init": False} for _ in range(model.num_layers)]
    context, motion, ref = inp["context"], inp["motion"][None], inp["ref"][None]  # (L, C), (1,16,19,h,w), (1,16,1,h,w)
    rec: dict[str, torch.Tensor] = {"timesteps": timesteps.clone(), "sigmas": sigmas.clone()}
    for r in range(CLIPS):
        gen = torch.Generator().manual_seed(SEED + r)
        clip_noise = torch.randn(16, lat_frames, LAT_H, LAT_W, generator=gen)  # (16, 12, h, w)
        rec[f"clip{r}.noise"] = clip_noise.clone()
        cond_latents = torch.zeros(1, 16, lat_frames, LAT_H, LAT_W)  # no pose video: COND[0] * 0
        audio_clip = inp["audio"][..., r * INFER_FRAMES:(r + 1) * INFER_FRAMES]  # (1, 25, C_a, 48)
        if r == 1:
            ref = rec["clip0.block0.latents"][None, :, 0:1].clone()  # the rolled sink frame (1, 16, 1, h, w)
        rec[f"clip{r}.sink_ref"] = ref[0].clone()
        common = dict(context=[context], seq_len=None, motion_latents=motion, ref_latents=ref,
                      motion_frames=[MOTION_FRAMES, LAT_MOTION], drop_motion_frames=False)
        t0 = time.perf_counter()
        for step in range(STEPS):  # sink prefill of every step's cache (each TPP rank prefills its own)
            model([clip_noise[:, :FRAMES_PER_BLOCK]], t=torch.zeros(1, FRAMES_PER_BLOCK),
                  cond_states=cond_latents[:, :, :FRAMES_PER_BLOCK], audio_input=audio_clip[..., :12],
                  sink_flag=True, kv_cache=caches[step], crossattn_cache=cross, current_start=0,
                  current_end=FRAMES_PER_BLOCK * frame_seq, **common)
        print(f"clip {r}: sink prefill x{STEPS} {time.perf_counter() - t0:.2f} s, "
              f"cond_end {int(caches[0][0]['cond_end'])}")
        for b in range(num_blocks):
            t0 = time.perf_counter()
            key = f"clip{r}.block{b}"
            fs = slice(b * FRAMES_PER_BLOCK, (b + 1) * FRAMES_PER_BLOCK)
            audio = audio_clip[..., b * 12:(b + 1) * 12]  # (1, 25, C_a, 12)
            rec[f"{key}.audio"] = audio.clone()
            start = (r * num_blocks + b) * FRAMES_PER_BLOCK * frame_seq
            x = clip_noise[:, fs]  # (16, 3, h, w)
            steps_in, steps_out, ts, offs = [], [], [], []
            for i, t in enumerate(timesteps):
                timestep = torch.tensor([t] * FRAMES_PER_BLOCK).unsqueeze(0)  # (1, 3) float32
                n_used = len(randint.used)
                v = model([x], t=timestep, cond_states=cond_latents[:, :, fs], audio_input=audio, kv_cache=caches[i],
                          crossattn_cache=cross, current_start=start, current_end=start + FRAMES_PER_BLOCK * frame_seq,
                          mask=None, **common)[0]  # (16, 3, h, w)
                assert len(randint.used) == n_used + 1  # one offset per streaming forward
                offs.append(randint.used[-1])
                steps_in.append(x.clone())
                steps_out.append(v.clone())
                ts.append(timestep[0].clone())
                sched._step_index, sched._begin_index = i, 0
                x = sched.step(v[None], t, x[None], return_dict=False)[0][0]  # (16, 3, h, w)
            rec[f"{key}.step_in"] = torch.stack(steps_in)  # (4, 16, 3, h, w)
            rec[f"{key}.flow"] = torch.stack(steps_out)  # (4, 16, 3, h, w) the model's output
            rec[f"{key}.t"] = torch.stack(ts)  # (4, 3) per-frame timesteps
            rec[f"{key}.sink_offset"] = torch.tensor(offs)  # (4,)
            rec[f"{key}.latents"] = x.clone()  # (16, 3, h, w) after the 4 Euler steps
            rec[f"{key}.current_start"] = torch.tensor(start)
            print(f"{key}: current_start {start}, offsets {offs}, max|flow| {rec[key + '.flow'].abs().max():.4f}, "
                  f"{time.perf_counter() - t0:.2f} s")
    for name in ("k", "v", "cond_k", "cond_v"):
        rec[f"cache_shape.{name}"] = torch.tensor(list(caches[0][0][name].shape))
    rec["cache_shape.cond_end"] = caches[0][0]["cond_end"].clone()
    # The ring of step 0 after the last block, layer 0 (ring slots in write order), to check our cache contents.
    rec["final.step0.layer0.k"] = caches[0][0]["k"][0].clone()
    rec["final.step0.layer0.cond_k"] = caches[0][0]["cond_k"][0, :int(caches[0][0]["cond_end"])].clone()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--la-repo", type=Path, required=True, help="folder holding the extracted liveavatar/ package")
    ap.add_argument("--official-git", type=Path, required=True,
                    help="a git clone of Alibaba-Quark/LiveAvatar: its commit and requirements.txt pins are checked and recorded")
    args = ap.parse_args()
    global META
    META = as_metadata(provenance(args.official_git, "Alibaba-Quark/LiveAvatar"))  # refuses outside the official pins
    warnings.filterwarnings("ignore", category=FutureWarning)  # their torch.cuda.amp.autocast, on every call
    Causal = import_causal(args.la_repo.resolve())
    torch.manual_seed(0)
    model = Causal(**TINY).float().eval()
    weights = load_file(WEIGHTS)
    missing, unexpected = model.load_state_dict(weights, strict=True)
    assert not missing and not unexpected

    gen = torch.Generator().manual_seed(INPUT_SEED)
    inp = dict(
        ref=torch.randn(16, 1, LAT_H, LAT_W, generator=gen),
        motion=torch.randn(16, LAT_MOTION, LAT_H, LAT_W, generator=gen),
        context=torch.randn(7, TINY["text_dim"], generator=gen),
        audio=torch.randn(1, 25, TINY["audio_dim"], CLIPS * INFER_FRAMES, generator=gen),
    )
    n_calls = CLIPS * 4 * STEPS
    offsets = np.random.default_rng(OFFSET_SEED).integers(4, 31, size=n_calls).tolist()
    planned = PlannedRandint(offsets)
    real_randint = random.randint
    random.randint = planned
    try:
        with torch.no_grad():
            rec = run_stream(model, inp, planned)
    finally:
        random.randint = real_randint
    assert planned.used == offsets
    rec.update({f"input.{k}": v.clone() for k, v in inp.items() if k != "audio"})  # audio: the per-block slices

    OUT.mkdir(parents=True, exist_ok=True)
    save_file_with_provenance({k: v.contiguous() for k, v in rec.items()}, OUT / "stream_tiny.safetensors")
    settings = dict(
        liveavatar_commit=LA_COMMIT, weights=str(WEIGHTS.relative_to(HERE.parent.parent)), config=TINY,
        motion_frames=MOTION_FRAMES, infer_frames=INFER_FRAMES, frames_per_block=FRAMES_PER_BLOCK, clips=CLIPS,
        blocks_per_clip=4, steps=STEPS, latent_hw=[LAT_H, LAT_W], noise_seed=SEED, input_seed=INPUT_SEED,
        offset_seed=OFFSET_SEED, sink_offsets=offsets, patches=[p[0] for p in PATCHES],
        dtype="float32", torch=torch.__version__,
        regenerate="OMP_NUM_THREADS=1 nice -n 19 $OFFICIAL_VENV/bin/python tests/golden/make_liveavatar_goldens.py "
                   "--la-repo /tmp/la --official-git $REPO",
        official=json.loads(META["official"]),
    )
    (OUT / "stream_tiny.json").write_text(json.dumps(settings, indent=2) + "\n")
    size = (OUT / "stream_tiny.safetensors").stat().st_size
    print(f"wrote {OUT}: {len(rec)} tensors, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
