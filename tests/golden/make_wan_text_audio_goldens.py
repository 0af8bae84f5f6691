"""Make the Wan2.2-S2V text (umT5) and audio (wav2vec2) goldens with the official code, float32 on CPU, fixed seeds.

    mkdir -p /tmp/wan22_textaudio && git -C $REPO archive HEAD wan | tar -x -C /tmp/wan22_textaudio
    OMP_NUM_THREADS=1 nice -n 19 $OFFICIAL_VENV/bin/python tests/golden/make_wan_text_audio_goldens.py --wan-repo /tmp/wan22_textaudio --official-git $REPO

$REPO is a git clone of Wan-Video/Wan2.2; $OFFICIAL_VENV its own environment (tests/golden/official_env.py create):
the script refuses to run under versions outside that repository's requirements.txt and records the commit and
the versions it ran with in every safetensors file it writes (header metadata `official`).

Writes to tests/golden/wan_s2v/:
- t5_tokenizer/: a tiny Unigram tokenizer (tokenizer.json + tokenizer_config.json + special_tokens_map.json) built
  here with the `tokenizers` library from a few sentences (whole words plus single characters, log-frequency
  scores), laid out like the release's google/umt5-xxl/ folder. It
  has no normalizer and the pre-tokenizer transformers 5 rebuilds for T5 (WhitespaceSplit + Metaspace), so
  AutoTokenizer (transformers 5 rebuilds the pipeline) and the verbatim tokenizer.json (what transformers <= 4.51,
  the official pin, loads) give the same ids; the script checks that.
- t5_weights.safetensors: the official `T5Encoder` (wan/modules/t5.py) at a tiny size (vocab 192, dim 32,
  4 heads, ffn 64, 2 layers, 32 buckets per layer, shared_pos False as umt5_xxl), random weights in the
  official key layout (RMS gains re-randomised away from 1 so their mapping is checked).
- t5_io.safetensors: per prompt i, `ids_i` / `mask_i` (1, 512) from the official HuggingfaceTokenizer (clean
  'whitespace', max length 512) and `out_i` (L_i, 32), the official T5EncoderModel.__call__ output (one prompt
  per call, as speech2video.py calls it); `batch_out_i` from one batched call of all prompts; `out_bf16_i` the
  same call with the weights cast to bf16 (the release's dtype).
- t5_prompts.json: the prompts (one needs ftfy/html/whitespace cleaning, one is truncated at 512 tokens).
- w2v_tiny/: a tiny random `Wav2Vec2ForCTC` (24 layers as the release, hidden 16, 2 heads, stable layer norm and
  layer-norm conv features as wav2vec2-large-xlsr-53, the real conv kernels/strides) saved with save_pretrained
  (safetensors), plus its preprocessor_config.json (do_normalize true, 16 kHz).
- w2v_io.safetensors: `wave` (96000,) 6 s of a synthetic speech-like waveform at 16 kHz; `feat` (25, T30, 16),
  the official AudioEncoder.extract_audio_feat(return_all_layers=True); `bucket` (1, 25, 16, 80*nr), the official
  get_audio_embed_bucket_fps(fps=16, batch_frames=80, m=0) laid out as WanS2V.encode_audio lays it out (kept fp32:
  speech2video.py then casts it to bf16); `frame_idx` (4000,), the official get_sample_indices 30-fps indices of
  video frames 0..3999 at fps 16; `t30_for_tw` (3001,), the official linear_interpolation output length for
  T_w = 0..3000 (-1: the official code raises, T_w < 2); `nr_t30` / `nr` the official clip count for a few T30 around multiples of 150.

Patches (to run the official code on a CPU), applied here at run time: stub `wan` packages so wan/__init__ does not run;
torch.cuda.current_device patched while t5.py is imported; a stub `librosa` whose load() hands the synthetic
waveform back at 16 kHz; the official AudioEncoder's Wav2Vec2Processor replaced by Wav2Vec2FeatureExtractor (the
processor's audio call is the feature extractor's call; the tiny folder has no CTC vocabulary).

Not run by the tests (they never import the official code); committed to document how the goldens were made.
"""

import argparse
import copy
import importlib
import json
import math
import sys
import types
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from official_env import as_metadata, provenance  # tests/golden/, on sys.path as the script's folder

META: dict[str, str] = {}  # the official commit and versions, set in main()


def save_file_with_provenance(tensors, path) -> None:
    save_file(tensors, str(path), metadata=META)

OUT = Path(__file__).resolve().parent / "wan_s2v"
TEXT_LEN = 512
T5_TINY = dict(vocab=192, dim=32, dim_attn=32, dim_ffn=64, num_heads=4, num_layers=2, num_buckets=32,
               shared_pos=False, dropout=0.1)
S2V_NEG = ("画面模糊，最差质量，画面模糊，细节模糊不清，情绪激动剧烈，手快速抖动，字幕，丑陋的，残缺的，多余的手指，画得不好的手部，"
           "画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")
