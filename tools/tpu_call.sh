#!/usr/bin/env bash
# One device command on a TPU host without internet: installs flaxtpu's dependencies once per machine
# (tools/offline_install.sh, from the wheels tools/tpu_wheels.sh fetched), then runs tools/tpu_round.sh's
# PARTs within what is left of a command's limit, results in $OUT.
#
#   bash tools/tpu_call.sh PART [PART ...]     # e.g. modern; LIMIT (default 585 s) bounds the whole call
set -u
started=$SECONDS
wheels=${WHEELS:-.whl-tpu}
echo "[tpu_call] $(date +%T), $(nproc) cores"
if [ ! -d /tmp/site/flax ]; then
  timeout 240 bash -c "source tools/offline_install.sh '$wheels' file:///opt/pypi/simple /tmp/site" 2>&1 | tail -5
fi
# Appended: the host's own PYTHONPATH (where its jax may live) stays first.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:/tmp/site"
export OUT=${OUT:-$PWD/tpu_round}
python -c 'import jax, flax, grain, zstandard; print("[tpu_call] jax", jax.__version__, "and flaxtpu'"'"'s dependencies import")' 2>&1 | tail -1
echo "[tpu_call] ready after $((SECONDS - started)) s"
timeout $(( ${LIMIT:-585} - (SECONDS - started) )) tools/tpu_round.sh "$@"
echo "[tpu_call] done after $((SECONDS - started)) s"
ls -la "$OUT"
