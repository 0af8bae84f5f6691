"""`avatar render JOB --nproc N`: start the same command in N worker processes on this host.

The workers are started by torch's elastic launcher (what `torchrun --standalone` runs), called in this
process rather than as a `torchrun` child, so that a failed job ends like any other avatar error: the
workers print their one-line errors, this process exits with the cause's exit code (`exit_code`), and
no launcher banner, log lines or Python traceback follow unless --debug is given.
"""

import logging
import os
import signal
import sys
import uuid

from avatar_cli.errors import EXIT_INTERRUPTED, EXIT_RENDER_FAILED, EXIT_TERMINATED, RenderError
from avatar_cli.runtime.distributed import launched_by_torchrun


def worker_threads(nproc: int, cpus: int | None = None) -> int:
    """CPU threads per worker when OMP_NUM_THREADS is unset: the host's CPUs shared out (torchrun says 1)."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, cpus // nproc)


# Exit codes of a worker the launcher itself ended (it SIGTERMs the rest once one fails): ours after the
# SIGTERM handler, or the raw signal. Collateral, not the cause.
_ENDED_BY_LAUNCHER = (EXIT_TERMINATED, -signal.SIGTERM)


def exit_code(failures: dict[int, int]) -> int:
    """The failed workers' exit codes by rank -> ours: the cause, not the collateral.

    Rank 0's own code if it failed by itself (it is the one that reported to the user), else the lowest
    rank's; a worker killed by a signal of its own (-9) leaves only collateral: a failed render (1).
    """
    own = {rank: code for rank, code in failures.items() if code > 0 and code not in _ENDED_BY_LAUNCHER}
    if own:
        return own[min(own)]
    return EXIT_RENDER_FAILED if failures else 0


def check_rank_count(jobs: list, overrides: list[str], output: str | None, nproc: int) -> None:
    """Fail at once, before nproc workers start and load models, if a job's DiT can't be split nproc ways.

    Jobs that don't load are left to the workers, which report them as one process would.
    """
    # Imported here: resolving jobs pulls in torch and the families, which the launcher's other paths never need.
    from avatar_cli.errors import AvatarError, InputError
    from avatar_cli.job import resolve_parallel, resolve_source
    from avatar_cli.spec import load_job

    for path in jobs:
        try:
            job = load_job(path, overrides, output)
            source = resolve_source(job)
        except AvatarError:
            continue
        try:
            resolve_parallel(job, source, nproc)
        except InputError as e:
            raise InputError(f"{path}: {e}" if len(jobs) > 1 else str(e)) from None


def follow_launcher(poll_s: float = 0.5) -> None:
    """In a torchrun worker: stop as on SIGTERM if the launcher that started us dies (even by kill -9).

    Orphaned workers otherwise render on, reparented to init, and finish or overwrite files of a rerun.
    Polling the parent pid works whichever thread spawned us (PR_SET_PDEATHSIG fires on that thread's exit).
    """
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)  # the render winds down and keeps its checkpoint

    threading.Thread(target=watch, name="follow-launcher", daemon=True).start()


def relaunch(nproc: int, cli_args: list[str], debug: bool = False) -> int:
    """Run `python -m avatar_cli <cli_args>` in nproc workers; returns the exit code (non-zero if any failed).

    cli_args must no longer contain --nproc, or each worker would launch again.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if launched_by_torchrun():
        raise RuntimeError("--nproc given inside a torchrun worker")
    os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads(nproc)))
    if not debug:  # elastic's loggers set their own levels (LOGGERLEVEL), so a parent's level is not enough
        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
            if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    # --standalone: a local rendezvous on a free port (several jobs on one host don't collide).
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    try:
        elastic_launch(config, sys.executable)("-m", "avatar_cli", *cli_args)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        if codes.get(0, 0) < 0 and -codes[0] != signal.SIGTERM:  # rank 0, the one that reports, died unheard
            name = signal.Signals(-codes[0]).name
            raise RenderError(f"rank 0 was killed ({name}) and the other ranks stopped; its partial output and "
                              "checkpoint stay: render again to continue") from None
        return exit_code(codes)
    except SignalException as e:  # Ctrl-C or SIGTERM to this process: the launcher has ended the workers
        return EXIT_INTERRUPTED if e.sigval == signal.SIGINT else EXIT_TERMINATED
    return 0
