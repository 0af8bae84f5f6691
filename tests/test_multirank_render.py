"""The whole render under torchrun with 2 ranks (gloo, FSDP2 + Ulysses) equals the 1-rank render."""

import json
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest

from tests.conftest import avatar, avatar_process, torchrun, write_job


def render(job: Path, out: Path, *extra: str) -> dict:
    """One rank in this process; --nproc (torchrun's agent and its workers) from a fresh interpreter."""
    run = avatar_process if "--nproc" in extra else avatar
    result = run("render", str(job), "-o", str(out), "--json", *extra)
    if result.returncode != 0:  # torchrun's summary comes last; the failing rank's own message is further up
        clues = [line for line in result.stderr.splitlines()
                 if any(w in line for w in ("terminate", "Error", "error:", "what()", "Abort", "Traceback"))]
        raise AssertionError("\n".join(clues[:30]) + "\n...\n" + result.stderr[-1500:])
    lines = result.stdout.strip().splitlines()
    assert all(line.startswith("{") for line in lines)  # rank 1 prints nothing on stdout
    return json.loads(lines[-1])


def frames(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.float32)


def one_and_two_ranks(folder: Path, dtype: str, *extra: str) -> tuple[dict, dict]:
    """The job in folder rendered by 1 rank (one.mp4) and by 2 (two.mp4); their done events."""
    job = folder / "job.yaml"
    one = render(job, folder / "one.mp4", f"runtime.dtype={dtype}", *extra)
    two = render(job, folder / "two.mp4", f"runtime.dtype={dtype}", *extra, "--nproc", "2")
    return one, two


