"""Wan2.2-S2V text encoder (umT5 via transformers) and audio features (wav2vec2) against the official code's goldens
(tests/golden/make_wan_text_audio_goldens.py: the official T5Encoder / T5EncoderModel wrapper and AudioEncoder at a
tiny size, float32, fixed seeds)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from avatar_cli.families.wan_s2v import adapter_t5
from avatar_cli.families.wan_s2v.audio import (
    NUM_LAYERS, WindowedAudioFeatures, audio_features, clip_audio, feature_time_s, frame_indices, hidden_states,
    load_wav2vec2, normalization_stats, normalize, num_clips, num_feature_frames, num_w2v_frames)
from avatar_cli.families.wan_s2v.text import (
    S2V_NEGATIVE_PROMPT, TEXT_LEN, UMT5_XXL, UMT5Params, build_text_encoder, clean_prompt, encode, load_tokenizer,
    tokenize, umt5_state_shapes)

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"
TOK_DIR = GOLDEN / "t5_tokenizer"
W2V_DIR = GOLDEN / "w2v_tiny"
PROMPTS = json.loads((GOLDEN / "t5_prompts.json").read_text(encoding="utf-8"))
TINY = UMT5Params(vocab_size=PROMPTS["config"]["vocab"], dim=PROMPTS["config"]["dim"],
                  ffn_dim=PROMPTS["config"]["dim_ffn"], num_heads=PROMPTS["config"]["num_heads"],
                  num_layers=PROMPTS["config"]["num_layers"], num_buckets=PROMPTS["config"]["num_buckets"])
T5_IO = load_file(str(GOLDEN / "t5_io.safetensors"))
W2V_IO = load_file(str(GOLDEN / "w2v_io.safetensors"))

# Windowed wav2vec2 vs the whole-audio call at tiny size (random weights, whose attention spreads over the whole
# window: a pessimistic case). Measured on this 40 s signal with 12 s windows, 4 s overlap (5 windows): 6.4e-2
# (max |d| / max |f| over all 25 layers; rms 3.9e-2); the first hidden state, before attention, 5e-7. With the
# default 30 s / 6 s windows: 1.5e-2 here, 2.6e-2 on 120 s.
WINDOWED_TOL = 8e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOK_DIR)


def tiny_t5(attn: str):
    with torch.device("meta"):
        model = build_text_encoder(TINY, attn_implementation=attn)
    return adapter_t5.load_into(model, load_file(str(GOLDEN / "t5_weights.safetensors")))


@pytest.fixture(scope="module")
def w2v():
    return load_wav2vec2(W2V_DIR)


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """Voiced syllables (a gliding pitch with 5 harmonics, 4 per second) over low noise, with pauses."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    phase = 2 * np.pi * np.cumsum(140 + 40 * np.sin(2 * np.pi * 0.7 * t)) / 16000
    voiced = sum(np.sin(h * phase) / h for h in range(1, 6))
    envelope = np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 2 * (np.sin(2 * np.pi * 0.1 * t) > -0.8)
    return (0.3 * voiced * envelope + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


# ---------------------------------------------------------------- text


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_t5_matches_official(tokenizer, attn):
    model = tiny_t5(attn)
    prompts = PROMPTS["prompts"]
    outs = encode(model, tokenizer, prompts)  # one batch; the official goldens were one prompt per call
    for i, out in enumerate(outs):
        ref = T5_IO[f"out_{i}"]
        assert out.shape == ref.shape, (i, out.shape, ref.shape)
        # eager was bit-identical to the official encoder in float32 with AVX-512 kernels, 1.9e-7 with AVX2 ones
        # (other matmul kernels, other rounding); sdpa within 1e-6. The bound: 1e-5.
        assert rel(out, ref) <= 1e-5, (i, rel(out, ref))
        assert rel(out, T5_IO[f"batch_out_{i}"]) <= 1e-5
    assert [o.shape[0] for o in outs] == [int(T5_IO[f"mask_{i}"].sum()) for i in range(len(prompts))]
    assert outs[4].shape[0] == TEXT_LEN  # the long prompt is truncated to 512 tokens, EOS included


def test_t5_bf16_close_to_official_bf16(tokenizer):
    """The release runs the encoder in bf16: same weights rounded to bf16, both sides. Measured: eager is
    bit-identical on this CPU (sdpa 6e-3 .. 1.2e-2); the margin is for other CPUs' bf16 matmul kernels."""
    model = tiny_t5("eager").to(torch.bfloat16)
    for i, out in enumerate(encode(model, tokenizer, PROMPTS["prompts"])):
        assert out.dtype == torch.bfloat16
        assert rel(out, T5_IO[f"out_bf16_{i}"]) <= 2e-2, (i, rel(out, T5_IO[f"out_bf16_{i}"]))


def test_tokenizer_matches_official_ids(tokenizer):
    for i, prompt in enumerate(PROMPTS["prompts"]):
        ids, mask = tokenize(tokenizer, [prompt])
        assert ids.shape == (1, TEXT_LEN)
        assert torch.equal(ids, T5_IO[f"ids_{i}"]) and torch.equal(mask, T5_IO[f"mask_{i}"])
    ids, mask = tokenize(tokenizer, [PROMPTS["prompts"][4]])
    assert int(mask.sum()) == TEXT_LEN and int(ids[0, -1]) == tokenizer.eos_token_id  # truncated, EOS kept
    ids, mask = tokenize(tokenizer, ["hi"])
    n = int(mask.sum())
    assert int(ids[0, n - 1]) == tokenizer.eos_token_id and (ids[0, n:] == tokenizer.pad_token_id).all()


def test_tokenizer_folder(tokenizer):
    """The folder loads offline; transformers 5's AutoTokenizer (which rebuilds T5 tokenizers) agrees on it."""
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    auto = AutoTokenizer.from_pretrained(str(TOK_DIR))
    for prompt in PROMPTS["prompts"]:
        text = clean_prompt(prompt)
        assert tokenizer(text, truncation=True, max_length=TEXT_LEN).input_ids == \
            auto(text, truncation=True, max_length=TEXT_LEN).input_ids
    with pytest.raises(FileNotFoundError):
        load_tokenizer(GOLDEN)


def test_clean_prompt():
    assert clean_prompt("  The man &amp;amp; his   dog\n\tsing  ") == "The man & his dog sing"
    assert clean_prompt("caf\u00c3\u00a9") == "café"  # ftfy repairs mojibake


def test_negative_prompt():
    # The golden script copied the string from the official wan/configs/wan_s2v_14B.py (prompt 2).
    assert S2V_NEGATIVE_PROMPT == PROMPTS["prompts"][2]
    assert len(S2V_NEGATIVE_PROMPT) == 116 and S2V_NEGATIVE_PROMPT.startswith("画面模糊，最差质量")


def test_adapter_round_trip():
    wan = load_file(str(GOLDEN / "t5_weights.safetensors"))
    hf = adapter_t5.wan_to_hf(wan)
    assert hf["encoder.embed_tokens.weight"] is hf["shared.weight"]
    back = adapter_t5.hf_to_wan(hf)
    assert back.keys() == wan.keys() and all(back[k] is wan[k] for k in wan)
    model = tiny_t5("eager")
    sd = model.state_dict()
    assert adapter_t5.wan_to_hf(adapter_t5.hf_to_wan(sd)).keys() == sd.keys()
    assert all(torch.equal(adapter_t5.hf_to_wan(sd)[k], v) for k, v in wan.items())
    assert model.encoder.embed_tokens.weight is model.shared.weight  # re-tied after the assign load
    with pytest.raises(KeyError):
        adapter_t5.wan_key_to_hf("blocks.0.attn.qkv.weight")


def test_read_official_pth(tmp_path):
    """The release's file is a pickled torch.save state dict: read memory-mapped, tensors only."""
    wan = load_file(str(GOLDEN / "t5_weights.safetensors"))
    path = tmp_path / "t5.pth"
    torch.save({k: v.to(torch.bfloat16) for k, v in wan.items()}, str(path))
    sd = adapter_t5.load_wan_t5_state_dict(path)
    assert sd.keys() == wan.keys() and all(torch.equal(sd[k], wan[k].to(torch.bfloat16)) for k in wan)
    torch.save({"model": wan, "step": 3}, str(path))
    with pytest.raises(ValueError, match="flat state dict of tensors"):
        adapter_t5.load_wan_t5_state_dict(path)


def test_adapter_refuses_misfit():
    wan = load_file(str(GOLDEN / "t5_weights.safetensors"))
    with torch.device("meta"):
        model = build_text_encoder(TINY)
    broken = {k: v for k, v in wan.items() if k != "blocks.1.ffn.fc1.weight"}
    with pytest.raises(ValueError, match="missing: encoder.block.1.layer.1.DenseReluDense.wi_1.weight"):
        adapter_t5.load_into(model, broken)
    broken = dict(wan, **{"norm.weight": torch.ones(7)})
    with pytest.raises(ValueError, match="wrong shape: encoder.final_layer_norm.weight"):
        adapter_t5.load_into(model, broken)


def test_full_size_keys_on_meta():
    """Every key of the release's .pth maps onto a UMT5EncoderModel parameter of the same shape, and none is left."""
    official = {}
    for line in (GOLDEN / "t5_keys.txt").read_text().splitlines():
        name, shape = line.split("\t")
        official[name] = tuple(json.loads(shape))
    assert len(official) == 242
    with torch.device("meta"):
        model = build_text_encoder(UMT5_XXL)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}  # the tied embedding once, as shared.weight
    mapped = {adapter_t5.wan_key_to_hf(k): s for k, s in official.items()}
    assert mapped == params
    assert sum(np.prod(s) for s in official.values()) == 5_680_910_336 == sum(p.numel() for p in model.parameters())
    assert {adapter_t5.hf_key_to_wan(k) for k in model.state_dict()} == official.keys()