TRAIN_SENTENCES = [
    "A woman is talking to the camera in a bright room.",
    "The man sings a slow song, smiling and nodding.",
    "Close-up of a face, speaking calmly; soft light and warm colors.",
    "A person explains the weather forecast in front of a map.",
    S2V_NEG,
]
PROMPTS = [
    "A woman is talking to the camera.",
    "  The man &amp;amp; his   dog\n\tsing a  song   ",  # html.unescape twice, whitespace collapse
    S2V_NEG,
    "hi",
    " ".join(["a person speaking calmly in a warm bright room with soft light"] * 40),  # > 512 tokens: truncated
]


def stub_packages(wan_repo: Path, waves: dict):
    """Import the official modules without wan/__init__ (which imports every pipeline) and without librosa."""
    import transformers  # noqa: F401  (imported before the librosa stub: its availability probe needs a real spec)
    from transformers import AutoTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC  # noqa: F401

    for name, sub in (("wan", "wan"), ("wan.modules", "wan/modules"), ("wan.modules.s2v", "wan/modules/s2v")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(wan_repo / sub)]
        sys.modules[name] = pkg
    librosa = types.ModuleType("librosa")

    def load(path, sr=None):
        assert sr == 16000, sr
        return waves[path], 16000

    librosa.load = load
    sys.modules["librosa"] = librosa


def import_t5():
    # T5EncoderModel's default `device=torch.cuda.current_device()` is evaluated at import, which fails without CUDA.
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        return importlib.import_module("wan.modules.t5")
    finally:
        torch.cuda.current_device = real


def make_tokenizer(folder: Path):
    """A Unigram vocabulary built by counting (not trained: the trainer's parallel sums make reruns differ): the
    training words as whole pieces, their characters as fallback pieces, scores from log frequencies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    words, chars = Counter(), Counter()
    for sentence in TRAIN_SENTENCES:
        for word in sentence.split():
            words["▁" + word] += 1
            chars.update(word)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    n_words, n_chars = sum(words.values()), sum(chars.values())
    for word, count in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        pieces.append((word, round(math.log(count / n_words), 4)))
    for char, count in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0])):
        pieces.append((char, round(math.log(count / n_chars) - 4.0, 4)))  # below any whole word
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    assert [tok.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    assert tok.get_vocab_size() <= T5_TINY["vocab"], tok.get_vocab_size()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    cfg = {"tokenizer_class": "T5Tokenizer", **special, "extra_ids": 0, "additional_special_tokens": [],
           "model_max_length": TEXT_LEN}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return tok


def make_t5(t5, tok_dir: Path, raw_tok):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = t5.T5Encoder(**T5_TINY).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.25 * torch.randn_like(p))  # RMS gains start at 1: vary them so the mapping shows
    # The official wrapper, without its __init__ (which builds umt5_xxl at full size and loads a file).
    enc = t5.T5EncoderModel.__new__(t5.T5EncoderModel)
    enc.text_len, enc.dtype, enc.device = TEXT_LEN, torch.float32, torch.device("cpu")
    enc.model = model
    enc.tokenizer = t5.HuggingfaceTokenizer(name=str(tok_dir), seq_len=TEXT_LEN, clean="whitespace")
    auto = AutoTokenizer.from_pretrained(str(tok_dir))
    tensors = {}
    with torch.no_grad():
        batch = enc(PROMPTS, torch.device("cpu"))
        for i, prompt in enumerate(PROMPTS):
            ids, mask = enc.tokenizer([prompt], return_mask=True, add_special_tokens=True)
            # transformers 5 rebuilds T5 tokenizers; the tiny one is made so that changes nothing.
            cleaned = enc.tokenizer._clean(prompt)
            verbatim = raw_tok.encode(cleaned).ids[: TEXT_LEN - 1]
            verbatim = (verbatim if verbatim[-1] == 1 else verbatim + [1])[:TEXT_LEN]
            n = int(mask.sum())
            assert ids[0, :n].tolist() == verbatim == auto(cleaned, truncation=True, max_length=TEXT_LEN).input_ids
            out = enc([prompt], torch.device("cpu"))[0]
            tensors[f"ids_{i}"], tensors[f"mask_{i}"] = ids.contiguous(), mask.contiguous()
            tensors[f"out_{i}"] = out.contiguous()
            tensors[f"batch_out_{i}"] = batch[i].contiguous()
            print(f"t5 prompt {i}: {n} tokens, out {tuple(out.shape)}, max|out| {out.abs().max():.3f}")
        # The release runs the encoder in bf16 (T5EncoderModel dtype=bf16): the same weights rounded to bf16.
        enc.model = copy.deepcopy(model).to(torch.bfloat16)
        for i, prompt in enumerate(PROMPTS):
            tensors[f"out_bf16_{i}"] = enc([prompt], torch.device("cpu"))[0].contiguous()
    save_file_with_provenance({k: v.contiguous() for k, v in model.state_dict().items()}, str(OUT / "t5_weights.safetensors"))
    save_file_with_provenance(tensors, str(OUT / "t5_io.safetensors"))
    (OUT / "t5_prompts.json").write_text(json.dumps({"text_len": TEXT_LEN, "config": T5_TINY, "prompts": PROMPTS},
                                                    ensure_ascii=False, indent=2) + "\n")


def speech_like(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """Voiced 'syllables' (a gliding pitch with harmonics, 4 per second) over low noise, with a pause."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(h * phase) / h for h in range(1, 6))
    envelope = np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 2 * ((t < 2.5) | (t > 3.2))
    x = 0.3 * voiced * envelope + 0.01 * rng.standard_normal(t.size)
    return x.astype(np.float32)


