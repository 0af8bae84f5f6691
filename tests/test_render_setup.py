"""The one setup under a file render and a live session (avatar_cli/render/setup.py): what a session gets from it
that its own copy once lacked (the output lock, the job's warnings, the working set), and the model cache's key."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from avatar_cli.cli import app
from avatar_cli.job import ResolvedJob, Split, resolve
from avatar_cli.pipeline import checkpoint as ckpt
from avatar_cli.render import setup as render_setup
from avatar_cli.report import QuietReporter
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.rings import RingStore
from avatar_cli.spec import load_job
from tests.conftest import write_job, write_reference


def session_job(folder: Path, model: Path) -> Path:
    """A file's audio into HLS (a live session that needs no pipe), from a reference small enough to warn about."""
    write_job(folder, model)
    write_reference(folder / "ref.png", 10, 12)
    return folder / "job.yaml"


def test_a_live_session_refuses_an_output_another_process_is_writing(tmp_path, tiny_model):
    job = session_job(tmp_path, tiny_model)
    playlist = tmp_path / "hls" / "live.m3u8"
    playlist.parent.mkdir()
    holder = ckpt.OutputLock(playlist.with_name("live.partial.m3u8"))
    assert holder.acquire() is None
    try:
        r = CliRunner().invoke(app, ["render", str(job), "-o", str(playlist), "--json"])
    finally:
        holder.release()
    assert r.exit_code == 2, r.output
    assert "another avatar process" in r.output and str(playlist) in r.output
    assert not playlist.exists()  # nothing was written


def test_a_live_session_says_the_jobs_warnings_and_counts_its_working_set(tmp_path, tiny_model, monkeypatch):
    """build() is the render's: the session hears the job's warnings (a small reference here) and asks the working
    set for placement where a device stands in (the CPU behind a HostTransfer)."""
    from avatar_cli.render.live import run_session
    from avatar_cli.runtime.offload import HostTransfer

    job = load_job(session_job(tmp_path, tiny_model), ["runtime.text_cache=off", "runtime.offload=auto"],
                   output=str(tmp_path / "hls" / "live.m3u8"))
    p = resolve(job, force=True)
    assert p.warnings, "the tiny reference should draw a small-image warning"
    asked = []
    real = render_setup.working_bytes
    monkeypatch.setattr(render_setup, "working_bytes", lambda *a: asked.append(a[0].job.output) or real(*a))
    said = []

    class Notes(QuietReporter):
        def info(self, message: str) -> None:
            said.append(message)

    summary = run_session(p, Notes(0), render_setup.ModelCache(transfer=HostTransfer(), free_bytes=1 << 40))
    assert asked == [job.output]
    assert all(w in said for w in p.warnings)
    assert summary["frames"] == p.frames and summary["stalls"] == 0 and "latency_median_s" in summary


@pytest.fixture
def counted_loads(monkeypatch):
    loads = []
    real = render_setup.load_modules
    monkeypatch.setattr(render_setup, "load_modules", lambda source, **kw: loads.append(kw) or real(source, **kw))
    return loads


def test_the_model_cache_keys_on_the_split_and_the_rings(job_dir, counted_loads):
    """Two jobs that differ only in how the ranks split or where the rings live are each placed as their own spec
    says: neither reuses the other's placement. The same job twice loads once."""
    p: ResolvedJob = resolve(load_job(job_dir / "job.yaml"), force=True)
    cache = render_setup.ModelCache()
    runtime, rt = p.runtime, p.job.spec.runtime

    def get(split: Split, rings: RingStore):
        return cache.get(p.model, runtime, Dist(), rt, QuietReporter(0), split=split, rings=rings)

    first = get(Split.sequence, RingStore())
    assert get(Split.sequence, RingStore())[1] is first[1] and len(counted_loads) == 1
    steps = get(Split.steps, RingStore())
    assert len(counted_loads) == 2 and steps[1] is not first[1]
    disk = get(Split.steps, RingStore("disk", job_dir))
    assert len(counted_loads) == 3 and disk[1] is not steps[1] and disk[1].rings == RingStore("disk", job_dir)
    assert (first[1].split, steps[1].split, disk[1].split) == ("sequence", "steps", "steps")
    keys = list(cache.loaded)
    assert len(keys) == 1 and keys[0][-2:] == ("steps", RingStore("disk", job_dir))  # one model set at a time


def test_the_render_and_the_plan_import_no_command():
    """The render's layers import neither the plan command nor the CLI (budgets live in runtime/)."""
    import ast

    root = Path(__file__).parent.parent / "avatar_cli"
    for path in [*(root / "render").glob("*.py"), *(root / "runtime").glob("*.py"), *(root / "pipeline").glob("*.py")]:
        tree = ast.parse(path.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
                {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not names & {"avatar_cli.plan", "avatar_cli.cli", "avatar_cli.batch"}, path


def test_no_function_on_the_render_path_is_long():
    """Each function of the render path (the render layer, the loop and the timestep pipeline, the batch over
    them) reads as its steps: none is over 80 lines."""
    import ast

    root = Path(__file__).parent.parent / "avatar_cli"
    for path in [*(root / "render").glob("*.py"), *(root / "pipeline").glob("*.py"), root / "batch.py",
                 root / "stages" / "publish.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}: {node.name}"