@pytest.mark.parametrize("size", ["tiny", "release"])
def test_written_out_shapes_equal_the_built_encoders(size: str):
    """umt5_state_shapes lists what build_text_encoder builds (header checks use it to skip the build and the
    modeling import): the same names, in the same order, with the same shapes."""
    from avatar_cli.families.wan_s2v.model_dir import T5_PRESETS

    p = T5_PRESETS[size]
    with torch.device("meta"):
        built = {k: tuple(v.shape) for k, v in build_text_encoder(p).state_dict().items()}
    assert list(umt5_state_shapes(p).items()) == list(built.items())


# ---------------------------------------------------------------- audio


def test_audio_features_match_official(w2v):
    model, extractor = w2v
    assert extractor.do_normalize
    feats = audio_features(model, extractor, W2V_IO["wave"].numpy())
    assert feats.shape == W2V_IO["feat"].shape == (NUM_LAYERS, 179, 16)
    assert rel(feats, W2V_IO["feat"]) <= 1e-6
    nr = num_clips(feats.shape[1])
    bucket = torch.cat([clip_audio(feats, 80 * r, 80) for r in range(nr)], dim=-1)
    assert bucket.shape == W2V_IO["bucket"].shape == (1, NUM_LAYERS, 16, 160)
    assert rel(bucket, W2V_IO["bucket"]) <= 1e-6


