"""How long the quick paths take: the header checks of a model directory, without reading weights, on a sparse
copy of the real Wan2.2-S2V 14B release (real headers and shapes, data regions left as holes; the tests'
tests/test_wan_files.py builds it), and the synthetic speech that training and eval generate. The unit tests hold
what these paths do; how fast they are is measured here.

- `avatar models check DIR --json` in a fresh interpreter (starting Python and importing torch included);
- check_dir with the release's key lists given, and with the lists from our modules built on meta;
- read_pth_header on the 11.4 GB umT5 .pth (the mmap'd load reads the pickle and the zip directory only);
- synth_speech of 60 s.

    python bench/check_speed.py [--repeats 3] [--append]   # --append: a section in bench/results.md
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from avatar_cli.families.wan_s2v.files import check_dir  # noqa: E402
from avatar_cli.modules.tensor_files import read_pth_header  # noqa: E402
from avatar_cli.synth.speech import synth_speech  # noqa: E402
from bench.machine import describe  # noqa: E402
from tests.test_wan_files import as_expected, key_list, make_official_dir, write_sparse_pth  # noqa: E402


def seconds(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--append", action="store_true", help="append a section to bench/results.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        release = make_official_dir(Path(tmp) / "Wan2.2-S2V-14B", key_list("dit"))
        t5 = Path(tmp) / "t5.pth"
        write_sparse_pth(t5, key_list("t5"), torch.bfloat16)
        given = {name: as_expected(key_list(name)) for name in ("dit", "t5", "vae")}
        command = [sys.executable, "-m", "avatar_cli", "models", "check", str(release), "--json"]

        def cli() -> None:
            subprocess.run(command, check=True, capture_output=True, cwd=ROOT)

        rows = {
            "`avatar models check` on the sparse 14B release, fresh process": seconds(cli, args.repeats),
            "check_dir, key lists given": seconds(lambda: check_dir(release, expected=given), args.repeats),
            "check_dir, lists from our modules on meta": seconds(lambda: check_dir(release), args.repeats),
            "read_pth_header, the 11.4 GB umT5 .pth": seconds(lambda: read_pth_header(t5), args.repeats),
            "synth_speech, 60 s": seconds(lambda: synth_speech(5, 60.0), args.repeats),
        }
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## Header checks and synthetic speech, {when}", "",
             f"Machine: {describe()['cpu']}. Command: `python bench/check_speed.py --repeats {args.repeats}`; "
             "seconds, median and max of the runs (the first includes warm-up).", "",
             "| path | median s | max s |", "|---|---|---|"]
    lines += [f"| {name} | {statistics.median(v):.2f} | {max(v):.2f} |" for name, v in rows.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        results = ROOT / "bench" / "results.md"
        head, _, rest = results.read_text().partition("\n## ")
        results.write_text(head.rstrip("\n") + "\n\n" + text + ("\n## " + rest if rest else ""))


if __name__ == "__main__":
    main()
