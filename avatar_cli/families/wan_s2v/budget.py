"""The wan-s2v family's budget (runtime/budget.py) at any frame size, counted on the meta device: what `avatar plan`
sizes a layout with, for a model directory or for the release's size named without weights (`wan-s2v-14b`).

- Parameters: the DiT and umT5 built on meta from the config and counted in the runtime dtype, the VAE and wav2vec2
  in float32 (the family's ParallelPlan.float32); the DiT's and umT5's blocks as block offload and FSDP2 see them;
  with `runtime.weights: fp8 | int8`, the DiT's and umT5's quantized Linears as torchao lays them out
  (runtime/quantize.py). A job's `dit:` file (dit_file.py) counts what its load keeps as the file stores it, from
  the file's header (a GGUF file's quantized tensors, a scaled-FP8 file's FP8 Linears of the blocks and injectors),
  and the rest in the runtime dtype.
- Clip mode (the official loop): one DiT forward over one 80-frame clip with its motion latents (tokens from the
  frame size), its activations counted with fused attention (runtime/meta_count.py) and its FLOPs with
  FlopCounterMode; sampling.steps forwards per clip, twice with guidance. The decode as the family runs it:
  PUT_LATENTS latents at a time with the decoder cache carried, then the last 73 frames re-encoded into the next
  clip's motion latents; its FLOPs scaled from one hand-off to the clip's 20 latents.
- Streaming mode (LiveAvatar): one block forward (3 latent frames) against a full ring and the sink; 4 forwards per
  12-frame block; the rolling state is the 4 steps' rings, the sink and the decoder cache; one latent decoded at a
  time.
"""

import functools

import torch

from avatar_cli.families.wan_s2v import causal
from avatar_cli.families.wan_s2v.components import UMT5Text
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.family import CLIP_FRAMES, NATIVE_FPS, PUT_LATENTS, QUANTIZED
from avatar_cli.families.wan_s2v.text import UMT5Params
from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAEParams
from avatar_cli.runtime.budget import Budget, ModelBytes, blocked_bytes, grouped_bytes
from avatar_cli.runtime.device import dtype_name
from avatar_cli.runtime.meta_count import n_bytes, on_meta, peak_and_flops
from avatar_cli.runtime.quantize import linears_under, tensor_bytes

TEXT_TOKENS = 128  # a prompt's trimmed tokens (the DiT pads to text_len: the count moves nothing but the embedder)


def dit_file_bytes(path, p: WanDiTParams, dtype: torch.dtype, weights: str = "bf16") -> ModelBytes:
    """The DiT read from a `dit:` file as its load holds it in `dtype`: each tensor the load keeps as stored at its
    bytes from the file's header (dit_file.held_quantized; no weight is read), the rest as the meta count has them
    (in `dtype`, under `runtime.weights` for a float file)."""
    from avatar_cli.families.wan_s2v import dit_file

    dit, paths = _dit(p, dtype), dict(QUANTIZED)["dit"]
    f = dit_file.inspect(path)
    kept = dit_file.held_quantized(f, {n + ".weight" for n in linears_under(dit, paths)}, dtype)
    per_name = tensor_bytes(dit, weights, paths, dtype)
    per_name.update(kept)
    if not kept:
        return grouped_bytes(dit, dit.blocks, per_name, weights if weights != "bf16" else dtype_name(dtype),
                        file_total=f.nbytes)
    return grouped_bytes(dit, dit.blocks, per_name, dit_file.quantized_already(f) or f.format, file_total=f.nbytes,
                    stored_quantized=True)


@functools.lru_cache(maxsize=2)
def _dit(p: WanDiTParams, dtype: torch.dtype) -> WanS2VDiT:
    return on_meta(WanS2VDiT, p, dtype)


@functools.lru_cache(maxsize=4)
def _dit_bytes(p: WanDiTParams, dtype: torch.dtype, weights: str, paths: tuple[str, ...] | None) -> ModelBytes:
    dit = _dit(p, dtype)
    return blocked_bytes(dit, dit.blocks, dtype, weights, paths)


