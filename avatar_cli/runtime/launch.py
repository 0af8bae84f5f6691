"""`avatar render JOB --nproc N`: start the same command under torchrun on this host."""

import subprocess
import sys

from avatar_cli.runtime.distributed import launched_by_torchrun


def torchrun_argv(nproc: int, cli_args: list[str]) -> list[str]:
    """The torchrun command line for `python -m avatar_cli <cli_args>` with nproc workers on this host.

    --standalone: a local rendezvous on a free port (several jobs on one host don't collide).
    cli_args must no longer contain --nproc, or each worker would launch again.
    """
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "avatar_cli", *cli_args]


def relaunch(nproc: int, cli_args: list[str]) -> int:
    """Run the job under torchrun and return its exit code (non-zero if any rank failed)."""
    if launched_by_torchrun():
        raise RuntimeError("--nproc given inside a torchrun worker")
    return subprocess.run(torchrun_argv(nproc, cli_args)).returncode
