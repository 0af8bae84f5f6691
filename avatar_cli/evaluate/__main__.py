"""python -m avatar_cli.evaluate [--model mini] [--long-minutes 10] [--quick]"""

import argparse
import json
import sys

from avatar_cli.evaluate import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m avatar_cli.evaluate", description=__doc__)
    ap.add_argument("--model", default="mini", help="shipped model name or model directory")
    ap.add_argument("--out-md", default="bench/results.md")
    ap.add_argument("--contact-sheet", default="bench/contact_sheet.png")
    ap.add_argument("--long-minutes", type=float, default=10.0)
    ap.add_argument("--identities", type=int, default=2)
    ap.add_argument("--clip-s", type=float, default=8.0)
    ap.add_argument("--quick", action="store_true", help="1 identity, 4 s clips, a 1-minute long render")
    a = ap.parse_args()
    if a.quick:
        a.identities, a.clip_s, a.long_minutes = 1, 4.0, min(a.long_minutes, 1.0)
    res = evaluate(a.model, a.out_md, a.contact_sheet, a.long_minutes, a.identities, a.clip_s,
                   command="python -m avatar_cli.evaluate " + " ".join(sys.argv[1:]))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
