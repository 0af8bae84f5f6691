"""The text cache (avatar_cli/prompts/): k encoder runs for k distinct prompts, a cached job never loads its text encoder,
corrupt entries are encoded again, concurrent writers leave one valid entry, and the video does not change."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from avatar_cli import render as rendering

from avatar_cli.job import resolve

from avatar_cli.families.mini.family import MiniFamily
from avatar_cli.families.registry import init_family_dir, load_modules, resolve_model
from avatar_cli.prompts import store
from avatar_cli.prompts.cache import PromptCache
from avatar_cli.prompts.entry import EntryKey
from avatar_cli.prompts.store import TextCache
from avatar_cli.report import QuietReporter
from avatar_cli.spec import load_job
from avatar_cli.stages.base import ModelView
from tests.conftest import avatar, avatar_process, write_reference, write_wav

ROOT = Path(__file__).resolve().parent.parent


class Notes(QuietReporter):
    def __init__(self):
        super().__init__(0)
        self.notes: list[str] = []
        self.done_: list[dict] = []

    def info(self, message: str) -> None:
        self.notes.append(message)

    def done(self, summary: dict) -> None:
        self.done_.append(summary)


@pytest.fixture
def jobs(tmp_path: Path, tiny_model: Path) -> Path:
    """A folder with short inputs and a job writer: job(name, prompt, cache) -> its path."""
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 0.5)
    return tmp_path


def write_job(folder: Path, name: str, prompt: str, cache: str, model: Path) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(f"reference: ref.png\naudio: speech.wav\noutput: out/{name}.mp4\nmodel: {model}\n"
                    f"prompt: {json.dumps(prompt)}\nseed: 3\nruntime: {{text_cache: {cache}, dtype: float32}}\n"
                    "chunking: {frames: 16, motion_frames: 3, transition_frames: 4}\n")
    return path


def render(path: Path, models: rendering.ModelCache | None = None, reporter: Notes | None = None) -> dict:
    return rendering.render(resolve(load_job(path), force=True), reporter or Notes(), models)


@pytest.fixture
def count_encodes(monkeypatch) -> list[str]:
    """Every run of mini's prompt step (its text encoder), by prompt."""
    calls: list[str] = []
    original = MiniFamily.prompt

    def counted(self, models, prompt, device, dtype):
        calls.append(prompt)
        return original(self, models, prompt, device, dtype)

    monkeypatch.setattr(MiniFamily, "prompt", counted)
    return calls


def test_batch_of_n_jobs_with_k_prompts_encodes_k_times_and_frames_match(jobs, tiny_model, count_encodes):
    from avatar_cli.batch import run_batch

    prompts = ["smiling calm", "smiling calm", "surprised", "surprised", "smiling calm"]
    paths = [write_job(jobs, f"j{i}", p, "cache", tiny_model) for i, p in enumerate(prompts)]
    notes = Notes()
    results = run_batch(paths, [], None, True, False, False, notes)
    assert [r.status for r in results] == ["done"] * 5
    assert sorted(count_encodes) == ["smiling calm", "surprised"]  # k = 2 encoder runs for N = 5 jobs
    assert [d["text_cache"] for d in notes.done_] == ["miss", "hit", "miss", "hit", "hit"]
    assert len(list((jobs / "cache").glob("*.safetensors"))) == 2

    # The same video as without the cache: from the encoder's own output (j2) and from the entry (j3).
    off = render(write_job(jobs, "off", "surprised", "off", tiny_model))
    assert off["text_cache"] == "off"
    assert notes.done_[2]["frames_digest"] == notes.done_[3]["frames_digest"] == off["frames_digest"]


