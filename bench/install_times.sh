#!/usr/bin/env bash
# What `make setup` costs with each way of byte-compiling the install: for each choice given (none, compileall,
# pip), a fresh clone of this repository and a fresh venv, the same steps as the Makefile's, seconds of wall time.
#
#     bash bench/install_times.sh none compileall pip
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
now() { date +%s.%N; }
for choice in "$@"; do
  d=$(mktemp -d)
  git clone -q "$repo" "$d" && cd "$d" || exit 1
  t0=$(now)
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  t1=$(now)
  flag=--no-compile
  [ "$choice" = pip ] && flag=
  .venv/bin/python -m pip install -q $flag "torch==2.14.1" "torchaudio==2.11.0"
  t2=$(now)
  .venv/bin/python -m pip install -q $flag -e ".[test,service]"
  t3=$(now)
  if [ "$choice" = compileall ]; then
    .venv/bin/python -m compileall -qq -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" avatar_cli
  fi
  t4=$(now)
  echo "$choice: venv+pip $(echo "$t1 - $t0" | bc) s, torch pair $(echo "$t2 - $t1" | bc) s," \
       "project $(echo "$t3 - $t2" | bc) s, compile $(echo "$t4 - $t3" | bc) s, total $(echo "$t4 - $t0" | bc) s" \
       "(load $(cut -d' ' -f1-3 /proc/loadavg))"
  cd / && rm -rf "$d"
done
