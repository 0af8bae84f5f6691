"""Make the SwiftVR goldens: the official streaming inference (H-oliday/SwiftVR, swiftvr/) at a tiny size, float32 on
CPU, attention backend "sdpa", matmul precision "highest", fixed seeds.

    mkdir -p /tmp/swiftvr-src && git -C $REPO archive HEAD swiftvr | tar -x -C /tmp/swiftvr-src
    OMP_NUM_THREADS=1 nice -n 19 $OFFICIAL_VENV/bin/python tests/golden/make_swiftvr_goldens.py \
        --src /tmp/swiftvr-src --official-git $REPO

$REPO is a git clone of H-oliday/SwiftVR; $OFFICIAL_VENV its own environment (tests/golden/official_env.py create
--profile swiftvr): the script refuses to run under versions outside that repository's requirements.txt and records
the commit and the versions in every safetensors file it writes (header metadata `official`) and in official.json.

What runs. A tiny release directory is written with the official classes' own saves (`reae.safetensors` and
`prompt_embedding.safetensors` by safetensors, `transformer/` by diffusers' `save_pretrained`) and loaded back through
`pipeline.py:SwiftVRPipeline.from_pretrained`, then `SwiftVRPipeline.to("cpu", "float32", attention_backend="sdpa")`
(which sets matmul precision "high"; it is set back to "highest" after). The release's CLI (script/inference.py) does
not run as published (it reads `args.attention_backend`, which its parser never defines), so the library is driven:
- cases a, b, c1, e: `pipeline.py:SwiftVRPipeline.restore_video` itself, on a folder of PNG frames, `png_save=True`
  (the whole official path: `io.py:get_video_info` and its crop to x8, `runner.py:run_pipeline` and its threads,
  `io.py:preprocess_clip_uint8`, `streaming/chunk.py:build_chunk_specs`, the PNG writer);
- case c2: `pipeline.py:SwiftVRPipeline.stream` (README "Streaming"): `StreamSession.step` per group, then `flush`.
Recording wraps, without changing what they compute, the streaming methods (`StreamingTAE.encode_chunk_fixed` /
`decode_chunk_fixed` / `encode_chunk` / `decode_chunk`, `StreamingDiT.denoise` / `denoise_last_chunk`) and the
module function `streaming/dit.py:_dit_forward_chunk` (so the exact DiT input, RoPE t-offset and prediction are seen).
Each case gets a freshly loaded pipeline (the RoPE table's growth persists in the model otherwise).

The tiny size. `from_pretrained` passes ReAE no size arguments (it builds `ReAE(path)` with the defaults: 40,946,364
parameters), so its weights are not committed: they follow `seeded_weights(shapes, REAE_SEED)` of
tests/golden/swiftvr_weights.py, and the golden stores the rule's parameters and `tensor_sha256` of the result. The DiT
(TINY_DIT, 2 heads x 16, 2 layers, window (2, 2), rope_max_seq_len 8) is committed as the release layout:
release/transformer/config.json and diffusion_pytorch_model.safetensors (written by diffusers, so its provenance is
official.json), with release/prompt_embedding.safetensors; release/keys.json lists every key and shape of all three
files.

Sizes: "S" = LQ 13x11 (H x W) cropped to 8x8, x2 -> 16x16, padded to 32x32: latents 2x2, one token per latent frame.
"W" = LQ 59x75 cropped to 56x72, x2 -> 112x144, padded to 128x160: latents 8x10, tokens 4x5, so with window (2, 2):
h starts [0, 2] (shifted [0, 1, 2] pruned to [0, 2]), w starts [0, 2, 3] (shifted [0, 1, 3]), clamped on both.

Cases (tests/golden/swiftvr/case_*.safetensors; JSON `case` in the header describes every chunk):
- a: restore_video(upscale 2, clip_len 24, dit_overlap 0), S, 83 frames given -> 81 used: FIRST 28, MIDDLE 24,
  MIDDLE 24, LAST 5 (b 1, padded with the previous chunk's last 5 encoder latents); the RoPE table grows at the first
  MIDDLE (t_off 7 + 6 > 8): its rows after the run are stored. Carried encoder/decoder states after chunk 0.
- b: restore_video, S, 13 frames: one LAST chunk (b 3), padded with 3 zero latents at t 0..2; the preprocessed clip too.
- c1: restore_video(dit_overlap 1), S, 61 frames: FIRST 28, MIDDLE 24 (previous LQ latent prepended, t_off g_off-1),
  LAST 9 (b 2).
- c2: stream(upscale 2, dit_overlap 1) on the raw 13x11 frames (no x8 crop there: 26x22 padded to 32x32), steps of
  24, 24 and 10 frames, then flush (2 leftover frames padded to 4).
- d (the RoPE extension) is covered by a, c1 and c2, which all run past rope_max_seq_len; `rope_len` is the table's
  length after the run (the first extension's t_off + T + 256), `rope.freqs_cos` / `rope.freqs_sin` the table.
- e: restore_video, W, 5 frames: one LAST chunk (b 1, 5 zero pads) at the window-exercising size; decoded float for
  the first output frame only (size), uint8 for all.
Tensor names per chunk i (latents are [1, T, 48, h, w], NTCHW, as the decoder takes them): `chunk{i}.latents` the
  encoder's output; `chunk{i}.dit_in` what the transformer saw (after LAST padding or the overlap latent);
  `chunk{i}.dit_pred` its prediction; `chunk{i}.dit_out` what the decoder got; `chunk{i}.decoded` the decoder's frames
  after clamp, trim and the padding crop, float [0, 1], [1, T, 3, H, W]; `chunk{i}.pad_src` (LAST after another chunk)
  the previous chunk's last 6 encoder latents handed to `denoise_last_chunk`. Per case: `input_uint8` [N, H, W, 3]
  (all frames given), `output_uint8` [N', H, W, 3] (the PNGs restore_video wrote; c2: the official
  `io.py:ntchw_to_uint8_frames` of each step's frames), and `state.enc.mem_{j}` / `state.dec.mem_{j}` [1, 1, C, h, w]
  (case a, after chunk 0: the MemBlock boundary frames `streaming/tae.py:apply_parallel_with_boundary` carries, j the
  block's index in `encoder` / `decoder`; the TPool leftovers are checked to be empty). The header's `case` JSON also
  holds `tokens_hw` and `window_starts` (`models/transformer.py:_make_hw_starts` at those tokens, plain and shifted).

Not run by the tests (they never import the official code); committed to document how the goldens were made.
"""

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from official_env import SWIFTVR_IMPORTED, as_metadata, provenance  # tests/golden/, on sys.path as the script's folder
from swiftvr_weights import RULE, seeded_weights, tensor_sha256