def test_cached_job_does_not_load_the_text_encoder(jobs, tiny_model, count_encodes):
    cold = render(write_job(jobs, "cold", "smiling", "cache", tiny_model))
    cache = rendering.ModelCache()
    warm = render(write_job(jobs, "warm", "smiling", "cache", tiny_model), cache)
    (modules, _), = cache.loaded.values()
    assert "text" not in modules and {"dit", "vae", "sr", "audio"} <= set(modules)
    assert (cold["text_cache"], warm["text_cache"]) == ("miss", "hit")
    assert cold["frames_digest"] == warm["frames_digest"] and count_encodes == ["smiling"]

    # The same model set, next job of a batch with an uncached prompt: only the text encoder is loaded beside it.
    dit = modules["dit"]
    other = render(write_job(jobs, "other", "happy", "cache", tiny_model), cache)
    (modules, _), = cache.loaded.values()
    assert "text" in modules and modules["dit"] is dit and other["text_cache"] == "miss"
    assert other["frames_digest"] == render(write_job(jobs, "other_off", "happy", "off", tiny_model))["frames_digest"]

    # A corrupt entry in a render: said once, encoded again (the same video), rewritten.
    prompts = PromptCache(TextCache(jobs / "cache"), resolve_model(str(tiny_model), jobs), torch.float32)
    entry = prompts.store.path(prompts.key("happy"))
    entry.write_bytes(entry.read_bytes()[:-5])
    notes = Notes()
    again = render(write_job(jobs, "again", "happy", "cache", tiny_model), reporter=notes)
    said = [n for n in notes.notes if "text cache" in n]
    assert len(said) == 1 and str(entry) in said[0] and again["text_cache"] == "miss"
    assert again["frames_digest"] == other["frames_digest"] and count_encodes[-1] == "happy"
    assert prompts.store.read(prompts.key("happy"))[1] is None  # rewritten whole


def mini_prompts(folder: Path, model: Path, notes: list[str]) -> tuple[PromptCache, ModelView]:
    source = resolve_model(str(model), Path("/"))
    modules = load_modules(source, skip=("vae", "dit", "sr", "audio"))
    return PromptCache(TextCache(folder), source, torch.float32, notes.append), ModelView(modules)


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "another key", "garbage"])
def test_corrupt_entry_is_reported_encoded_again_and_rewritten(tmp_path, tiny_model, damage):
    notes: list[str] = []
    prompts, models = mini_prompts(tmp_path / "cache", tiny_model, notes)
    cpu = torch.device("cpu")
    good = prompts.encode(models, "smiling", cpu, torch.float32)  # (1, 1, 16)
    path = prompts.store.path(prompts.key("smiling"))
    blob = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(blob[:len(blob) - 7])
    elif damage == "flipped byte":
        path.write_bytes(blob[:-3] + bytes([blob[-3] ^ 0x10]) + blob[-2:])
    elif damage == "another key":  # a valid entry of another prompt, under this prompt's name
        prompts.encode(models, "happy", cpu, torch.float32)
        shutil.copy(prompts.store.path(prompts.key("happy")), path)
    else:
        path.write_bytes(b"\xff" * 64)

    again, _ = mini_prompts(tmp_path / "cache", tiny_model, notes)
    assert not again.lookup("smiling", cpu)  # never used
    assert len(notes) == 1 and str(path) in notes[0] and "unusable" in notes[0], notes
    out = again.encode(models, "smiling", cpu, torch.float32)
    assert again.encoded == 1 and torch.equal(out, good)
    tensors, problem = again.store.read(again.key("smiling"))  # rewritten, valid
    assert problem is None and torch.equal(tensors["text"], good)


WRITER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from avatar_cli.prompts.entry import EntryKey
    from avatar_cli.prompts.store import TextCache
    folder, value = Path(sys.argv[1]), float(sys.argv[2])
    key = EntryKey("mini", "e" * 64, "t" * 64, "the same prompt", "", "float32")
    cache = TextCache(folder)
    (folder.parent / f"ready{value}").touch()
    while not (folder.parent / "go").exists():  # both start writing at once, after importing torch
        time.sleep(0.002)
    for _ in range(25):
        cache.write(key, {"text": torch.full((1, 64, 1024), value)}, "cpu")  # 256 KB: writes take a while