@pytest.fixture(scope="module")
def float32_renders(tmp_path_factory, tiny_model: Path) -> tuple[Path, dict, dict]:
    """The float32 pair, shared by the test that compares it and the two-node test that needs a 2-rank digest."""
    folder = write_job(tmp_path_factory.mktemp("float32"), tiny_model)
    return folder, *one_and_two_ranks(folder, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_match_one(request, tmp_path: Path, dtype: str):
    if dtype == "float32":
        folder, one, two = request.getfixturevalue("float32_renders")
        size = 64
    else:  # with frame super-resolution, which runs on rank 0 alone, after its decode (x1: the cheapest it does)
        folder = write_job(tmp_path, request.getfixturevalue("tiny_model"))
        one, two = one_and_two_ranks(folder, dtype, f"sr.model={request.getfixturevalue('swiftvr_dir')}",
                                     "sr.scale=1")
        size = 64
    assert (one["ranks"], two["ranks"]) == (1, 2)
    a, b = frames(folder / "one.mp4"), frames(folder / "two.mp4")
    assert a.shape == b.shape == (58, size, size, 3)
    diff = np.abs(a - b)
    if dtype == "float32":
        assert diff.mean() < 0.05 and diff.max() <= 2.0
    else:  # bf16 rounding differs with the reduction order across ranks; still the same video
        assert diff.mean() < 2.0
        plain, _, _ = request.getfixturevalue("float32_renders")  # the same job without SR (module-scoped)
        assert np.abs(a - frames(plain / "one.mp4")).mean() > 10  # the tiny SwiftVR's random weights ran on both
    assert not list(folder.glob("*.partial*"))


def test_two_nodes_render_what_one_node_with_two_ranks_renders(float32_renders, tmp_path: Path):
    """Multi-node rendezvous, two 'nodes' on this host: each worker is LOCAL_RANK 0 of its node."""
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    folder, _, one_node = float32_renders  # one node, two ranks
    job, out = folder / "job.yaml", tmp_path / "nodes.mp4"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t",
                               "-m", "avatar_cli", "render", str(job), "-o", str(out), "--json", "runtime.dtype=float32"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(err[-1500:] for _, err in results)
    summaries = [json.loads(o.strip().splitlines()[-1]) for o, _ in results if o.strip()]
    assert len(summaries) == 1  # only global rank 0's node reports and writes
    assert summaries[0]["ranks"] == 2 and summaries[0]["frames_digest"] == one_node["frames_digest"]
    assert out.exists() and not list(tmp_path.glob("*.partial*"))


def descendants(pid: int) -> list[int]:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def start_long_render(job_dir: Path, out: Path) -> subprocess.Popen:
    """A 60 s render under --nproc 2, returned once its first chunk is done."""
    from tests.conftest import write_wav

    write_wav(job_dir / "long.wav", 60.0)
    proc = subprocess.Popen([sys.executable, "-m", "avatar_cli", "render", str(job_dir / "job.yaml"),
                             f"audio={job_dir / 'long.wav'}", "-o", str(out), "--json", "--nproc", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if json.loads(line)["event"] == "chunk":
            break
    return proc


@pytest.mark.parametrize("victim", [1, 0])
def test_killing_a_rank_ends_the_render(job_dir: Path, tmp_path: Path, victim: int):
    import os
    import signal
    import time

    out = tmp_path / "v.mp4"
    proc = start_long_render(job_dir, out)
    try:
        victims = [p for p in descendants(proc.pid) if rank_of(p) == victim]
        assert victims, f"rank {victim} not found"
        os.kill(victims[0], signal.SIGKILL)
        killed = time.monotonic()
        rest, err = proc.communicate(timeout=90)
        took = time.monotonic() - killed
    finally:
        proc.kill()
    assert proc.returncode == 1  # a render failure: the dead rank's, not the survivor's collateral SIGTERM
    assert took < 60, f"took {took:.1f} s"
    assert not out.exists()
    assert "pair.cc" not in rest + err  # the backend's source path is no message for a user
    errors = [json.loads(line) for line in rest.splitlines() if '"error"' in line]
    if victim == 0:  # the rank that reports is gone: the launcher says what happened
        assert errors and "rank 0 was killed (SIGKILL)" in errors[-1]["message"]


def test_ctrl_c_on_the_launcher_ends_every_rank_and_keeps_the_partial(job_dir: Path, tmp_path: Path):
    import signal

    out = tmp_path / "v.mp4"
    proc = start_long_render(job_dir, out)
    try:
        chunks = 1
        for line in proc.stdout:  # past the first fragment, so there is a point to continue from
            chunks += json.loads(line)["event"] == "chunk"
            if chunks >= 6:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert not out.exists() and list(tmp_path.glob("*.partial*"))  # kept for --resume


def test_a_rank_count_the_heads_do_not_divide_is_bad_input_without_a_traceback(job_dir: Path, tmp_path: Path):
    """--nproc 3: refused before any worker starts. torchrun by hand: each rank refuses before rendering."""
    out = tmp_path / "v.mp4"
    r = avatar("render", str(job_dir / "job.yaml"), "-o", str(out), "--json", "--nproc", "3")  # refused in-process
    assert r.returncode == 2, r.stderr[-2000:]
    error = json.loads(r.stdout.strip().splitlines()[-1])
    assert error["event"] == "error" and "dit.heads=2 is not divisible by the degree 3" in error["message"]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr and "OMP_NUM_THREADS" not in r.stderr
    assert "error (rank" not in r.stderr  # no worker ran

    r = torchrun("--standalone", "--nproc_per_node", "3", "-m", "avatar_cli", "render", str(job_dir / "job.yaml"),
                 "-o", str(out), "--json", timeout=120)
    assert r.returncode != 0
    # Each rank refuses on its own; torchrun's agent stops the others once one has, so which ranks get to say it
    # depends on timing (in one CI run under load, rank 0's last line was another error, code 1). At least one
    # rank names the reason, with exit code 2 (torchrun's own failure report below it is torchrun's).
    reason = "dit.heads=2 is not divisible by the degree 3"
    errors = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    said = [e for e in errors if e.get("event") == "error" and reason in e.get("message", "")]
    assert all(e["code"] == 2 for e in said) and (said or f"): sequence parallel: {reason}" in r.stderr), \
        r.stdout + r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "ref.png", "speech.wav"]  # nothing written


def test_workers_stop_when_the_launcher_is_killed(job_dir: Path, tmp_path: Path):
    """kill -9 of the launcher (an OOM kill, a scheduler): its orphaned workers must not render on."""
    import os
    import signal
    import time

    out = tmp_path / "v.mp4"
    proc = start_long_render(job_dir, out)
    try:
        workers = [p for p in descendants(proc.pid) if rank_of(p) is not None]
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
            time.sleep(0.2)
        alive = [p for p in workers if Path(f"/proc/{p}").exists()
                 and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]]
    finally:
        proc.kill()
        for p in [p for p in workers if Path(f"/proc/{p}").exists()]:
            os.kill(p, signal.SIGKILL)
    assert not alive, "workers outlived their launcher"
    assert not out.exists()
