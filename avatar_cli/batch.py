"""Many jobs in one command: expand folders and globs, take a shard, skip finished work, keep going.

No coordinator: `--shard I/N` takes every N-th job of the sorted list, starting at I, so N hosts (or a
Slurm array, or a Kubernetes Indexed Job) given the same list split it with no job done twice.
"""

import glob
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from avatar_cli.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RENDER_FAILED, AvatarError, SpecError, failure_message
from avatar_cli.report import Reporter


@dataclass
class JobResult:
    job: str
    status: str  # "done" | "skipped" | "failed" | "interrupted" | "not_started" (the batch stopped before it)
    wall_s: float
    code: int = EXIT_OK
    error: str | None = None
    output: str | None = None


def names_several(arg: str) -> bool:
    """A folder or a glob: a batch, however many jobs it turns out to hold."""
    return Path(arg).is_dir() or glob.has_magic(arg)


def expand_jobs(args: list[str]) -> list[Path]:
    """Files as given; folders as their *.yaml/*.yml files; globs expanded. Sorted within each argument."""
    jobs: list[Path] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:
                raise SpecError(f"job folder {path}: no .yaml files in it")
            jobs.extend(found)
        elif glob.has_magic(arg):
            found = sorted(Path(p) for p in glob.glob(arg) if Path(p).is_file())
            if not found:
                raise SpecError(f"job pattern {arg}: matches no files")
            jobs.extend(found)
        else:
            jobs.append(path)  # a missing file fails as that job's own error
    return jobs


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SpecError(f"--shard {text}: expected I/N, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise SpecError(f"--shard {text}: need 0 <= I < N")
    return i, n


def take_shard(jobs: list[Path], shard: tuple[int, int] | None) -> list[Path]:
    if shard is None:
        return jobs
    i, n = shard
    return jobs[i::n]


def is_complete(output: Path, tag: str) -> bool:
    """A finished render of this very job: our tag in its metadata (written only by a full render)."""
    import av

    try:
        with av.open(str(output)) as c:
            return c.metadata.get("comment") == tag
    except Exception:
        return False


def run_batch(jobs: list[Path], overrides: list[str], output: str | None, force: bool, resume: bool,
              fail_fast: bool, reporter: Reporter, debug: bool = False, report_batch: bool = True) -> list[JobResult]:
    """Render the jobs in order; every job gets a result, those after a stop 'not_started'.

    report_batch: on an interrupt, emit the batch summary before the interrupt goes on up (the CLI emits it
    otherwise, for a batch; a single job gives no summary).
    """
    # Imported here, not at the top: they pull in torch and the models' code, which `avatar --help`, `validate`'s
    # argument errors and job-list expansion never need.
    from avatar_cli import render
    from avatar_cli.job import check_output, resolve
    from avatar_cli.pipeline.fingerprint import job_fingerprint
    from avatar_cli.runtime.distributed import launched_by_torchrun
    from avatar_cli.spec import load_job

    models = render.ModelCache()
    results: list[JobResult] = []
    # Under torchrun a job that fails while rendering may have left the ranks at different collectives
    # (one rank's disk filled, a peer died): the next job would hang or mismatch. End the batch there.
    # Bad input is found before any collective, identically on every rank, so the batch goes on past it.
    ranked = launched_by_torchrun()
    for path in jobs:
        t0 = time.perf_counter()
        rendering = False
        try:
            job = load_job(path, overrides, output)
            if job.live and len(jobs) > 1:
                raise SpecError(f"{path}: a live session (audio or output a stream) runs alone, not in a batch")
            # Resolved once. A live session's outputs are checked there, with --force as given; a file render's
            # existing output is looked at next (a finished render of this job is skipped, not an error).
            prepared = resolve(job, force=force or not job.live)
            if job.live:  # a live session (avatar_cli/render/live.py): no resume, one job alone
                rendering = True
                summary = render.run_session(prepared, reporter, models)
                reporter.done(summary)
                results.append(JobResult(str(path), "done", time.perf_counter() - t0, output=summary["output"]))
                continue
            if job.output.exists() and not force:
                tag = render.output_tag(job_fingerprint(prepared.job, prepared.model))
                if is_complete(job.output, tag):
                    reporter.skipped(str(path), str(job.output), "already rendered from this job (--force to redo)")
                    results.append(JobResult(str(path), "skipped", time.perf_counter() - t0, output=str(job.output)))
                    continue
                check_output(job.output, force)  # not this job's finished render: --force replaces it
            rendering = True
            # A rerun continues an interrupted render of the same job; --resume also refuses to discard one
            # of a changed job; --force starts over.
            mode = render.Resume.never if force else render.Resume.strict if resume else render.Resume.auto
            summary = render.render(prepared, reporter, models, resume=mode)
            reporter.done(summary)
            results.append(JobResult(str(path), "done", time.perf_counter() - t0, output=summary["output"]))
        except AvatarError as e:
            if debug:
                traceback.print_exc()
            reporter.error(e.exit_code, f"{path}: {e}" if len(jobs) > 1 else str(e))
            results.append(JobResult(str(path), "failed", time.perf_counter() - t0, e.exit_code, str(e)))
            if fail_fast or (ranked and rendering):
                _stopped(reporter, jobs, results, fail_fast)
                break
        except Exception as e:  # an unexpected failure in one job must not sink the batch
            if debug:
                traceback.print_exc()
            message = failure_message(e)
            reporter.error(EXIT_RENDER_FAILED, f"{path}: {message}" if len(jobs) > 1 else message)
            results.append(JobResult(str(path), "failed", time.perf_counter() - t0, EXIT_RENDER_FAILED, message))
            if fail_fast or (ranked and rendering):
                _stopped(reporter, jobs, results, fail_fast)
                break
        except SystemExit:
            raise
        except BaseException:  # Ctrl-C or SIGTERM: the summary still says what was done, then the CLI exits
            results.append(JobResult(str(path), "interrupted", time.perf_counter() - t0))
            results += _not_started(jobs, results)
            if report_batch:
                reporter.batch(results)
            raise
    return results


def _stopped(reporter: Reporter, jobs: list[Path], results: list, fail_fast: bool) -> None:
    left = _not_started(jobs, results)
    if left:
        why = "--fail-fast" if fail_fast else "a render failed under torchrun, so the ranks may be out of step"
        reporter.info(f"batch stopped ({why}): {len(left)} job(s) not started")
    results += left


def _not_started(jobs: list[Path], results: list) -> list[JobResult]:
    return [JobResult(str(path), "not_started", 0.0) for path in jobs[len(results):]]


def batch_exit_code(results: list[JobResult]) -> int:
    """0 if no job failed; else 1 if any render failed, else 2 (only bad specs or inputs)."""
    codes = {r.code for r in results if r.status == "failed"}
    if not codes:
        return EXIT_OK
    return EXIT_RENDER_FAILED if EXIT_RENDER_FAILED in codes else EXIT_BAD_INPUT