""")


def test_concurrent_writers_leave_one_valid_entry(tmp_path):
    import time

    folder = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(v)], cwd=ROOT) for v in (1.0, 2.0)]
    while not all((tmp_path / f"ready{v}").exists() for v in (1.0, 2.0)) and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    (tmp_path / "go").touch()
    key = EntryKey("mini", "e" * 64, "t" * 64, "the same prompt", "", "float32")
    cache, seen, problems = TextCache(folder), set(), []
    while any(p.poll() is None for p in procs):  # read all the while: never a half-written entry
        tensors, problem = cache.read(key)
        if problem:
            problems.append(problem)
        elif tensors is not None:
            seen.add(float(tensors["text"][0, 0, 0]))
        time.sleep(0.002)
    assert [p.returncode for p in procs] == [0, 0]
    assert problems == []
    tensors, problem = cache.read(key)
    assert problem is None and float(tensors["text"].unique().item()) in (1.0, 2.0)
    assert [p.name for p in folder.iterdir()] == [cache.path(key).name]  # no temp file left behind
    assert seen  # the reader did see entries while they were being replaced


def test_key_covers_what_the_encoding_depends_on(tmp_path, tiny_model):
    wan = tmp_path / "wan"
    init_family_dir(wan, "tiny", family="wan-s2v")
    copy = tmp_path / "copy_on_another_host"
    shutil.copytree(wan, copy)  # new files, new mtimes: the same content, so the same entries
    a, b = (PromptCache(TextCache(tmp_path / "c"), resolve_model(str(d), tmp_path), torch.float32)
            for d in (wan, copy))
    assert a.key("talking") == b.key("talking") and a.key("talking").negative  # wan encodes its negative prompt
    assert a.key("talking").digest != a.key("talking ").digest  # the exact prompt
    bf16 = PromptCache(TextCache(tmp_path / "c"), resolve_model(str(wan), tmp_path), torch.bfloat16)
    assert bf16.key("talking").digest != a.key("talking").digest  # the encoder's dtype
    mini = PromptCache(TextCache(tmp_path / "c"), resolve_model(str(tiny_model), tmp_path), torch.float32)
    assert mini.key("talking").encoder != a.key("talking").encoder and mini.key("talking").negative == ""
    # Other weights of the same shapes (another seed): another encoder digest.
    other = tmp_path / "other"
    init_family_dir(other, "tiny", seed=1, family="wan-s2v")
    c = PromptCache(TextCache(tmp_path / "c"), resolve_model(str(other), tmp_path), torch.float32)
    assert c.key("talking").encoder != a.key("talking").encoder


def test_mini_key_follows_its_text_encoders_code(tmp_path, tiny_model, monkeypatch):
    """mini's encoder is code in the package: a release that changes how it computes (other bits from the same
    weights) must not serve the encodings an earlier one cached."""
    from avatar_cli.families.mini import model_dir
    source = resolve_model(str(tiny_model), tmp_path)
    before = PromptCache(TextCache(tmp_path / "c"), source, torch.float32).key("talking")
    real = model_dir.inspect.getsource
    monkeypatch.setattr(model_dir.inspect, "getsource",
                        lambda obj: real(obj) + ("# changed" if obj is model_dir.text_module else ""))
    after = PromptCache(TextCache(tmp_path / "c"), source, torch.float32).key("talking")
    assert after.encoder != before.encoder and after.tokenizer == before.tokenizer


@pytest.mark.parametrize("layout", ["official", "diffusers"])
def test_wan_prompt_round_trip_is_exact(tmp_path, layout):
    from avatar_cli.families.wan_s2v import files, model_dir

    wan = tmp_path / "wan"
    model_dir.init_dir(wan, "tiny", layout=files.OFFICIAL if layout == "official" else files.DIFFUSERS)
    source = resolve_model(str(wan), tmp_path)
    assert source.config.layout == (files.OFFICIAL if layout == "official" else files.DIFFUSERS)
    models = ModelView(load_modules(source, skip=("dit", "vae", "audio")))
    cpu = torch.device("cpu")
    prompts = PromptCache(TextCache(tmp_path / "c"), source, torch.float32)
    out = prompts.encode(models, "a person talking", cpu, torch.float32)  # {"text": (L, 32), "negative": (L', 32)}
    fresh = PromptCache(TextCache(tmp_path / "c"), source, torch.float32)
    assert fresh.lookup("a person talking", cpu)
    back = fresh.known["a person talking"]
    assert back.keys() == out.keys() and all(torch.equal(back[k], out[k]) and back[k].dtype == out[k].dtype
                                             for k in out)
    assert out["negative"].shape[0] > out["text"].shape[0] > 0 and fresh.encoded == 0


def test_cache_setting_does_not_change_the_job_fingerprint(job_dir, tiny_model):
    from avatar_cli.pipeline.fingerprint import job_fingerprint

    source = resolve_model(str(tiny_model), job_dir)
    a, b = (job_fingerprint(load_job(job_dir / "job.yaml", [f"runtime.text_cache={v}"]), source)
            for v in ("off", "/elsewhere"))
    assert a == b  # a rerun with another cache folder still resumes, and a finished output is still skipped


def test_cache_folder_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.cache_folder("auto", tmp_path) == tmp_path / "xdg" / "avatar" / "text"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert store.cache_folder("auto", tmp_path) == Path.home() / ".cache" / "avatar" / "text"
    assert store.cache_folder("off", tmp_path) is None
    assert store.cache_folder("False", tmp_path) is None  # YAML's unquoted off, as the spec's string holds it
    assert store.cache_folder("shared/text", tmp_path / "jobs") == tmp_path / "jobs" / "shared" / "text"
    with pytest.raises(store.InputError, match="runtime.text_cache"):
        store.cache_folder(" ", tmp_path)


def test_prompts_encode_then_render_does_not_load_the_encoder(jobs, tiny_model):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return avatar(*args, "--json", cwd=ROOT)

    paths = [str(write_job(jobs, f"p{i}", p, "cache", tiny_model)) for i, p in enumerate(["calm", "calm", "happy"])]
    filled = cli("prompts", "encode", *paths, str(jobs / "missing.yaml"))
    assert filled.returncode == 2  # a bad job is bad input, as render says; the good ones are still encoded
    summary = json.loads(filled.stdout.splitlines()[-1])
    assert {"jobs": 4, "distinct": 2, "new": 2, "cached": 0, "bad": 1}.items() <= summary.items()
    assert any("missing.yaml" in json.loads(line).get("message", "") for line in filled.stdout.splitlines())
    done = cli("render", paths[2], "--force")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["text_cache"] == "hit"  # the encoder was skipped (see above)


def test_two_ranks_agree_on_a_cached_prompt(jobs, tiny_model):
    """Rank 0 reads the entry and hands it to rank 1: both skip the encoder (or neither), same frames as 1 rank."""
    one = render(write_job(jobs, "one", "calm", "cache", tiny_model))  # fills the cache
    r = avatar_process("render", str(write_job(jobs, "two", "calm", "cache", tiny_model)), "--json", "--nproc", "2",
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    two = json.loads(r.stdout.splitlines()[-1])
    assert (one["text_cache"], two["text_cache"], two["ranks"]) == ("miss", "hit", 2)
    assert two["frames_digest"] == one["frames_digest"]


# --- runtime.weights: a quantized umT5's encodings are entries of their own -----------------------------------------

def write_wan_job(folder: Path, model: Path) -> Path:
    path = folder / "wan.yaml"
    path.write_text(f"reference: ref.png\naudio: speech.wav\noutput: out/wan.mp4\nmodel: {model}\n"
                    "prompt: a person talking\nseed: 3\nvideo: {width: 64, height: 64, crf: 0}\nsampling: {steps: 4}\n"
                    "runtime: {text_cache: cache, dtype: float32, threads: 1, decode: inline}\n")
    return path


def test_quantized_encoder_entries_sit_beside_bf16_ones(jobs):
    """wan-s2v quantizes umT5 under runtime.weights: int8 | fp8: `avatar prompts encode` (and a render) keys its
    encodings by the format, so the cache holds them beside the bf16 one and no job reads another format's entry;
    a bf16 key is the one the cache always had, and mini (whose text encoder is never quantized) shares its entries
    across formats."""
    from avatar_cli.prompts.encode import fill, load_prompt_step
    from avatar_cli.prompts.identity import identity
    from avatar_cli.runtime.device import resolve_runtime

    wan = jobs / "wan"
    init_family_dir(wan, "tiny", family="wan-s2v")
    job, folder, prompt = write_wan_job(jobs, wan), jobs / "cache", "a person talking"
    source = resolve_model(str(wan), jobs)
    caches = {w: PromptCache(TextCache(folder), source, torch.float32, weights=w) for w in ("bf16", "int8", "fp8")}
    assert {w: c.key(prompt).dtype for w, c in caches.items()} == \
        {"bf16": "float32", "int8": "float32+int8", "fp8": "float32+fp8"}
    assert caches["bf16"].key(prompt) == EntryKey("wan-s2v", *identity(source)[:2], prompt, identity(source)[2],
                                                  "float32")  # as before: existing entries stay valid

    # int8 first, then bf16: the bf16 job does not take the int8 entry; int8 again hits its own; fp8 is a third.
    reports = [fill([job], [f"runtime.weights={w}"], lambda _: None) for w in ("int8", "bf16", "int8", "fp8")]
    assert [(r.new, r.cached, r.bad) for r in reports] == [(1, 0, []), (1, 0, []), (0, 1, []), (1, 0, [])]
    assert len(list(folder.glob("*.safetensors"))) == 3
    runtime, cpu = resolve_runtime("cpu", "float32"), torch.device("cpu")
    for w in ("bf16", "int8"):  # each entry is its own encoder's output, bit for bit
        with torch.no_grad():
            made = source.family.prompt(load_prompt_step(source, runtime, w), prompt, cpu, torch.float32)
        fresh = PromptCache(TextCache(folder), source, torch.float32, weights=w)
        assert fresh.lookup(prompt, cpu) and all(torch.equal(fresh.known[prompt][k], made[k]) for k in made)
    a, b = (PromptCache(TextCache(folder), source, torch.float32, weights=w) for w in ("bf16", "int8"))
    a.lookup(prompt, cpu), b.lookup(prompt, cpu)
    assert not torch.equal(a.known[prompt]["text"], b.known[prompt]["text"])

    mini = resolve_model("mini", jobs)
    assert PromptCache(TextCache(folder), mini, torch.float32, weights="int8").key(prompt) == \
        PromptCache(TextCache(folder), mini, torch.float32, weights="bf16").key(prompt)


def test_render_with_int8_weights_keys_its_prompt_by_them(jobs):
    """A render with runtime.weights: int8 writes and reads the int8 entry; a bf16 render of the same job misses it."""
    wan = jobs / "wan"
    init_family_dir(wan, "tiny", family="wan-s2v")
    job = write_wan_job(jobs, wan)
    runs = [rendering.render(resolve(load_job(job, [f"runtime.weights={w}"]), force=True), Notes())
            for w in ("int8", "bf16", "int8")]
    assert [r["text_cache"] for r in runs] == ["miss", "miss", "hit"]
    assert runs[0]["frames_digest"] == runs[2]["frames_digest"] != runs[1]["frames_digest"]
    metas = sorted(store_meta(p)["dtype"] for p in (jobs / "cache").glob("*.safetensors"))
    assert metas == ["float32", "float32+int8"]


def store_meta(path: Path) -> dict[str, str]:
    from avatar_cli.prompts.entry import metadata

    return metadata(path.read_bytes())
