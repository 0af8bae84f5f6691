"""The LoRA a wan-s2v job names (`lora`, `lora_rank`, `lora_scale`), merged once at load: a render with it equals a
render of the same weights merged beforehand; under 2 ranks each merges its own FSDP2 rows (bit for bit those of
the whole merged weight) and the frames match 1 rank's; a bad LoRA, or one given to mini, is refused by
`avatar validate` (exit 2) naming the problem; the resume fingerprint follows the LoRA file and its scale."""

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from avatar_cli.cli import app
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.lora import merge_lora, peft_targets, read_lora
from avatar_cli.modules.module import save_safetensors
from avatar_cli.families.registry import init_family_dir, load_modules, resolve_model, with_lora
from avatar_cli.pipeline.fingerprint import describe_change, job_fingerprint
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.offload import HostTransfer
from avatar_cli.runtime.placement import place
from avatar_cli.spec import load_job
from tests.conftest import avatar, avatar_process, torchrun, write_reference, write_wav

RANK, SCALE = 4, 0.5
GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"
SCRIPTS = Path(__file__).parent / "dist_scripts"
DIT_INDEX = "diffusion_pytorch_model.safetensors.index.json"
# float32: merged as the pre-merged file is; crf 0: lossless, so frames compare (see the 2-rank test); one thread:
# on a loaded 2-core host, more oversubscribe it (a 1-rank render measured 65 s with 2 threads, 10 s with 1).
SETTINGS = ("runtime.dtype=float32", "video.crf=0", "runtime.threads=1")


def lora_factors(seed: int = 0, rank: int = RANK) -> dict[str, torch.Tensor]:
    """PEFT in-memory keys for every LiveAvatar target of the tiny DiT, bf16 like a released LoRA, sized so the
    LoRA changes the output clearly (B is not zero, as it is at PEFT's init)."""
    with torch.device("meta"):
        meta = WanS2VDiT(WanDiTParams.tiny())
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in peft_targets(meta):
        o, i = meta.get_submodule(name).weight.shape
        out[f"base_model.model.{name}.lora_A.default.weight"] = (torch.randn(rank, i, generator=g) / i**0.5).bfloat16()
        out[f"base_model.model.{name}.lora_B.default.weight"] = (torch.randn(o, rank, generator=g) / rank**0.5
                                                                 ).bfloat16()
    return out


def write_premerged(base: Path, lora: Path, out: Path) -> None:
    """A copy of `base` whose DiT shards hold W + SCALE · B @ A (merge_lora, float32 as stored), in the same index
    layout: the same tensors in the same shard files."""
    shutil.copytree(base, out)
    weight_map = json.loads((base / DIT_INDEX).read_text())["weight_map"]
    shards = {f: load_file(base / f) for f in sorted(set(weight_map.values()))}
    model = WanS2VDiT(WanDiTParams.tiny()).eval()
    model.load_state_dict({k: v for sd in shards.values() for k, v in sd.items()}, strict=True)
    merge_lora(model, read_lora(lora, RANK), SCALE)
    merged = model.state_dict()
    for file, sd in shards.items():
        save_safetensors({k: merged[k].contiguous() for k in sd}, out / file)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("wan_lora")
    base, lora = root / "Wan2.2-S2V-tiny", root / "Live-Avatar" / "liveavatar.safetensors"
    init_family_dir(base, "tiny", seed=0, family="wan-s2v")
    lora.parent.mkdir()
    save_file(lora_factors(), str(lora))
    write_premerged(base, lora, root / "premerged")
    return SimpleNamespace(root=root, base=base, lora=lora, premerged=root / "premerged")


@pytest.fixture(scope="module")
def job(models) -> Path:
    """The job names the base model and the LoRA by paths relative to the job file."""
    folder = models.root / "job"
    folder.mkdir()
    write_reference(folder / "ref.png")
    write_wav(folder / "speech.wav", 2.0)  # one clip: the merge is the same for every clip
    (folder / "job.yaml").write_text(
        "reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: ../Wan2.2-S2V-tiny\n"
        f"lora: ../Live-Avatar/liveavatar.safetensors\nlora_rank: {RANK}\nlora_scale: {SCALE}\n"
        "prompt: a person talking\nseed: 3\nvideo: {width: 64, height: 64}\nsampling: {steps: 2}\n")
    return folder / "job.yaml"


