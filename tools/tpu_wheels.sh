#!/usr/bin/env bash
# Downloads, on a machine with a package index, the wheels a TPU host without internet lacks (its own
# index has the rest, jax included: tools/offline_install.sh), for its Python 3.11 on x86-64 Linux:
#
#   tools/tpu_wheels.sh [FOLDER]        # default .whl-tpu (keep it out of git: .git/info/exclude)
#
# Then carry FOLDER to the host and install from it there: `source tools/offline_install.sh FOLDER`,
# which `bash tools/tpu_call.sh PART` does before a tools/tpu_round.sh part.
set -eu
folder=${1:-.whl-tpu}
mkdir -p "$folder"
# flaxtpu's dependencies missing from the host's index, and what they need that it lacks too
# (tensorflow-datasets', imagehash's, keras's for the chip benchmark's peers).
names=(clu grain simplejpeg array-record portpicker dm-tree cloudpickle more-itertools etils zstandard
       tensorflow-datasets tensorflow-metadata simple-parsing docstring-parser toml einops
       imagehash PyWavelets keras namex optree)
for name in "${names[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d "$folder" "$name"
done
du -sh "$folder"