OUT = Path(__file__).resolve().parent / "swiftvr"
META: dict[str, str] = {}  # the official commit and versions, set in main()
PROV: dict[str, str] = {}

TINY_DIT = dict(
    patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, in_channels=48, out_channels=48, text_dim=32,
    freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=8, pos_embed_seq_len=None, enable_swa=True,
    self_attn_window_hw=[2, 2], use_torch_compile=False, compile_mode="default",
)
PROMPT_TOKENS = 8
REAE_SEED, DIT_SEED, PROMPT_SEED = 1234, 4321, 77


def frames_uint8(n: int, h: int, w: int, seed: int) -> torch.Tensor:
    """Smooth moving colour gradients plus seeded noise, uint8 [n, h, w, 3]."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float64).view(n, 1, 1, 1)
    y = torch.arange(h, dtype=torch.float64).view(1, h, 1, 1) / h
    x = torch.arange(w, dtype=torch.float64).view(1, 1, w, 1) / w
    c = torch.arange(3, dtype=torch.float64).view(1, 1, 1, 3)
    base = 127.5 + 90 * torch.sin(2 * math.pi * (1.3 * x + 0.7 * y + t / 16 + c / 3))
    noise = 12 * torch.randn((n, h, w, 3), generator=g, dtype=torch.float64)
    return (base + noise).round().clamp(0, 255).to(torch.uint8)


def write_release(root: Path, official) -> dict:
    """The release layout, written by the official classes' own saves; returns its key/shape listing."""
    ReAE, WanTransformer3DModel = official["ReAE"], official["WanTransformer3DModel"]
    reae = ReAE()
    reae_sd = seeded_weights({k: tuple(v.shape) for k, v in reae.state_dict().items()}, REAE_SEED)
    reae.load_state_dict(reae_sd, strict=True)
    save_file({k: v.contiguous() for k, v in reae.state_dict().items()}, str(root / "reae.safetensors"))

    dit = WanTransformer3DModel(**TINY_DIT)
    dit_sd = seeded_weights({k: tuple(v.shape) for k, v in dit.state_dict().items()}, DIT_SEED)
    dit.load_state_dict(dit_sd, strict=True)
    dit.save_pretrained(str(root / "transformer"))  # config.json + diffusion_pytorch_model.safetensors

    g = torch.Generator().manual_seed(PROMPT_SEED)
    prompt = torch.randn((1, PROMPT_TOKENS, TINY_DIT["text_dim"]), generator=g)  # batch-first, as the loader's [0]
    save_file({"prompt_emb": prompt}, str(root / "prompt_embedding.safetensors"))

    def listing(path: Path) -> dict:
        with safe_open(str(path), "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in sorted(f.keys())}

    return {
        "reae.safetensors": listing(root / "reae.safetensors"),
        "transformer/diffusion_pytorch_model.safetensors":
            listing(root / "transformer" / "diffusion_pytorch_model.safetensors"),
        "prompt_embedding.safetensors": listing(root / "prompt_embedding.safetensors"),
        "reae_rule": {"seed": REAE_SEED, **RULE, "sha256": tensor_sha256(reae_sd)},
        "transformer_rule": {"seed": DIT_SEED, **RULE, "sha256": tensor_sha256(dit_sd)},
        "_sd": (reae_sd, dit_sd, prompt),
    }


def load_pipeline(root: Path, official, expect):
    """The release directory through the official loader, checked against what was written, ready for fp32 CPU."""
    pipe = official["SwiftVRPipeline"].from_pretrained(str(root))
    reae_sd, dit_sd, prompt = expect
    for name, model, want in (("reae", pipe.reae, reae_sd), ("transformer", pipe.transformer, dit_sd)):
        got = model.state_dict()
        assert set(got) == set(want), (name, set(got) ^ set(want))
        assert all(torch.equal(got[k], want[k]) for k in want), name
    assert torch.equal(pipe.prompt_emb, prompt[0])
    pipe.to("cpu", dtype="float32", attention_backend="sdpa", torch_compile=False)
    torch.set_float32_matmul_precision("highest")  # `to` set "high" (runner.py:enable_max_fps_runtime)
    return pipe


class Recorder:
    """Wraps the streaming methods of one pipeline and the module's DiT forward; collects what each chunk saw."""

    def __init__(self, pipe, official):
        self.chunks: list[dict] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.pipe = pipe
        tae, dit = pipe.tae_stream, pipe.dit_stream
        dit_mod = official["dit_module"]
        self._dit_mod, self._orig_forward = dit_mod, dit_mod._dit_forward_chunk
        self.states = []

        def wrap_encode(fn, fixed):
            def encode(x, *args):
                z = fn(x, *args)
                spec = args[0] if fixed else None
                c = {"kind": spec.ctype.value, "frame_start": spec.frame_start, "frame_count": spec.frame_count,
                     "b": spec.b, "is_first_decode": spec.is_first_decode} if fixed else {"kind": "stream",
                                                                                         "frames_in": x.shape[1]}
                c["latent_count"] = 0 if z is None else int(z.shape[1])
                self.chunks.append(c)
                self._cur = len(self.chunks) - 1
                if z is not None:
                    self.put("latents", z)
                return z
            return encode

        def wrap_decode(fn):
            def decode(z, *args):
                x = fn(z, *args)
                self.put("dit_out", z)
                if x is not None:
                    self.put("decoded", official["crop"](x, *self.pad_hw))  # as the caller crops it next
                self.chunks[self._cur]["frames_out"] = 0 if x is None else int(x.shape[1])
                self.states.append((tae._enc_st, tae._dec_st))
                return x
            return decode

        def wrap_denoise(fn):
            def denoise(lq, prompt_emb):
                self.chunks[self._cur]["g_off_before"] = dit._g_off
                return fn(lq, prompt_emb)
            return denoise

        def wrap_last(fn):
            def last(z, spec, prompt_emb, prev, n_lat, device, dtype):
                self.chunks[self._cur]["g_off_before"] = dit._g_off
                self.chunks[self._cur]["pad_count"] = (n_lat + 1) - (spec.b + 1)
                if prev is not None:
                    self.put("pad_src", prev.permute(0, 2, 1, 3, 4))
                return fn(z, spec, prompt_emb, prev, n_lat, device, dtype)
            return last

        def forward(transformer, chunk, temb, tp, enc_hs, t_off=0):
            pred = self._orig_forward(transformer, chunk, temb, tp, enc_hs, t_off=t_off)
            self.chunks[self._cur]["t_off"] = int(t_off)
            self.chunks[self._cur]["dit_latents"] = int(chunk.shape[2])
            self.put("dit_in", chunk.permute(0, 2, 1, 3, 4))
            self.put("dit_pred", pred.permute(0, 2, 1, 3, 4))
            return pred

        self.pad_hw = (0, 0)
        tae.encode_chunk_fixed = wrap_encode(tae.encode_chunk_fixed, True)
        tae.encode_chunk = wrap_encode(tae.encode_chunk, False)
        tae.flush_encoder = self._wrap_flush(tae, wrap_encode)
        tae.decode_chunk_fixed = wrap_decode(tae.decode_chunk_fixed)
        tae.decode_chunk = wrap_decode(tae.decode_chunk)
        dit.denoise = wrap_denoise(dit.denoise)
        dit.denoise_last_chunk = wrap_last(dit.denoise_last_chunk)
        dit_mod._dit_forward_chunk = forward

    @staticmethod
    def _wrap_flush(tae, wrap_encode):
        orig = tae.flush_encoder

        def flush():
            left = tae._enc_left
            z = orig()
            if left is not None:  # recorded as a chunk of its own: the leftover frames, padded to 4
                wrap_encode(lambda x: z, False)(left)
            return z
        return flush

    def put(self, name: str, t: torch.Tensor) -> None:
        self.tensors[f"chunk{self._cur}.{name}"] = t.detach().to(torch.float32).contiguous().clone()

    def close(self) -> None:
        self._dit_mod._dit_forward_chunk = self._orig_forward


def write_pngs(frames: torch.Tensor, folder: Path) -> None:
    folder.mkdir(parents=True)
    for i, f in enumerate(frames.numpy()):
        Image.fromarray(f).save(folder / f"{i}.png")


def read_pngs(folder: Path) -> torch.Tensor:
    paths = sorted(folder.glob("*.png"), key=lambda p: int(p.stem))
    return torch.from_numpy(np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths]))