@functools.lru_cache(maxsize=4)
def _t5_bytes(p: UMT5Params, dtype: torch.dtype, weights: str = "bf16",
              paths: tuple[str, ...] | None = None) -> ModelBytes:
    with torch.device("meta"):
        t5 = UMT5Text(p).to(dtype)
    return blocked_bytes(t5, t5.model.encoder.block, dtype, weights, paths)


@functools.lru_cache(maxsize=2)
def _w2v_bytes(dim: int) -> ModelBytes:
    """The release's wav2vec2-large-xlsr-53 encoder (the family runs its Wav2Vec2Model, float32)."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model  # modeling: paid only where a plan counts

    cfg = Wav2Vec2Config(hidden_size=dim, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4 * dim,
                         conv_dim=(512,) * 7, conv_kernel=(10, 3, 3, 3, 3, 2, 2), conv_stride=(5, 2, 2, 2, 2, 2, 2),
                         conv_bias=True, feat_extract_norm="layer", do_stable_layer_norm=True,
                         num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16)
    with torch.device("meta"):
        model = Wav2Vec2Model(cfg)
    return ModelBytes(n_bytes(model), "float32")


@functools.lru_cache(maxsize=8)
def _vae_decode(vp: WanVAEParams, lat_h: int, lat_w: int, latents: int,
                dtype: torch.dtype = torch.float32) -> tuple[int, float, int]:
    """(peak bytes, FLOPs, decoder cache bytes) of decoding `latents` latents continuing a timeline, in `dtype`."""
    vae = on_meta(WanVAE, vp, dtype)
    z = torch.empty(1, vp.z_dim, latents, lat_h, lat_w, device="meta")
    with torch.no_grad():
        _, cache = vae.decode_stream(z)  # a timeline started, to have a cache to continue
    return (*peak_and_flops(lambda: vae.decode_stream(z, cache)), cache.nbytes())


@functools.lru_cache(maxsize=8)
def _vae_encode(vp: WanVAEParams, lat_h: int, lat_w: int, frames: int,
                dtype: torch.dtype = torch.float32) -> tuple[int, float]:
    """(peak bytes, FLOPs) of encoding `frames` frames from a fresh encoder cache, in `dtype`."""
    vae = on_meta(WanVAE, vp, dtype)
    x = torch.empty(1, 3, frames, lat_h * 8, lat_w * 8, device="meta")
    return peak_and_flops(lambda: vae.encode(x))


@functools.lru_cache(maxsize=8)
def _clip_forward(p: WanDiTParams, dtype: torch.dtype, lat_h: int, lat_w: int) -> tuple[int, float]:
    """(activation peak, FLOPs) of one clip's DiT forward with motion latents (clip r >= 1), one rank."""
    dit = _dit(p, dtype)
    frames = CLIP_FRAMES // 4
    with torch.device("meta"):
        inputs = {"x": torch.empty(p.in_dim, frames, lat_h, lat_w), "t": 900.0,
                  "context": torch.empty(min(TEXT_TOKENS, p.text_len), p.text_dim, dtype=torch.bfloat16),
                  "ref": torch.empty(p.in_dim, 1, lat_h, lat_w),
                  "motion": torch.empty(p.in_dim, p.lat_motion_frames, lat_h, lat_w),
                  "cond": torch.empty(p.cond_dim, frames, lat_h, lat_w),
                  "audio": torch.empty(1, 25, p.audio_dim, 4 * frames)}
    return peak_and_flops(lambda: dit(**inputs))


