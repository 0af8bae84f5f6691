"""The `avatar` command. Thin: each command parses its arguments and calls one runner.

Exit codes: 0 success; 1 failure while rendering; 2 invalid job spec or input; 130 interrupted (SIGINT);
143 terminated (SIGTERM).

Each command imports what it runs inside its own function, for start-up time: `avatar --help` or a usage error
answers without importing torch.
"""

import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from avatar_cli.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, AvatarError, InputError, failure_message

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Render talking-avatar videos of any length from a reference picture and a speech track.")
models_app = typer.Typer(help="List the models available, or write a new model directory.")
app.add_typer(models_app, name="models")
prompts_app = typer.Typer(help="The text cache: prompt encodings computed once (runtime.text_cache).",
                          no_args_is_help=True)
app.add_typer(prompts_app, name="prompts")
serve_app = typer.Typer(help="Serve a heavy component to a fleet of renders over HTTP.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")


JobArg = Annotated[Path, typer.Argument(help="The job spec (YAML).", show_default=False)]
OverridesArg = Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides, e.g. video.fps=30 seed=7.",
                                                             show_default=False)]
OutputOpt = Annotated[Optional[str], typer.Option("-o", "--output", help="Output .mp4 (overrides the spec's).")]
JsonOpt = Annotated[Optional[bool], typer.Option("--json/--no-json", help="JSON lines on stdout "
                                                 "(default: on when stdout is not a terminal).", show_default=False)]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so cleanup runs as for Ctrl-C."""


def _install_signal_handlers() -> dict:
    """First SIGINT/SIGTERM: stop within the current chunk, keeping a playable partial file and a
    resumable checkpoint. A second SIGINT: exit at once. Returns the handlers they replace."""
    interrupted = False
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(exc: type[BaseException], code: int):
        def on_signal(signum, frame):  # noqa: ARG001
            nonlocal interrupted
            if interrupted:
                os._exit(code)
            interrupted = True
            raise exc
        return on_signal

    signal.signal(signal.SIGINT, handler(KeyboardInterrupt, EXIT_INTERRUPTED))
    signal.signal(signal.SIGTERM, handler(Terminated, EXIT_TERMINATED))
    return previous


_interrupt_reported = False  # _run said so already; _app must not say it twice
# Set by main(): the process ends when the command does. Only then does _run leave SIGINT/SIGTERM ignored.
_process_ends_after_run = False


def _kept_text(kept: Optional[bool]) -> str:
    """What an interrupted render left (None: no render was under way)."""
    if kept is None:
        return ""
    if kept:
        return "; the partial output and its checkpoint were kept: render again to continue"
    return "; nothing was kept (it stopped before the first checkpoint)"


def _run(action, json_mode: Optional[bool], debug: bool) -> None:
    """Run one command's action; turn every failure into one line and an exit code."""
    debug = debug or os.environ.get("AVATAR_DEBUG") == "1"
    from avatar_cli.report import make_reporter

    reporter = make_reporter(json_mode)
    previous = _install_signal_handlers()
    try:
        code = action(reporter)
    except AvatarError as e:
        if debug:
            traceback.print_exc()
        reporter.error(e.exit_code, str(e))
        raise typer.Exit(e.exit_code) from None
    except (KeyboardInterrupt, Terminated) as e:
        global _interrupt_reported
        _interrupt_reported = True
        code, what = (EXIT_TERMINATED, "terminated") if isinstance(e, Terminated) else (EXIT_INTERRUPTED, "interrupted")
        reporter.error(code, what + _kept_text(getattr(e, "kept_partial", None)))
        raise typer.Exit(code) from None
    except Exception as e:  # an unexpected failure while rendering
        if debug:
            traceback.print_exc()
        reporter.error(1, failure_message(e) + " (run with --debug for details)")
        raise typer.Exit(1) from None
    finally:
        # The outcome is decided (the output committed, or the error reported): a signal now, while the
        # interpreter winds down, must not turn it into 130/143 (a Slurm SIGTERM would fail a finished job).
        # So the process's own entry (main) ignores them from here to its exit; a caller in-process (a test,
        # a program that runs the app) gets back the handlers it had.
        for sig, was in previous.items():
            signal.signal(sig, signal.SIG_IGN if _process_ends_after_run else was)
    if code:
        raise typer.Exit(code)


