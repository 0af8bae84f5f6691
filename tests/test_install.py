"""`make setup` installs with `pip install --no-compile`, then byte-compiles what avatar imports
(avatar_cli/_bytecode.py). Where PYTHONDONTWRITEBYTECODE is set, a module it missed is compiled from source in
every process that imports it: a render must find bytecode for everything it imports from site-packages."""

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from avatar_cli._bytecode import LAZY, TESTS, _module_and_attribute

# The render's own process, with an audit hook that lists each file compiled from source (builtins.compile
# raises "compile" with the file name; a module loaded from bytecode is not compiled).
RENDER = """
import sys
compiled = []
sys.addaudithook(lambda event, args: compiled.append(args[1]) if event == "compile" and args[1] else None)
sys.argv = ["avatar", *sys.argv[1:]]
from avatar_cli.cli import _app
code = _app()
site = {site!r}
print("COMPILED", sorted({{str(f) for f in compiled if str(f).startswith(site)}}), file=sys.stderr)
sys.exit(code)
"""


def test_a_render_compiles_nothing_from_site_packages(job_dir: Path):
    site = sysconfig.get_paths()["purelib"]
    result = subprocess.run([sys.executable, "-c", RENDER.format(site=site), "render", str(job_dir / "job.yaml"),
                             "--json"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 0, result.stderr
    line = [x for x in result.stderr.splitlines() if x.startswith("COMPILED ")][-1]
    assert line == "COMPILED []", f"imported without bytecode (add to avatar_cli/_bytecode.py): {line}"


def test_the_lists_name_modules_that_exist():
    """A name a library renamed would be skipped quietly at setup (optional parts may be missing there)."""
    for name in LAZY + TESTS:
        module, _ = _module_and_attribute(name.removeprefix("walk:"))
        assert importlib.util.find_spec(module) is not None, name
