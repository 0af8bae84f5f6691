"""Byte-compile what avatar imports: the last step of `make setup`, after `pip install --no-compile`.

pip byte-compiles every file it installs, one after another: torch, triton, transformers and the rest are
about 12,000 files, and compiling them was ~110 s of a ~190 s install on 2 cores, while a render and the test
suite import a fraction of them. Python writes the bytecode of a module it imports itself, except where
PYTHONDONTWRITEBYTECODE is set (CI machines and containers often set it): there every process would compile
the modules it imports from source again (torch's alone cost ~1.5 s more per process). So setup imports, once
and with bytecode writing on, what avatar's commands, its lazily imported parts and its tests import, in two
processes at once. A module left out still works; it is compiled in memory each time it is imported.

    python -m avatar_cli._bytecode
"""

import importlib
import os
import pkgutil
import subprocess
import sys

# What avatar imports only inside the functions that need it (see each module), and modules of its dependencies
# that a render or a test reaches but an import of avatar_cli does not (found with an audit hook on "compile").
LAZY = [
    "transformers.Wav2Vec2Model", "transformers.Wav2Vec2ForCTC", "transformers.UMT5EncoderModel",
    "transformers.PreTrainedTokenizerFast", "diffusers.UniPCMultistepScheduler",
    "torch.utils.flop_counter", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.run", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "torch.testing",
    "torch.utils.serialization", "typer._adapters", "typer._click.decorators", "typer.testing", "av.subtitles",
    "numpy.ctypeslib", "numpy.ma", "numpy.testing", "PIL.Image", "pydantic.v1", "fastapi", "httpx",
    "uvicorn.loops.auto", "uvicorn.protocols.http.auto", "uvicorn.protocols.websockets.auto", "uvicorn.lifespan.on",
    "uvicorn.lifespan.off",
]
# What the tests run on.
TESTS = ["walk:_pytest", "pytest", "walk:xdist", "execnet", "anyio.pytest_plugin", "anyio._backends._asyncio"]


def _module_and_attribute(name: str) -> tuple[str, str]:
    """transformers and diffusers import their classes on first access: "transformers.Wav2Vec2Model" is the
    module "transformers" and its attribute; any other name is a module."""
    if name.startswith(("transformers.", "diffusers.")):
        module, _, attribute = name.rpartition(".")
        return module, attribute
    return name, ""


def _load(name: str, quiet: bool = False):
    try:
        module, attribute = _module_and_attribute(name)
        imported = importlib.import_module(module)
        if attribute:
            getattr(imported, attribute)
        return imported
    except Exception as e:  # an optional part missing here (the [test] extra, uvloop): nothing to compile
        if not quiet:
            print(f"bytecode: skipped {name}: {type(e).__name__}: {e}", file=sys.stderr)


def _import_all(names: list[str]) -> None:
    for name in names:
        # walk: a package and every module in it (avatar's own, the plugins pytest loads)
        package = _load(name.removeprefix("walk:"))
        if name.startswith("walk:") and package is not None:
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=lambda name: None):
                _load(info.name, quiet=True)


def main() -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    groups = [["walk:avatar_cli"], LAZY + TESTS]
    procs = [subprocess.Popen([sys.executable, "-m", "avatar_cli._bytecode", "--import", *group], env=env)
             for group in groups]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--import"]:  # one of main's processes
        _import_all(sys.argv[2:])
    else:
        sys.exit(main())
