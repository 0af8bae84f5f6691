"""Training at toy size: every phase lowers its loss, a halted run resumes to the same weights, and the
written model directory loads strictly through the registry."""

from pathlib import Path

import numpy as np
import pytest
import torch

from avatar_cli.errors import InputError
from avatar_cli.families.mini.audio import AudioParams
from avatar_cli.families.mini.config import SIZES
from avatar_cli.families.registry import load_modules, resolve_model
from avatar_cli.train import plan_for, train
from avatar_cli.train.data import clip_seeds, mel_features
from avatar_cli.synth import EVAL_IDENTITY_SEEDS, TRAIN_IDENTITY_SEEDS

PLAN = plan_for("tiny", dit_autocast=False, vae_steps=6, sr_steps=6, dit_steps=6, decoder_steps=6, dit_clips=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("train")
    summary = train(base / "model", size="tiny", work_dir=base / "work", seed=0, resume=False, plan=PLAN,
                    log=lambda e: None)
    return base, summary


def test_each_phase_lowers_its_loss(trained):
    _, summary = trained
    for phase in ("vae", "sr", "dit", "decoder"):
        probe = summary["probe"][phase]
        assert probe["after"] < probe["before"], (phase, probe)
    assert summary["steps"] == {"vae": PLAN.vae_steps, "sr": PLAN.sr_steps, "dit": PLAN.dit_steps,
                                "decoder": PLAN.decoder_steps}


def test_decoder_polish_from_a_model_dir_changes_the_decoder_only(trained, tmp_path):
    """--start-from DIR --phase decoder: the encoder (so the latent space the DiT and SR learned) is frozen."""
    base, _ = trained
    out = train(tmp_path / "model", size="tiny", work_dir=tmp_path / "work", seed=1, plan=PLAN,
                log=lambda e: None, start_from=base / "model", start_phase="decoder")
    assert out["steps"] == {"decoder": PLAN.decoder_steps} and out["start_from"] == str(base / "model")
    assert out["probe"]["decoder"]["after"] < out["probe"]["decoder"]["before"]
    a = load_modules(resolve_model(str(base / "model"), Path("/")))
    b = load_modules(resolve_model(str(tmp_path / "model"), Path("/")))
    changed = set()
    for name in a:
        for (k, va), vb in zip(a[name].model.state_dict().items(), b[name].model.state_dict().values()):
            if not torch.equal(va, vb):
                changed.add(k.split(".")[0] if name == "vae" else name)  # vae: encoder / decoder
    assert changed == {"decoder"}


def test_decoder_polish_can_thin_the_decoder(trained, tmp_path, monkeypatch):
    """A size whose decoder is thinner than the directory's: the encoder is taken as it is, the thin decoder
    starts from the leading channels of the wide one, and the polish trains it from there."""
    import dataclasses

    from avatar_cli.train.trainer import init_models, thin_init

    base, _ = trained
    wide = SIZES["tiny"]
    thin = dataclasses.replace(wide, vae=dataclasses.replace(wide.vae, decoder_channels=(8, 8, 12)))
    monkeypatch.setitem(SIZES, "tiny", thin)
    out = train(tmp_path / "model", size="tiny", work_dir=tmp_path / "work", seed=1, plan=PLAN,
                log=lambda e: None, start_from=base / "model", start_phase="decoder")
    assert out["probe"]["decoder"]["after"] < out["probe"]["decoder"]["before"]
    src = load_modules(resolve_model(str(base / "model"), Path("/")))["vae"].model.state_dict()
    got = load_modules(resolve_model(str(tmp_path / "model"), Path("/")))
    assert got["vae"].model.params.decoder_channels == (8, 8, 12)
    sd = got["vae"].model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in src.items() if k.startswith("encoder."))  # frozen
    assert sd["decoder.mid.conv1.weight"].shape == (12, 12, 3, 3)
    # The start: the wide decoder's leading slice (not a fresh init), which the polish then moved.
    start = thin_init(src["decoder.mid.conv1.weight"], sd["decoder.mid.conv1.weight"])
    fresh = init_models(thin, 1)["vae"].state_dict()["decoder.mid.conv1.weight"]
    assert (sd["decoder.mid.conv1.weight"] - start).abs().mean() < (sd["decoder.mid.conv1.weight"] - fresh).abs().mean()
    with pytest.raises(ValueError, match="cannot start"):
        thin_init(torch.zeros(4, 4), torch.zeros(8, 4))