def render(job: Path, out: Path, *extra: str) -> dict:
    """One rank in this process; --nproc (torchrun's agent and its workers) from a fresh interpreter."""
    run = avatar_process if "--nproc" in extra else avatar
    result = run("render", str(job), "-o", str(out), "--json", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def frames(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.float32)


@pytest.fixture(scope="module")
def one_rank(job: Path, models) -> SimpleNamespace:
    out = models.root / "one.mp4"
    return SimpleNamespace(done=render(job, out, *SETTINGS), video=out)


def test_lora_render_equals_a_render_of_premerged_weights(job: Path, models, one_rank):
    assert one_rank.done["frames"] == 32 and one_rank.done["ranks"] == 1
    premerged = render(job, models.root / "premerged.mp4", *SETTINGS, f"model={models.premerged}", "lora=null")
    assert premerged["frames_digest"] == one_rank.done["frames_digest"]  # every frame, bit for bit


def test_two_ranks_merge_their_rows_and_match_one_rank(job: Path, models, one_rank):
    two = render(job, models.root / "two.mp4", *SETTINGS, "--nproc", "2")
    assert two["ranks"] == 2
    a, b = frames(one_rank.video), frames(models.root / "two.mp4")
    assert a.shape == b.shape == (32, 64, 64, 3)
    diff = np.abs(a - b)
    # The bound of tests/test_wan_family.py::test_two_ranks_match_one (Ulysses sums in another order; lossless).
    assert (diff > 0).mean() < 1e-3 and diff.max() <= 6, ((diff > 0).mean(), diff.max())


@pytest.mark.parametrize("offload", [False, True])
def test_one_process_merges_where_the_weights_stay(models, offload):
    """Placement runs the DiT's after-load step once it is read whole, before an offloader takes it: the placed
    weights are the pre-merged file's, bit for bit (float32, as stored)."""
    source = with_lora(resolve_model(str(models.base), models.root), models.lora, RANK, SCALE)
    dit = load_modules(source)["dit"]
    assert dit.is_lazy and dit.after_load is source.lora
    extra = dict(transfer=HostTransfer(), free_bytes=1, offload="model") if offload else {}
    placement = place({"dit": dit}, Runtime(torch.device("cpu"), torch.float32), Dist(), **extra)
    assert list(placement.offloaders) == (["dit"] if offload else []) and dit.after_load is None
    want = {}
    for shard in models.premerged.glob("diffusion_pytorch_model-*.safetensors"):
        want.update(load_file(shard))
    got = dit.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k].cpu(), want[k]) for k in want)


def test_each_rank_merges_exactly_its_rows_bit_for_bit(models):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(SCRIPTS))
    r = torchrun("--standalone", "--nproc_per_node", "2", str(SCRIPTS / "lora_sharded_merge.py"), str(models.base),
                 str(models.lora), str(RANK), str(SCALE), str(GOLDEN), env=env, timeout=180)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(lines[-1])
    assert res["ok"] is True and res["targets"] == 3 * 10 + 2 * 4  # the tiny DiT: 2 blocks x 10 + 2 injectors x 4
    for figures in res["ranks"]:
        for label in ("float32", "bfloat16", "float32/offload", "float32/eager"):
            f = figures[label]
            assert f["rows_equal"] == f["padding_zero"] == f["params"] and f["forward_rel_diff"] == 0.0, label
            assert f["targets_with_rows"] == res["targets"] and f["lora_effect"] > 1e-2, label


def validate(job: Path, *overrides: str):
    return CliRunner().invoke(app, ["validate", str(job), "--json", *overrides])


def bad_lora(models, name: str, tensors: dict) -> Path:
    path = models.root / name
    save_file(tensors, str(path))
    return path