@app.command(context_settings={"allow_interspersed_args": True})
def render(
    args: Annotated[list[str], typer.Argument(help="Job files, folders of them or globs, then dotted overrides "
                                              "(key=value) for every job.", show_default=False)],
    output: OutputOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace existing outputs, finished or not.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue interrupted renders, and refuse to start over "
                                         "one whose job changed (a plain rerun continues too, but starts a changed "
                                         "job over).")] = False,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop the batch at the first failed job.")] = False,
    shard: Annotated[Optional[str], typer.Option("--shard", help="I/N: render only every N-th job, starting at I "
                                                 "(0-based), of the sorted job list.", show_default=False)] = None,
    nproc: Annotated[int, typer.Option("--nproc", help="Run under torchrun with this many processes "
                                       "(one per GPU) on this host.")] = 1,
    preview: Annotated[bool, typer.Option("--preview", help="Serve the HLS output (-o NAME.m3u8) and a player page "
                                          "on loopback while it renders; prints the URL (live.preview).")] = False,
    json: JsonOpt = None, debug: DebugOpt = False,
) -> None:
    """Render one or more jobs to MP4, or run a live session (audio=- or a stream URL, -o - or a stream)."""
    debug = debug or os.environ.get("AVATAR_DEBUG") == "1"

    def action(reporter):
        from avatar_cli.batch import batch_exit_code, expand_jobs, names_several, parse_shard, run_batch, take_shard
        from avatar_cli.errors import SpecError

        if nproc < 1:  # the launcher would quietly treat 0 or -1 as one process
            raise SpecError("--nproc must be at least 1")
        overrides = [a for a in args if "=" in a and not Path(a).exists()] + (["live.preview=true"] if preview else [])
        job_args = [a for a in args if a not in overrides]
        if not job_args:
            raise SpecError("no job given: avatar render JOB.yaml [KEY=VALUE ...]")
        jobs = take_shard(expand_jobs(job_args), parse_shard(shard) if shard else None)
        if output is not None and len(jobs) > 1:
            raise SpecError("-o/--output needs exactly one job; give each job its own output in its spec")
        if force and resume:
            raise SpecError("--force and --resume contradict each other: --force starts over")
        if nproc > 1:  # checked here, before any worker starts: then the same command in nproc workers
            from avatar_cli.launch import check_rank_count, relaunch

            check_rank_count(jobs, overrides, output, nproc)
            import torch

            if not torch.cuda.is_available():
                reporter.info(f"note: no GPU here: the {nproc} workers share this host's CPUs, which is slower than "
                              "one process; --nproc is meant for GPUs")
            return relaunch(nproc, _without_nproc(sys.argv[1:]), debug)
        # A folder, a glob or a shard is a batch even when it holds one job: the same events every time.
        as_batch = len(jobs) != 1 or shard is not None or any(map(names_several, job_args))
        results = run_batch(jobs, overrides, output, force, resume, fail_fast, reporter, debug, as_batch)
        from avatar_cli.runtime.distributed import shutdown_distributed

        if all(r.status != "failed" for r in results):  # after a failure the peers may be gone: just exit
            shutdown_distributed()  # under torchrun: every rank is done before any process group goes away
        if as_batch:
            reporter.batch(results)
        return batch_exit_code(results)

    _run(action, json, debug)


@app.command()
def validate(job: JobArg, overrides: OverridesArg = None, output: OutputOpt = None,
             json: JsonOpt = None, debug: DebugOpt = False) -> None:
    """Check a job spec and open its inputs, without loading models."""
    def action(reporter):
        from avatar_cli.job import resolve
        from avatar_cli.spec import load_job

        j = load_job(job, overrides, output)
        p = resolve(j, force=True)  # an existing output is render's business (--force), not validity
        warnings = p.warnings
        info = {"event": "valid", "job": str(j.path), "reference": str(j.reference),
                "reference_size": [int(p.image.shape[1]), int(p.image.shape[0])], "audio": str(j.audio),
                "audio_s": round(p.audio.duration_s, 4) if p.audio is not None else None,  # None: a live input
                "frames": p.frames if p.audio is not None else None, "video_fps": j.spec.video.fps,
                "size": list(p.size), "model": p.model.name, "output": str(j.output),
                "output_exists": isinstance(j.output, Path) and j.output.exists(), "warnings": warnings}
        if p.sr is not None:  # frame super-resolution: `size` is its output, from frames of `from_size`
            info["sr"] = {"model": str(p.sr.model), "scale": p.sr.scale, "from_size": list(p.sr.lq)}
        for warning in warnings:
            reporter.info(warning)
        _print_info(reporter, info)

    _run(action, json, debug)


