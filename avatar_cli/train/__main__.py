"""python -m avatar_cli.train --out DIR [--work DIR] [--size mini] [--budget-minutes 90] [--seed 0] [--restart]"""

import argparse

from avatar_cli.train import train


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m avatar_cli.train", description=__doc__)
    ap.add_argument("--out", required=True, help="model directory to write (config.json + safetensors)")
    ap.add_argument("--work", default=None, help="checkpoint and cache folder (default: <out>.work)")
    ap.add_argument("--size", default="mini")
    ap.add_argument("--budget-minutes", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart", action="store_true", help="ignore and clear an existing checkpoint")
    a = ap.parse_args()
    train(a.out, a.size, a.work, a.budget_minutes, a.seed, resume=not a.restart)


if __name__ == "__main__":
    main()