def official_t30(ae_mod, t_w: int) -> int:
    """The official 30-fps length for T_w wav2vec2 frames; -1 where the official code fails (T_w < 2)."""
    try:
        return ae_mod.linear_interpolation(torch.zeros(1, t_w, 1), input_fps=50, output_fps=30).shape[1]
    except RuntimeError:
        return -1


def make_w2v(wan_repo: Path, waves: dict):
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC

    folder = OUT / "w2v_tiny"
    cfg = Wav2Vec2Config(
        vocab_size=33, hidden_size=16, num_hidden_layers=24, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8,) * 7, conv_kernel=(10, 3, 3, 3, 3, 2, 2), conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_bias=True,
        feat_extract_norm="layer", do_stable_layer_norm=True, num_conv_pos_embeddings=128,
        num_conv_pos_embedding_groups=16, feat_extract_activation="gelu", hidden_act="gelu", layer_norm_eps=1e-5,
        architectures=["Wav2Vec2ForCTC"])
    torch.manual_seed(1)
    model = Wav2Vec2ForCTC(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.25 * torch.randn_like(p))
            elif p.dim() >= 2 and "conv" not in name:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)  # larger than the 0.02 init: attention is live
    model.save_pretrained(str(folder), safe_serialization=True)
    # save_pretrained leaves no room for our header metadata: the run's provenance goes beside the weights.
    (folder / "official.json").write_text(json.dumps({"official": json.loads(META["official"])}, indent=2) + "\n")
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=True).save_pretrained(str(folder))

    ae_mod = importlib.import_module("wan.modules.s2v.audio_encoder")
    ae_mod.Wav2Vec2Processor = Wav2Vec2FeatureExtractor
    enc = ae_mod.AudioEncoder(device="cpu", model_id=str(folder))
    wave = waves["speech.wav"]
    with torch.no_grad():
        feat = enc.extract_audio_feat("speech.wav", return_all_layers=True)  # (25, T30, 16)
        bucket, nr = enc.get_audio_embed_bucket_fps(feat, fps=16, batch_frames=80, m=0)  # (80*nr, 25, 16)
    bucket = bucket.unsqueeze(0).permute(0, 2, 3, 1)  # (1, 25, 16, 80*nr): WanS2V.encode_audio's layout
    print(f"w2v: wave {wave.shape}, feat {tuple(feat.shape)}, bucket {tuple(bucket.shape)}, nr {nr}")

    frame_idx = ae_mod.get_sample_indices(original_fps=30, total_frames=7500, target_fps=16, num_sample=4000,
                                          fixed_start=0)
    t30 = [official_t30(ae_mod, tw) for tw in range(3001)]
    nr_t30 = [1, 2, 148, 149, 150, 151, 299, 300, 301, 449, 450, 451, 1000]
    nrs = [ae_mod.AudioEncoder.get_audio_embed_bucket_fps(enc, torch.zeros(1, n, 1), 16, 80, 0)[1] for n in nr_t30]
    save_file_with_provenance({"wave": torch.from_numpy(wave), "feat": feat.contiguous(), "bucket": bucket.contiguous(),
               "frame_idx": torch.as_tensor(frame_idx, dtype=torch.int64), "t30_for_tw": torch.tensor(t30),
               "nr_t30": torch.tensor(nr_t30), "nr": torch.tensor(nrs)}, str(OUT / "w2v_io.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wan-repo", type=Path, required=True, help="folder holding the official wan/ package")
    ap.add_argument("--official-git", type=Path, required=True,
                    help="a git clone of Wan-Video/Wan2.2: its commit and requirements.txt pins are checked and recorded")
    args = ap.parse_args()
    global META
    META = as_metadata(provenance(args.official_git, "Wan-Video/Wan2.2"))  # refuses outside the official pins
    waves = {"speech.wav": speech_like(6.0)}
    stub_packages(args.wan_repo, waves)
    t5 = import_t5()
    OUT.mkdir(parents=True, exist_ok=True)
    raw_tok = make_tokenizer(OUT / "t5_tokenizer")
    make_t5(t5, OUT / "t5_tokenizer", raw_tok)
    make_w2v(args.wan_repo, waves)


if __name__ == "__main__":
    main()