@app.command()
def plan(job: JobArg, overrides: OverridesArg = None,
         gpus: Annotated[str, typer.Option("--gpus", help="The GPUs: COUNTxSIZE, e.g. 1x24GB, 5x24GB, 8x80GB.")] = "1x80GB",
         host_memory: Annotated[Optional[str], typer.Option("--host-memory", help="The host's memory, e.g. 32GB "
                                                            "(chooses where offloaded blocks wait).")] = None,
         model: Annotated[Optional[str], typer.Option("--model", help="Plan for this model instead of the job's: a "
                                                      "directory, or a size without weights (wan-s2v-14b).")] = None,
         util: Annotated[float, typer.Option("--util", help="Share of the card's bf16 peak the speed assumes.")] = 0.4,
         tflops: Annotated[Optional[float], typer.Option("--tflops", help="The card's dense bf16 peak, TFLOP/s.")] = None,
         link_gbs: Annotated[Optional[float], typer.Option("--link-gbs", help="GPU-to-GPU bandwidth, GB/s.")] = None,
         json: JsonOpt = None, debug: DebugOpt = False) -> None:
    """Print the layout a render of JOB would choose on these GPUs, the memory it needs and its expected speed,
    without a GPU or weights (docs/plan.md)."""
    def action(reporter):
        from avatar_cli.plan import format_plan, machine, make_plan
        from avatar_cli.report import JsonReporter
        from avatar_cli.spec import load_job

        m = machine(gpus, host_memory, tflops, link_gbs)
        j = load_job(job, list(overrides or []) + ([f"model={model}"] if model else []))
        p = make_plan(j, m, util=util)
        if isinstance(reporter, JsonReporter):
            reporter.emit({"event": "plan", **p.to_json()})
        else:
            print(format_plan(p))

    _run(action, json, debug)


@models_app.callback(invoke_without_command=True)
def models(ctx: typer.Context, json: JsonOpt = None, debug: DebugOpt = False) -> None:
    """List the models available: shipped ones by name, with parameter counts and where each lives."""
    if ctx.invoked_subcommand is not None:
        return

    def action(reporter):
        from avatar_cli.families.registry import param_count, resolve_model, shipped_names

        for name in sorted(shipped_names()):
            src = resolve_model(name, Path.cwd())
            _print_info(reporter, {"event": "model", "name": name, "size": src.config.size,
                                   "params": param_count(src), "trained": src.trained,
                                   "location": src.location})

    _run(action, json, debug)


@models_app.command("init")
def models_init(directory: Annotated[Path, typer.Argument(help="A new (or empty) folder.")],
                size: Annotated[Optional[str], typer.Option(
                    "--size", help="A named size: mini (default) or tiny; wan-s2v, swiftvr: tiny (default).")] = None,
                seed: Annotated[int, typer.Option("--seed", help="Seed of the random init.")] = 0,
                family: Annotated[str, typer.Option("--family", help="mini, wan-s2v (the official Wan2.2-S2V "
                                                    "layout, random weights), or swiftvr (a super-resolution "
                                                    "model for sr.model, in the SwiftVR release's layout).")] = "mini",
                json: JsonOpt = None, debug: DebugOpt = False) -> None:
    """Write a randomly initialised model directory in the family's real format."""
    def action(reporter):
        from avatar_cli.families.registry import get, init_family_dir, param_count

        if family == SR_FAMILY:
            _print_info(reporter, _sr_init(directory, size or "tiny", seed))
            return
        chosen = size or get(family).sizes[0]  # the family's default size
        src = init_family_dir(directory, chosen, seed, family)
        _print_info(reporter, {"event": "model", "name": str(directory), "family": src.family_name, "size": chosen,
                               "params": param_count(src), "trained": False,
                               "location": str(directory.resolve())})

    _run(action, json, debug)


@models_app.command("check")
def models_check(directory: Annotated[Path, typer.Argument(help="A model directory: a Wan2.2-S2V release "
                                                            "(official or Diffusers layout), a SwiftVR release "
                                                            "(sr.model) or a mini one; or a single-file "
                                                            "Wan2.2-S2V DiT (.safetensors, .gguf).")],
                 json: JsonOpt = None, debug: DebugOpt = False) -> None:
    """Check a model directory from its headers alone (no weights are read): per component its tensors,
    parameters, dtypes and bytes, and every missing, unexpected or mis-shaped tensor by name.
    Exit 0 when everything fits, 2 when something does not."""
    def action(reporter):
        from avatar_cli.families.registry import check_directory
        from avatar_cli.sr.swiftvr import model_dir as sr_dir

        report = _sr_check(directory) if sr_dir.is_release_dir(directory) else check_directory(directory)
        _print_check(reporter, report)
        if not report["ok"]:
            raise InputError(f"models check: {directory}: " + report["summary"])

    _run(action, json, debug)