def test_start_at_the_dit_takes_vae_and_sr_and_builds_the_cache(trained, tmp_path):
    """--phase dit: the VAE and SR come from the directory, the DiT and its encoders start fresh (as in a
    from-scratch run), and the latent cache the DiT needs is built first."""
    from avatar_cli.train import checkpoint as ckpt
    from avatar_cli.train.trainer import init_models

    base, _ = trained
    work = tmp_path / "work"
    assert train(tmp_path / "model", size="tiny", work_dir=work, seed=0, plan=PLAN, log=lambda e: None,
                 start_from=base / "model", start_phase="dit", halt_after_steps=1) is None
    state, models, _ = ckpt.load(work)
    assert state["phase"] == "dit" and state["step"] == 1
    assert len(list((work / "cache" / "dit").glob("*.safetensors"))) == PLAN.dit_clips
    source = load_modules(resolve_model(str(base / "model"), Path("/")))
    fresh = init_models(SIZES["tiny"], 0)
    for name in ("vae", "sr"):
        for k, v in source[name].model.state_dict().items():
            assert torch.equal(models[name][k], v), f"{name}.{k}"
    # The text encoder trains in the DiT phase: one step away from a fresh init, far from the trained one.
    emb = "embed.weight"
    assert (models["text"][emb] - fresh["text"].state_dict()[emb]).abs().max() < \
        (models["text"][emb] - source["text"].model.state_dict()[emb]).abs().max()


def test_start_from_checks_size_and_phase(tmp_path):
    with pytest.raises(InputError, match="config.json"):
        train(tmp_path / "m", size="tiny", work_dir=tmp_path / "w", plan=PLAN, log=lambda e: None,
              start_from=resolve_model("mini", Path("/")).path)
    with pytest.raises(InputError, match="phase 'vea'"):
        train(tmp_path / "m", size="tiny", work_dir=tmp_path / "w", plan=PLAN, log=lambda e: None,
              start_from=tmp_path, start_phase="vea")
    assert not (tmp_path / "m").exists() and not (tmp_path / "w").exists()  # nothing written