@functools.lru_cache(maxsize=8)
def _block_forward(p: WanDiTParams, dtype: torch.dtype, lat_h: int, lat_w: int) -> tuple[int, float, int, int]:
    """(activation peak, FLOPs, bytes of the 4 rings, bytes of the sink) of one streaming block forward against a
    full ring and the sink, one rank."""
    dit = _dit(p, dtype)
    c = causal.CausalCaches.empty(p, lat_h, lat_w, dtype=dtype, device="meta")
    sink = causal.sink_tokens(p, lat_h, lat_w)
    c.sink_k = c.sink_v = torch.empty(p.num_layers, sink, p.num_heads, p.head_dim, dtype=dtype, device="meta")
    f = causal.FRAMES_PER_BLOCK
    with torch.device("meta"):
        inputs = causal.BlockInputs(torch.empty(1, p.text_len, p.dim, dtype=dtype),
                                    torch.empty(f, p.num_audio_token + 1, p.dim), torch.empty(f, p.dim))
        x, t = torch.empty(p.in_dim, f, lat_h, lat_w, dtype=dtype), torch.full((f,), 602.15)

    def forward():
        causal.causal_forward(dit, c, 0, x, t, 8, inputs, 10)

    rings = 2 * c.k.numel() * c.k.element_size()
    return *peak_and_flops(forward), rings, 2 * c.sink_k.numel() * c.sink_k.element_size()


def budget(config, mode: str, size: tuple[int, int], dtype: torch.dtype, steps: int, guidance: float,
           weights: str = "bf16", vae_dtype: torch.dtype = torch.float32) -> Budget:
    """The family's budget at `size` (width, height), its DiT and umT5 in `dtype`, their Linears under
    `runtime.weights`, the VAE in `vae_dtype` (runtime.vae_dtype); config: a WanS2VConfig (a directory's, or the
    release's preset)."""
    p: WanDiTParams = config.dit
    w, h = size
    lat_h, lat_w = h // 8, w // 8
    dit = (dit_file_bytes(config.dit_file, p, dtype, weights) if config.dit_file is not None
           else _dit_bytes(p, dtype, weights, dict(QUANTIZED).get("dit")))
    models = {"dit": dit,
              "text": _t5_bytes(config.t5, dtype, weights, dict(QUANTIZED).get("text")),
              "audio": _w2v_bytes(p.audio_dim),
              "vae": ModelBytes(n_bytes(on_meta(WanVAE, config.vae, vae_dtype)), dtype_name(vae_dtype))}
    if mode == "streaming":
        peak, flops, rings, sink = _block_forward(p, dtype, lat_h, lat_w)
        dec_peak, dec_flops, dec_cache = _vae_decode(config.vae, lat_h, lat_w, 1, vae_dtype)
        return Budget("wan-s2v", mode, size, NATIVE_FPS, models, a2v_peak=peak, decode_peak=dec_peak,
                      state=rings + sink, decode_state=dec_cache, forward_flops=flops, forwards=causal.STEPS,
                      chunk_frames=4 * causal.FRAMES_PER_BLOCK, decode_flops=dec_flops * causal.FRAMES_PER_BLOCK,
                      step_state=rings // causal.STEPS + sink,
                      ring_layer=(rings // causal.STEPS + sink) // p.num_layers, sink=sink,
                      notes=(f"key/value rings {rings / 1e9:.2f} GB ({causal.STEPS} steps x {causal.RING_FRAMES} "
                             f"latent frames) and the sink {sink / 1e9:.2f} GB: on the device, or in host memory "
                             "(runtime.rings)",))
    peak, flops = _clip_forward(p, dtype, lat_h, lat_w)
    latents = CLIP_FRAMES // 4
    dec_peak, dec_flops, dec_cache = _vae_decode(config.vae, lat_h, lat_w, PUT_LATENTS, vae_dtype)
    enc_peak, enc_flops = _vae_encode(config.vae, lat_h, lat_w, p.motion_frames, vae_dtype)
    motion = p.in_dim * p.lat_motion_frames * lat_h * lat_w * 4
    return Budget("wan-s2v", mode, size, NATIVE_FPS, models, a2v_peak=peak, decode_peak=max(dec_peak, enc_peak),
                  state=0, decode_state=dec_cache + motion, forward_flops=flops, forwards=steps * (2 if guidance > 1 else 1),
                  chunk_frames=CLIP_FRAMES, decode_flops=dec_flops * latents / PUT_LATENTS + enc_flops)