@prompts_app.command("encode", context_settings={"allow_interspersed_args": True})
def prompts_encode(
    args: Annotated[list[str], typer.Argument(help="Job files, folders of them or globs, then dotted overrides "
                                              "(key=value) for every job.", show_default=False)],
    json: JsonOpt = None, debug: DebugOpt = False,
) -> None:
    """Fill the text cache for these jobs before a fleet run: each distinct prompt of each model encoded once
    (only the text encoder is loaded; jobs with runtime.text_service.url ask that service instead); says how
    many were new and how many already cached. Exit 2 if a job is bad (the others are still filled)."""
    def action(reporter):
        from avatar_cli.batch import expand_jobs
        from avatar_cli.errors import EXIT_BAD_INPUT, SpecError
        from avatar_cli.prompts.encode import fill

        overrides = [a for a in args if "=" in a and not Path(a).exists()]
        job_args = [a for a in args if a not in overrides]
        if not job_args:
            raise SpecError("no job given: avatar prompts encode JOB.yaml [KEY=VALUE ...]")
        r = fill(expand_jobs(job_args), overrides, reporter.info)
        for _, code, message in r.bad:
            reporter.error(code, message)
        _print_info(reporter, {"event": "prompts", "jobs": r.jobs, "distinct": r.distinct, "new": r.new,
                               "fetched": r.fetched, "cached": r.cached, "off": r.off, "bad": len(r.bad)})
        return EXIT_BAD_INPUT if r.bad else 0  # a job that cannot be read is bad input, as in render

    _run(action, json, debug)


@serve_app.command("text")
def serve_text(
    model: Annotated[str, typer.Argument(help="A shipped model's name (mini) or a model directory.",
                                         show_default=False)],
    host: Annotated[str, typer.Option("--host", help="Address to listen on; beyond loopback a token is required "
                                      "($AVATAR_TEXT_TOKEN or --token-file).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port (0: a free one, said at start).")] = 8765,
    dtype: Annotated[str, typer.Option("--dtype", help="auto, float32 or bfloat16 (jobs must run the same).")] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    weights: Annotated[str, typer.Option("--weights", help="bf16, fp8 or int8: the encoder's weights, as "
                                         "runtime.weights (jobs must run the same).")] = "bf16",
    threads: Annotated[int, typer.Option("--threads", help="CPU threads of the encoder (0: one per core; a small "
                                         "encoder answers faster with 1).")] = 0,
    max_request_bytes: Annotated[int, typer.Option("--max-request-bytes", help="Larger requests get 413.")] = 65536,
    token_file: Annotated[Optional[Path], typer.Option("--token-file", help="A file holding the bearer token "
                                                       "(instead of $AVATAR_TEXT_TOKEN).")] = None,
    debug: DebugOpt = False,
) -> None:
    """Load MODEL's text encoder once and answer encode requests over HTTP (schema avatar-text/1), until
    Ctrl-C or SIGTERM. Jobs name it in runtime.text_service.url; their text cache stays in front."""
    def action(reporter):
        try:
            from avatar_cli.service.text_server import serve
        except ImportError as e:
            if e.name not in ("fastapi", "uvicorn", "starlette", "pydantic"):
                raise
            from avatar_cli.service import INSTALL_HINT

            raise InputError(f"avatar serve text needs {e.name}, which is not installed: {INSTALL_HINT}") from None
        serve(model, host, port, dtype, device, threads, max_request_bytes, token_file, reporter.info, dict(os.environ),
              weights)

    _run(action, False, debug)


SR_FAMILY = "swiftvr"  # `models init --family swiftvr`: a super-resolution directory, not a render family


def _sr_init(directory: Path, size: str, seed: int) -> dict:
    """`models init --family swiftvr`: a random tiny SwiftVR directory in the release's layout."""
    from avatar_cli.sr.swiftvr import model_dir as sr_dir

    if size != "tiny":
        raise InputError(f"--size: {size}: swiftvr is written at the tiny size only (the release's weights are "
                         "downloaded, not initialised)")
    params = sum(c["params"] for c in _sr_components(sr_dir.init_tiny(directory, seed)).values())
    return {"event": "model", "name": str(directory), "family": SR_FAMILY, "size": size, "params": params,
            "trained": False, "location": str(directory.resolve())}