@pytest.mark.parametrize("stable", [True, False])
def test_last_layer_is_the_encoders_output(w2v, stable):
    """The official AudioEncoder stacks transformers 4.x's hidden states, whose last entry is the encoder's output:
    for the stable-layer-norm encoder (xlsr-53, the release's) the state after the encoder's final layer_norm.
    Held here from the layers themselves, whatever the installed transformers appends to `hidden_states`: entry i
    < 24 is the input of transformer layer i, entry 24 the final layer_norm of layer 23's output (stable) or layer
    23's output (post-norm, as wav2vec2-base), and the family's component (what the clip and streaming modes call)
    returns the same."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    from avatar_cli.families.wan_s2v.components import Wav2Vec2Audio

    model, extractor = w2v
    if not stable:  # the same tiny size with the post-norm encoder
        config = Wav2Vec2Config.from_dict({**model.config.to_dict(), "do_stable_layer_norm": False,
                                           "feat_extract_norm": "group"})
        torch.manual_seed(0)
        model = Wav2Vec2Model(config).eval()
    assert model.config.do_stable_layer_norm is stable
    encoder = model.encoder
    inputs, outputs = [], []
    hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0].clone())) for layer in encoder.layers]
    hooks.append(encoder.layers[-1].register_forward_hook(
        lambda m, a, out: outputs.append((out[0] if isinstance(out, tuple) else out).clone())))
    x = torch.from_numpy(normalize(speech_like(1.5, seed=3), extractor))  # (N,)
    try:
        h = hidden_states(model, x)  # (25, T_w, 16)
    finally:
        for hook in hooks:
            hook.remove()
    assert h.shape[0] == NUM_LAYERS == len(encoder.layers) + 1 and len(inputs) == len(encoder.layers)
    for i, inp in enumerate(inputs):
        assert torch.equal(h[i], inp[0]), i
    with torch.no_grad():
        last = encoder.layer_norm(outputs[0][0]) if stable else outputs[0][0]  # (T_w, 16)
    torch.testing.assert_close(h[-1], last, rtol=0, atol=1e-6)
    if stable:  # the normed state differs from the raw one: the check above could tell the two apart
        assert (h[-1] - outputs[0][0]).abs().max() > 0.1
        component = Wav2Vec2Audio.from_folder(W2V_DIR)
        assert torch.equal(component(x), h)


def test_bucketing_equals_official_frame_for_frame():
    """The pure bucketing, on the official features: every frame of every clip, zeros past the end."""
    feat, bucket = W2V_IO["feat"], W2V_IO["bucket"]
    for r in range(2):
        assert torch.equal(clip_audio(feat, 80 * r, 80), bucket[..., 80 * r: 80 * r + 80])
    assert torch.equal(clip_audio(feat, 37, 50), bucket[..., 37:87])  # any first frame, any length
    zero = bucket.abs().sum(dim=(0, 1, 2)) == 0
    assert zero.nonzero()[0].item() == 96 and zero[96:].all()  # frame 96 -> index 180 >= T30 = 179


def test_frame_indices_and_counts():
    assert torch.equal(frame_indices(4000), W2V_IO["frame_idx"])
    assert frame_indices(13)[[4, 12]].tolist() == [8, 22]  # 7.5 -> 8 and 22.5 -> 22: ties to even
    assert torch.equal(frame_indices(80, first_frame=160), W2V_IO["frame_idx"][160:240])
    t30 = W2V_IO["t30_for_tw"].tolist()
    assert [num_feature_frames(tw) for tw in range(2, len(t30))] == t30[2:]
    with pytest.raises(ValueError):
        num_feature_frames(1)  # the official code fails there too
    assert [num_clips(n) for n in W2V_IO["nr_t30"].tolist()] == W2V_IO["nr"].tolist()


def test_frame_count_formula(w2v):
    model, _ = w2v
    for n in (400, 719, 720, 1039, 1040, 16000, 16123):
        h = hidden_states(model, torch.randn(n))
        assert h.shape == (NUM_LAYERS, num_w2v_frames(n), 16) and num_w2v_frames(n) == (n - 400) // 320 + 1
    assert num_w2v_frames(399) == 0


def test_time_mapping():
    """Video frame k's features come from audio time k/16 s + (-4.2 .. +42.5) ms over any length: well under a
    frame (62.5 ms), so frame k lines up with audio frame k (no 3-frame lead, which would be 187.5 ms)."""
    for seconds in (6, 600, 4 * 3600):
        n = seconds * 16000 + 123
        t30 = num_feature_frames(num_w2v_frames(n))
        last = int(((frame_indices(seconds * 16 + 8) < t30).nonzero().max()))
        for k in list(range(0, 40)) + list(range(last - 40, last + 1)):
            offset = feature_time_s(k, n) - k / 16
            assert -0.0045 <= offset <= 0.043, (seconds, k, offset)
        assert feature_time_s(last + 1, n) is None
    assert feature_time_s(0, 96000) == pytest.approx(200 / 16000)  # frame 0: wav2vec2 frame 0, centred at 12.5 ms


def test_windowed_single_window_is_whole(w2v):
    model, extractor = w2v
    wave = W2V_IO["wave"].numpy()
    win = WindowedAudioFeatures.from_array(model, extractor, wave)  # 6 s < one 30 s window
    assert win.num_windows == 1
    whole = audio_features(model, extractor, wave)
    assert rel(win.features(0, win.t30), whole) <= 1e-6
    clips = torch.cat([win.clip(80 * r, 80) for r in range(2)], dim=-1)
    assert rel(clips, W2V_IO["bucket"]) <= 1e-6
    assert torch.equal(win.clip(200, 80), torch.zeros(1, NUM_LAYERS, 16, 80))  # wholly past the end


def test_windowed_long_audio(w2v):
    model, extractor = w2v
    wave = speech_like(40.0, seed=3)
    reads = []

    def read(a, b):
        reads.append(b - a)
        return wave[a:b]

    mean, std = normalization_stats(np.array_split(wave, 7))
    win = WindowedAudioFeatures(model, extractor, read, wave.size, mean=mean, std=std, window_s=12.0, overlap_s=4.0)
    assert win.num_windows == 5 and max(reads, default=0) == 0
    whole = audio_features(model, extractor, wave)
    feats = win.features(0, win.t30)
    assert feats.shape == whole.shape
    assert rel(feats, whole) <= WINDOWED_TOL
    assert rel(feats[0], whole[0]) <= 1e-5  # before attention the windows are exact (positional conv in the overlap)
    assert max(reads) <= 320 * (12 * 50 - 1) + 400  # memory bounded by the window, not the audio
    # Clips equal the bucketing of the windowed features, whatever the access order.
    later, first = win.clip(160, 80), win.clip(0, 80)
    assert torch.equal(first, clip_audio(feats, 0, 80)) and torch.equal(later, clip_audio(feats, 160, 80))
    assert len(win._cache) <= 2
    # Normalisation: the in-memory statistics are the extractor's own.
    exact = WindowedAudioFeatures.from_array(model, extractor, wave, window_s=12.0, overlap_s=4.0)
    x = normalize(wave, extractor)
    assert np.array_equal((wave - exact.mean) / exact.std, x)
    assert abs(mean - exact.mean) < 1e-6 and abs(std / exact.std - 1) < 1e-5