def run_restore(root, official, expect, name, frames, *, clip_len=24, dit_overlap=0, upscale=2, keep_states=False,
                keep_preprocessed=False, decoded_frames=None, work: Path) -> tuple[dict, dict]:
    pipe = load_pipeline(root, official, expect)
    rec = Recorder(pipe, official)
    lq_h, lq_w = (frames.shape[1] // 8) * 8, (frames.shape[2] // 8) * 8
    out_h, out_w = lq_h * upscale, lq_w * upscale
    rec.pad_hw = ((32 - out_h % 32) % 32, (32 - out_w % 32) % 32)
    pre = {}
    if keep_preprocessed:
        orig = pipe.tae_stream.encode_chunk_fixed

        def keep(x, spec):
            pre[f"chunk{len(rec.chunks)}.preprocessed"] = x.detach().clone()
            return orig(x, spec)
        pipe.tae_stream.encode_chunk_fixed = keep
    src, dst = work / name / "in", work / name / "out"
    write_pngs(frames, src)
    try:
        stats = pipe.restore_video(src, dst, upscale=upscale, clip_len=clip_len, dit_overlap=dit_overlap,
                                   png_save=True, verbose=False)
    finally:
        rec.close()
    out = read_pngs(dst)
    tensors = dict(rec.tensors)
    tensors.update(pre)
    tensors["input_uint8"] = frames
    tensors["output_uint8"] = out
    # The PNGs are the official truncation of the decoded frames: (x * 255).clamp(0, 255) to uint8.
    decoded = [tensors.get(f"chunk{i}.decoded") for i in range(len(rec.chunks))]
    decoded = torch.cat([d for d in decoded if d is not None], dim=1)
    assert np.array_equal(official["to_uint8"](decoded), out.numpy()), name
    if decoded_frames is not None:  # keep only the first output frames of the decoded floats (size)
        for i in range(len(rec.chunks)):
            k = f"chunk{i}.decoded"
            if k in tensors:
                tensors[k] = tensors[k][:, :decoded_frames].contiguous()
    if keep_states:
        enc, dec = rec.states[0]
        for side, st in (("enc", enc), ("dec", dec)):
            for k, v in st.items():
                assert not k.startswith("tpool") or v is None, (k, None if v is None else v.shape)
                if v is not None:
                    tensors[f"state.{side}.{k}"] = v.detach().contiguous().clone()
    case = {
        "entry": "SwiftVRPipeline.restore_video", "frames_given": int(frames.shape[0]),
        "frames_written": stats["frames"],
        "lq_hw": [lq_h, lq_w], "out_hw": [out_h, out_w], "pad_hw": list(rec.pad_hw), "upscale": upscale,
        "clip_len": clip_len, "dit_overlap": dit_overlap, "png_save": True, "chunks": rec.chunks,
        "decoded_frames_kept": decoded_frames, "states": "after chunk 0" if keep_states else None,
    }
    return finish(pipe, official, tensors, case)


def run_stream(root, official, expect, frames, steps, *, upscale=2, dit_overlap=1) -> tuple[dict, dict]:
    pipe = load_pipeline(root, official, expect)
    rec = Recorder(pipe, official)
    out_h, out_w = frames.shape[1] * upscale, frames.shape[2] * upscale
    rec.pad_hw = ((32 - out_h % 32) % 32, (32 - out_w % 32) % 32)
    session = pipe.stream(upscale=upscale, dit_overlap=dit_overlap)
    outs, pos, returned = [], 0, []
    try:
        for n in steps:
            y = session.step(frames[pos:pos + n])
            pos += n
            returned.append(None if y is None else int(y.shape[1]))
            if y is not None:
                outs.append(y)
        y = session.flush()
        returned.append(None if y is None else int(y.shape[1]))
        if y is not None:
            outs.append(y)
    finally:
        rec.close()
    assert pos == frames.shape[0]
    tensors = dict(rec.tensors)
    tensors["input_uint8"] = frames
    tensors["output_uint8"] = torch.from_numpy(official["to_uint8"](torch.cat(outs, dim=1)))
    case = {
        "entry": "SwiftVRPipeline.stream + StreamSession.step/flush", "frames_given": int(frames.shape[0]),
        "steps": list(steps), "step_returns": returned, "lq_hw": list(frames.shape[1:3]), "out_hw": [out_h, out_w],
        "pad_hw": list(rec.pad_hw), "upscale": upscale, "dit_overlap": dit_overlap, "chunks": rec.chunks,
    }
    return finish(pipe, official, tensors, case)


def finish(pipe, official, tensors: dict, case: dict) -> tuple[dict, dict]:
    """What every case adds: the RoPE table as the run left it, and the official window starts at the case's tokens."""
    rope = pipe.transformer.rope
    tensors["rope.freqs_cos"] = rope.freqs_cos.detach().contiguous().clone()
    tensors["rope.freqs_sin"] = rope.freqs_sin.detach().contiguous().clone()
    case["rope_len"] = int(rope.freqs_cos.shape[0])
    _, _, _, lat_h, lat_w = tensors["chunk0.dit_in"].shape
    hw = (lat_h // 2, lat_w // 2)  # tokens: the patch is 1 x 2 x 2
    win = [min(w, n) for w, n in zip(TINY_DIT["self_attn_window_hw"], hw)]
    case["tokens_hw"] = list(hw)
    case["window_starts"] = {
        name: [t.tolist() for t in official["hw_starts"](*hw, *win, shift)]
        for name, shift in (("plain", False), ("shifted", True))}
    return tensors, case


def save_case(name: str, tensors: dict, case: dict) -> None:
    meta = dict(META)
    meta["case"] = json.dumps(case, sort_keys=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(OUT / f"case_{name}.safetensors"),
              metadata=meta)
    size = (OUT / f"case_{name}.safetensors").stat().st_size
    print(f"case {name}: {len(tensors)} tensors, {size} bytes, chunks "
          + ", ".join(f"{c['kind']}:{c.get('latent_count')}" for c in case["chunks"]))


def import_official(src: Path) -> dict:
    sys.path.insert(0, str(src))
    import swiftvr.io as sio
    import swiftvr.streaming.dit as dit_module
    from swiftvr import SwiftVRPipeline
    from swiftvr.models import ReAE, WanTransformer3DModel
    from swiftvr.models.transformer import _make_hw_starts

    return {"SwiftVRPipeline": SwiftVRPipeline, "ReAE": ReAE, "WanTransformer3DModel": WanTransformer3DModel,
            "dit_module": dit_module, "crop": sio.crop_spatial_padding_ntchw, "to_uint8": sio.ntchw_to_uint8_frames,
            "hw_starts": _make_hw_starts}


def main():
    global META, PROV
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, required=True, help="folder holding the extracted swiftvr/ package")
    ap.add_argument("--official-git", type=Path, required=True, help="the git clone it came from")
    ap.add_argument("--only", default="", help="comma-separated cases to run (default: all)")
    args = ap.parse_args()
    PROV = provenance(args.official_git, "H-oliday/SwiftVR", SWIFTVR_IMPORTED)  # refuses outside the official pins
    META = as_metadata(PROV)
    official = import_official(args.src.resolve())
    torch.manual_seed(0)
    OUT.mkdir(exist_ok=True)
    only = set(filter(None, args.only.split(",")))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = tmp / "release"
        root.mkdir()
        listing = write_release(root, official)
        expect = listing.pop("_sd")
        rel = OUT / "release"
        (rel / "transformer").mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "transformer" / "config.json", rel / "transformer" / "config.json")
        shutil.copy(root / "transformer" / "diffusion_pytorch_model.safetensors",
                    rel / "transformer" / "diffusion_pytorch_model.safetensors")
        save_file({"prompt_emb": expect[2]}, str(rel / "prompt_embedding.safetensors"), metadata=META)
        (rel / "keys.json").write_text(json.dumps(listing, indent=1, sort_keys=True) + "\n")
        (OUT / "official.json").write_text(json.dumps(
            {"official": PROV, "tiny_dit": TINY_DIT, "prompt_tokens": PROMPT_TOKENS, "prompt_seed": PROMPT_SEED,
             "reae_rule": listing["reae_rule"], "transformer_rule": listing["transformer_rule"],
             "matmul_precision": "highest", "attention_backend": "sdpa", "dtype": "float32", "device": "cpu"},
            indent=1, sort_keys=True) + "\n")

        work = tmp / "work"
        S = (13, 11)
        cases = {
            "a": lambda: run_restore(root, official, expect, "a", frames_uint8(83, *S, seed=1), keep_states=True,
                                     work=work),
            "b": lambda: run_restore(root, official, expect, "b", frames_uint8(13, *S, seed=2), keep_preprocessed=True,
                                     work=work),
            "c1": lambda: run_restore(root, official, expect, "c1", frames_uint8(61, *S, seed=3), dit_overlap=1,
                                      work=work),
            "c2": lambda: run_stream(root, official, expect, frames_uint8(58, *S, seed=4), (24, 24, 10)),
            "e": lambda: run_restore(root, official, expect, "e", frames_uint8(5, 59, 75, seed=5), decoded_frames=1,
                                     work=work),
        }
        for name, run in cases.items():
            if only and name not in only:
                continue
            tensors, case = run()
            save_case(name, tensors, case)


if __name__ == "__main__":
    main()