def test_validate_refuses_bad_loras_by_name(job: Path, models):
    good = lora_factors()
    q0 = "base_model.model.blocks.0.self_attn.q"
    stray = bad_lora(models, "stray.safetensors", {**good, "base_model.model.blocks.0.norm3.weight": torch.ones(64)})
    lacks = bad_lora(models, "lacks.safetensors", {**good, "blocks.7.self_attn.q.lora_A.weight": torch.zeros(RANK, 64),
                                                   "blocks.7.self_attn.q.lora_B.weight": torch.zeros(64, RANK)})
    uneven = bad_lora(models, "uneven.safetensors", {**good, f"{q0}.lora_B.default.weight":
                                                     good[f"{q0}.lora_B.default.weight"][:, :3].contiguous()})
    cases = [
        ((f"lora={stray}",), ["not LoRA factors", "base_model.model.blocks.0.norm3.weight"]),
        ((f"lora={lacks}",), ["not in the base model", "blocks.7.self_attn.q"]),
        (("lora_rank=8",), ["rank mismatch", ".lora_A.default.weight [4, 64] is rank 4", "configured rank is 8"]),
        ((f"lora={uneven}",), ["rank mismatch", f"{q0}.lora_A.default.weight has 4 rows",
                               f"{q0}.lora_B.default.weight has 3 columns"]),
        (("lora_scale=null",), ["lora_scale", "rank-4"]),  # a scale may only default for LiveAvatar's rank 128
        ((f"lora={models.root / 'none.safetensors'}",), ["lora:", "none.safetensors", "no such file"]),
        (("model=mini",), ["lora:", "mini family takes no LoRA"]),
    ]
    for overrides, words in cases:
        result = validate(job, *overrides)
        assert result.exit_code == 2, (overrides, result.output)
        message = result.stderr
        for word in words:
            assert word in message, (overrides, word, message)
        assert "Traceback" not in message
    assert validate(job).exit_code == 0  # the good LoRA passes (headers only: nothing is merged or loaded)


def test_the_fingerprint_follows_the_lora_file_and_scale(job: Path, models, tmp_path: Path):
    source = resolve_model(str(models.base), models.root)  # prepare() would add the LoRA: the digest leaves it out

    def fingerprint(*overrides: str) -> dict:
        return job_fingerprint(load_job(job, list(overrides)), source)

    before = fingerprint()
    assert "lora" in before and describe_change(before, fingerprint()) is None
    assert describe_change(before, fingerprint("lora_scale=0.25")) == "the job spec, the LoRA"
    plain = fingerprint("lora=null")
    assert "lora" not in plain and describe_change(before, plain) == "the job spec, the LoRA"
    # Without a LoRA its rank and scale are not part of the job: the digests of jobs written before these keys hold.
    assert fingerprint("lora=null", "lora_rank=8", "lora_scale=2") == plain
    # The same path rewritten with other values (same names, shapes, size: only the mtime tells): not resumed over.
    copy = tmp_path / "liveavatar.safetensors"
    shutil.copy(models.lora, copy)
    first = fingerprint(f"lora={copy}")
    mtime = copy.stat().st_mtime_ns
    save_file(lora_factors(seed=1), str(copy))
    os.utime(copy, ns=(mtime, mtime + 10**9))
    assert describe_change(first, fingerprint(f"lora={copy}")) == "the LoRA"


def test_a_resume_point_of_an_earlier_wan_revision_is_refused(job: Path, models):
    """Points written before a fix that changed wan-s2v's frames (the official 25th audio layer, the official
    reference resize) carry an older revision or none: a resume names the change (and --resume refuses) rather than
    splicing two computations into one video. mini's points, revision 0, carry no such entry."""
    source = resolve_model(str(models.base), models.root)
    now = job_fingerprint(load_job(job, []), source)
    family = source.family
    assert family.revision >= 2 and now["family"] == f"wan-s2v/{family.revision}"
    earlier = {k: v for k, v in now.items() if k != "family"}  # written before revisions existed
    message = "the model family's computation (this version of avatar renders it differently)"
    assert describe_change(earlier, now) == message
    assert describe_change({**now, "family": "wan-s2v/1"}, now) == message
    assert describe_change(dict(now), now) is None
