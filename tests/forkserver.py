"""`python -m avatar_cli ARGS` for the tests, without paying a fresh interpreter's start each time.

A fresh `avatar render` spends ~2.5 s of its ~3 s on a tiny model starting Python and importing torch,
transformers and avatar_cli; the suite starts such processes about a hundred times. So each test process keeps
a fork server (as multiprocessing's "forkserver" does): a single-threaded process that has imported those
modules and done nothing else. Each `avatar` run is a child forked from it: a process of its own (its pid,
signals, exit code, stdout and stderr pipes, environment and working folder), that runs avatar_cli's `__main__`
the way `python -m` does. What it inherits is imports only: the server holds no test's state, no threads. A
server is started per thread setting (OMP_NUM_THREADS: OpenMP reads it once, at start, for every thread a render
starts), and test_render.py holds a forked render's frames equal to a fresh interpreter's.

The tests' Popen-like handle (ForkedCli) speaks to the server over a Unix socket: a request carries the child's
stdout/stderr pipe ends (SCM_RIGHTS), its argv, folder and environment; the reply is the pid, then, when the
child ends, its wait status. Fresh interpreters are still started for the end-to-end render (test_render.py),
the timing of `models check`, and every torchrun worker (torchrun's agent starts them; the launcher is forked).
"""

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ["torch", "numpy", "av", "typer", "rich", "omegaconf", "safetensors", "avatar_cli.cli",
           "avatar_cli.report", "avatar_cli.runner", "avatar_cli.batch", "avatar_cli.spec",
           "avatar_cli.families.mini.family", "avatar_cli.families.wan_s2v.family", "transformers",
           "torch.distributed.run"]


# ---------------------------------------------------------------- the server (`python -m tests.forkserver SOCKET`)

def _child(conn: socket.socket, listener: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m avatar_cli ARGS` in the requested folder and environment."""
    import runpy

    code = 70
    try:
        listener.close()
        conn.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` puts the folder it starts in first
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdout = open(1, "w", encoding="utf-8", errors="strict", buffering=1, closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
        try:
            if request.get("entry"):  # `python -c "from MODULE import FUNCTION; FUNCTION()" ARGS`
                import importlib

                sys.argv = ["-c", *request["args"]]
                module, function = request["entry"].split(":")
                getattr(importlib.import_module(module), function)()
            else:
                sys.argv = ["-m", *request["args"]]
                runpy.run_module("avatar_cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        # What the interpreter does on its way out: wait for non-daemon threads, run atexit handlers.
        import atexit
        import threading

        threading._shutdown()
        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT  # a SIGINT that escaped the CLI's own handling, as Python reports it
        try:
            import traceback

            traceback.print_exc()
        except BaseException:
            pass
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # What a wan render imports where it builds its models (see components.py, text.py, sampler.py).
    from diffusers import UniPCMultistepScheduler  # noqa: F401
    from transformers import UMT5EncoderModel, Wav2Vec2ForCTC, Wav2Vec2Model  # noqa: F401
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # the test process is gone: so is the server
        ready, _, _ = select.select([listener], [], [], 0.02)
        if ready:
            conn, _ = listener.accept()
            fds: list[int] = []
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    _child(conn, listener, request, fds)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                children[pid] = conn
            except Exception as e:  # a client that went away mid-request: the server stays up for the others
                print(f"forkserver: request dropped: {type(e).__name__}: {e}", file=sys.stderr)
                conn.close()
            finally:
                for fd in fds:
                    os.close(fd)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:  # the test gave up on it
                    pass
                conn.close()


# ---------------------------------------------------------------- the tests' side

# Read once, when OpenMP starts, and not by a later torch.set_num_threads for the threads a render starts: a
# child must come from a server started with its own thread settings (a render with 2 threads where a fresh
# process has 1 makes other floats).
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class _Server:
    def __init__(self, threads: tuple) -> None:
        # A Unix socket's path must fit in 108 bytes: a long TMPDIR (a CI runner's work folder) would not leave room.
        self.folder = tempfile.mkdtemp(prefix="avatar-fs-", dir="/tmp" if len(tempfile.gettempdir()) > 60 else None)
        self.path = os.path.join(self.folder, "socket")
        # The test process's environment with the request's thread settings, whichever test happens to start it.
        env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
        env.update({k: v for k, v in zip(THREAD_VARS, threads) if v is not None})
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", self.path], stdout=subprocess.PIPE,
                                     text=True, cwd=Path(__file__).resolve().parents[1], env=env)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()})")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: dict[tuple, _Server] = {}


def _get_server(env: dict) -> _Server:
    threads = tuple(env.get(k) for k in THREAD_VARS)
    server = _servers.get(threads)
    if server is None or server.proc.poll() is not None:
        server = _servers[threads] = _Server(threads)
    return server


def close_server() -> None:
    while _servers:
        _servers.popitem()[1].close()


class ForkedCli:
    """The part of subprocess.Popen the tests use, for `python -m avatar_cli ARGS` (text mode)."""

    def __init__(self, args, *, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=None, env=None,
                 entry: str | None = None) -> None:
        env = dict(os.environ if env is None else env)
        server = _get_server(env)
        out_r, out_w = os.pipe() if stdout == subprocess.PIPE else (None, os.open(os.devnull, os.O_WRONLY))
        err_r, err_w = os.pipe() if stderr == subprocess.PIPE else (None, os.open(os.devnull, os.O_WRONLY))
        self.args = list(args)
        request = {"args": self.args, "cwd": str(cwd or os.getcwd()), "env": env, "entry": entry}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(server.path)
        socket.send_fds(self._conn, [json.dumps(request).encode()], [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        self._reader = self._conn.makefile("r")
        self.pid = json.loads(self._reader.readline())["pid"]
        self.stdout = open(out_r, "r", encoding="utf-8") if out_r is not None else None
        self.stderr = open(err_r, "r", encoding="utf-8", errors="backslashreplace") if err_r is not None else None
        self.returncode: int | None = None

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return None
        line = self._reader.readline()
        if not line:
            raise RuntimeError("the fork server ended before its child")
        self.returncode = os.waitstatus_to_exitcode(json.loads(line)["status"])
        self._reader.close()
        self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended and reaped by the server; its status is on the way
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read both pipes to their end (the child's exit closes them), then wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = {f: [] for f in (self.stdout, self.stderr) if f is not None}
        open_files = [f for f in chunks if not f.closed]
        while open_files:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(open_files, [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for f in ready:
                data = os.read(f.fileno(), 1 << 16)
                if data:
                    chunks[f].append(data)
                else:
                    open_files.remove(f)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        texts = {f: b"".join(c).decode("utf-8", "backslashreplace").replace("\r\n", "\n").replace("\r", "\n")
                 for f, c in chunks.items()}  # text mode's newlines, as Popen.communicate translates them
        for f in chunks:
            f.close()
        return texts.get(self.stdout), texts.get(self.stderr)


def run(args, *, timeout: float | None = 300, cwd=None, env=None, entry: str | None = None
        ) -> subprocess.CompletedProcess:
    """subprocess.run(..., capture_output=True, text=True) for `python -m avatar_cli ARGS` (or for `entry`,
    "MODULE:FUNCTION", called as `python -c` would call it)."""
    proc = ForkedCli(args, cwd=cwd, env=env, entry=entry)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(["avatar", *args], proc.returncode, out, err)


if __name__ == "__main__":
    serve(sys.argv[1])