def _sr_components(rel) -> dict[str, dict]:
    """Each file of a checked SwiftVR directory (sr/swiftvr/model_dir.py ReleaseDir), from its headers: tensors,
    parameters, bytes, dtypes."""
    infos = {"reae": (rel.reae_index.source, rel.reae_index.tensors.values()),
             "prompt": (str(rel.prompt.file), [rel.prompt]),
             "transformer": (rel.dit_index.source, rel.dit_index.tensors.values())}
    return {name: {"file": f, "tensors": len(ts), "params": sum(i.numel for i in ts),
                   "bytes": sum(i.nbytes for i in ts),
                   "dtypes": sorted({str(i.dtype).removeprefix("torch.") for i in ts})}
            for name, (f, ts) in infos.items()}


def _sr_check(directory: Path) -> dict:
    """`models check` of a SwiftVR directory: the model's own check from the headers (a missing, unexpected or
    mis-shaped tensor, a pickle, another model's transformer: InputError naming it), then each file's counts."""
    from avatar_cli.sr.swiftvr import model_dir as sr_dir

    comps = _sr_components(sr_dir.read_release(directory))
    lines = [f"{directory}: SwiftVR (sr.model), the release's layout"]
    lines += [f"  {n:12} {c['tensors']:5} tensors {c['params']:>15,} params {c['bytes'] / 1e9:8.3f} GB "
              f"{','.join(c['dtypes'])}  ok" for n, c in comps.items()]
    return {"path": str(directory), "family": SR_FAMILY, "layout": "swiftvr", "ok": True, "components": comps,
            "lines": lines, "summary": "ok"}


def _print_check(reporter, report: dict) -> None:
    from avatar_cli.report import JsonReporter

    if isinstance(reporter, JsonReporter):
        reporter.emit({"event": "check", **{k: v for k, v in report.items() if k != "lines"}})
    else:
        print("\n".join(report["lines"]))


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


REFERENCE_MIN_SIZE = 16
# Decoding and resizing the reference take time and memory growing with its area (figures: bench/results.md).
REFERENCE_MAX_SIZE = 4096


@app.command()
def reference(seed: Annotated[int, typer.Option("--seed", help="Identity seed (training uses 0..99999; "
                                                 "1000000 and up are never trained on).")],
              output: Annotated[Path, typer.Option("-o", "--output", help="PNG to write (.png).")],
              size: Annotated[int, typer.Option("--size", help=f"Side in pixels: even, {REFERENCE_MIN_SIZE} to "
                                                f"{REFERENCE_MAX_SIZE}.")] = 256,
              force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
              debug: DebugOpt = False) -> None:
    """Write a procedurally generated reference face (PNG)."""
    def action(reporter):
        from avatar_cli.errors import InputError
        from avatar_cli.files import atomic_path
        from avatar_cli.media.image import save_png
        from avatar_cli.synth import render_reference

        if seed < 0:
            raise InputError("--seed must be >= 0")
        if not REFERENCE_MIN_SIZE <= size <= REFERENCE_MAX_SIZE or size % 2:
            raise InputError(f"--size must be an even number from {REFERENCE_MIN_SIZE} to {REFERENCE_MAX_SIZE}")
        if output.suffix.lower() != ".png":  # it only writes PNG: a .jpg name would hold PNG bytes
            raise InputError(f"output: {output} must end in .png")
        if output.exists() and not force:
            raise InputError(f"output: {output} already exists; pass --force to replace it")
        output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(output) as tmp:
            save_png(tmp, render_reference(seed, size))
        reporter.info(f"wrote {output}")

    _run(action, False, debug)