def test_device_is_checked_before_anything_is_written(tmp_path):
    with pytest.raises(InputError, match="device 'tpu'"):
        train(tmp_path / "m", size="tiny", work_dir=tmp_path / "w", plan=PLAN, log=lambda e: None, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no CUDA device"):
            train(tmp_path / "m", size="tiny", work_dir=tmp_path / "w", plan=PLAN, log=lambda e: None,
                  device="cuda")
    assert not (tmp_path / "m").exists() and not (tmp_path / "w").exists()


def test_batches_follow_the_models_device():
    from avatar_cli.train.trainer import pick_device, to_device

    dev = pick_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    batch = {"x": torch.zeros(2), "pair": (torch.ones(1), torch.Generator()), "kind": "N", "none": None,
             "list": [torch.zeros(1)]}
    moved = to_device(batch, torch.device("meta"))  # a device other than the one the batch was made on
    assert moved["x"].device.type == "meta" and moved["pair"][0].device.type == "meta"
    assert isinstance(moved["pair"], tuple) and moved["pair"][1] is batch["pair"][1]
    assert moved["kind"] == "N" and moved["none"] is None and moved["list"][0].device.type == "meta"


def test_model_dir_loads_strictly(trained):
    base, _ = trained
    source = resolve_model(str(base / "model"), Path("/"))
    modules = load_modules(source)
    assert set(modules) == {"vae", "dit", "sr", "audio", "text"}
    assert source.config.size == "tiny"


def test_written_safetensors_are_as_readable_as_the_json_beside_them(trained):
    """Weights, the training checkpoint and the latent cache used to be 0600 (safetensors' private temp file,
    renamed) while config.json and state.json got the umask's mode: other accounts could not read the model."""
    import stat

    base, _ = trained
    plain = stat.S_IMODE((base / "model" / "config.json").stat().st_mode)
    assert plain == stat.S_IMODE((base / "work" / "state.json").stat().st_mode)
    written = list((base / "model").glob("*.safetensors")) + list((base / "work").rglob("*.safetensors"))
    assert len(written) > 5 and any(p.parent.name != "model" and p.parent.name != "work" for p in written)
    assert "train_ckpt.safetensors" in {p.name for p in written}
    modes = {str(p.relative_to(base)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert modes == {name: oct(plain) for name in modes}


def test_halted_run_resumes_to_the_same_weights(trained, tmp_path):
    base, summary = trained
    work = tmp_path / "work"
    # Stop mid-way through the VAE phase, then again in the DiT phase, as a kill after a checkpoint would.
    assert train(tmp_path / "model", size="tiny", work_dir=work, seed=0, resume=False, plan=PLAN,
                 log=lambda e: None, halt_after_steps=5) is None
    assert train(tmp_path / "model", size="tiny", work_dir=work, seed=0, plan=PLAN, log=lambda e: None,
                 halt_after_steps=PLAN.vae_steps - 5 + PLAN.sr_steps + 3) is None
    resumed = train(tmp_path / "model", size="tiny", work_dir=work, seed=0, plan=PLAN, log=lambda e: None)
    assert resumed["steps"] == summary["steps"]
    a = load_modules(resolve_model(str(base / "model"), Path("/")))
    b = load_modules(resolve_model(str(tmp_path / "model"), Path("/")))
    for name in a:
        for (k, va), vb in zip(a[name].model.state_dict().items(), b[name].model.state_dict().values()):
            torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6, msg=f"{name}.{k}")


def test_a_phase_never_runs_past_the_whole_budget():
    from avatar_cli.train.trainer import phase_budget

    assert phase_budget(0.1, 100.0, {"vae": 30.0}, "decoder") == 10.0  # its share
    assert phase_budget(0.1, 100.0, {"vae": 30.0, "cache": 25.0, "dit": 40.0}, "decoder") == 5.0  # what is left
    assert phase_budget(0.1, 100.0, {"vae": 60.0, "dit": 45.0}, "decoder") < 0  # none left: no steps
    assert phase_budget(0.5, 100.0, {"vae": 30.0, "dit": 20.0}, "dit") == 50.0  # its own time is not "elsewhere"


def test_training_seeds_stay_in_the_training_range():
    for kind in ("vae", "sr", "dit"):
        for k in (0, 999):
            ident, audio = clip_seeds(kind, k)
            assert ident in TRAIN_IDENTITY_SEEDS and ident not in EVAL_IDENTITY_SEEDS


def test_mel_features_match_the_render_path():
    """Training computes audio windows exactly as the mini family's audio_features does at render time."""
    from avatar_cli.families.mini.audio import AudioEncoder
    from avatar_cli.families.mini.family import MiniFamily

    p = AudioParams(dim=16)
    audio = np.random.default_rng(0).standard_normal(16_000).astype(np.float32) * 0.1

    class Source:
        def read(self, start, end):
            out = np.zeros(end - start, np.float32)
            a, b = max(start, 0), min(end, len(audio))
            out[a - start:b - start] = audio[a:b]
            return out

        def release(self, before):
            pass

    torch.manual_seed(0)
    enc = AudioEncoder(p).eval()
    family = MiniFamily(SIZES["mini"])
    with torch.no_grad():
        want = family.audio_features({"audio": enc}, Source(), 0, 25, 25.0, torch.device("cpu"), torch.float32)[0]
        got = enc(mel_features(audio, 25, 25.0, p))
    torch.testing.assert_close(got, want)