@app.command()
def train(out: Annotated[Path, typer.Option("--out", help="Model directory to write (config.json + safetensors).")],
          work: Annotated[Optional[Path], typer.Option("--work", help="Checkpoints and latent cache "
                                                       "(default: <out>.work); a killed run resumes from it.")] = None,
          size: Annotated[str, typer.Option("--size", help="A named size: tiny or mini.")] = "mini",
          budget_minutes: Annotated[float, typer.Option("--budget-minutes", help="Wall-time budget.")] = 90.0,
          seed: Annotated[int, typer.Option("--seed")] = 0,
          restart: Annotated[bool, typer.Option("--restart", help="Ignore an existing checkpoint.")] = False,
          start_from: Annotated[Optional[Path], typer.Option(
              "--start-from", help="Begin at --phase, with what the earlier phases make taken from this model "
              "directory (ignored when --work holds a checkpoint to resume).")] = None,
          phase: Annotated[str, typer.Option("--phase", help="Phase to begin at with --start-from: "
                                             "cache, sr, dit or decoder.")] = "decoder",
          device: Annotated[str, typer.Option("--device", help="auto (CUDA when there is one), cpu or cuda.")] = "auto",
          debug: DebugOpt = False) -> None:
    """Train a model family on procedurally generated talking heads (see avatar_cli/train/MODEL_CARD.md)."""
    def action(reporter):
        from avatar_cli.train import train as run_train

        run_train(out, size, work, budget_minutes, seed, resume=not restart, start_from=start_from,
                  start_phase=phase, device=device)

    _run(action, False, debug)


@app.command("eval")
def eval_(model: Annotated[str, typer.Option("--model", help="A shipped model's name or a model directory.")] = "mini",
          long_minutes: Annotated[float, typer.Option("--long-minutes", help="Length of the drift render.")] = 10.0,
          identities: Annotated[int, typer.Option("--identities", help="Held-out identities to render.")] = 2,
          clip_s: Annotated[float, typer.Option("--clip-s", help="Length of each lip-sync clip.")] = 8.0,
          out_md: Annotated[Path, typer.Option("--out-md")] = Path("bench/results.md"),
          contact_sheet: Annotated[Path, typer.Option("--contact-sheet")] = Path("bench/contact_sheet.png"),
          debug: DebugOpt = False) -> None:
    """Score a model on held-out identities and speech: lip sync, drift, seams, VAE PSNR, prompt direction."""
    def action(reporter):
        from avatar_cli.evaluate import evaluate

        evaluate(model, out_md, contact_sheet, long_minutes, identities, clip_s,
                 command="avatar eval " + " ".join(sys.argv[2:]))

    _run(action, False, debug)


def _print_info(reporter, info: dict) -> None:
    from avatar_cli.report import JsonReporter

    if isinstance(reporter, JsonReporter):
        reporter.emit(info)
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            if k != "event":
                print(f"{k:<{width}}  {v}")
        print()


def _app(args: Optional[list[str]] = None) -> int:
    """Run the Typer app on args (default: the command line) and return the exit code. Usage errors (an
    unknown option, a missing argument) and a Ctrl-C before a command's own handlers are up end as every
    other error: one line, JSON when asked.

    Click's exceptions are recognised by shape: newer Typer vendors Click privately, older depends on it.
    """
    global _interrupt_reported
    _interrupt_reported = False
    argv = sys.argv[1:] if args is None else args
    json_mode = True if "--json" in argv else False if "--no-json" in argv else None
    try:
        code = app(standalone_mode=False) if args is None else app(args=args, prog_name="avatar",
                                                                     standalone_mode=False)
    except Exception as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # plain `avatar`: the help, as asked for
            print(e.format_message())
            return 0
        usage = hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int)
        if not usage and type(e).__name__ != "Abort":
            raise
        from avatar_cli.report import make_reporter

        if not usage:
            make_reporter(json_mode).error(EXIT_INTERRUPTED, "interrupted")
            return EXIT_INTERRUPTED
        ctx = getattr(e, "ctx", None)
        where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        make_reporter(json_mode).error(e.exit_code, e.format_message().splitlines()[0] + where)
        return e.exit_code
    code = code if isinstance(code, int) else 0
    if code == EXIT_INTERRUPTED and not _interrupt_reported:  # Ctrl-C while starting: Typer says nothing
        from avatar_cli.report import make_reporter

        make_reporter(json_mode).error(EXIT_INTERRUPTED, "interrupted")
    return code


def main() -> None:
    global _process_ends_after_run
    _process_ends_after_run = True
    # transformers imports torchao where it is installed (runtime.weights), and torchao's import makes torch log a
    # deprecation of its own internals on every run: nothing a user can act on.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # not a torchrun worker (checked without importing torch)
        sys.exit(_app())
    # A torchrun worker leaves without the interpreter's C++ teardown: after a run, gloo's threads can still
    # be torn down out of order there and abort the process ("terminate called without an active
    # exception", SIGABRT, no Python frame left) although every rank finished: 1 of 18 runs of the 2-rank
    # test script did, after the final barrier and destroy_process_group. Everything of ours is closed by now.
    from avatar_cli.launch import follow_launcher

    follow_launcher()
    try:
        code = _app()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
