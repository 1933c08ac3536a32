#!/usr/bin/env bash
# Installs flaxtpu's dependencies on an accelerator host that has no internet but keeps its own
# JAX (a TPU VM image, say): the wheels in WHEELS (those its package index lacks), then the rest
# from that index, all into TARGET, which goes at the END of PYTHONPATH so the host's jax, jaxlib
# and libtpu stay first. With internet, `pip install -e '.[tpu]'` is all you need instead.
#
#   source tools/offline_install.sh WHEELS [INDEX_URL] [TARGET]
#   e.g. source tools/offline_install.sh .whl-tpu file:///opt/pypi/simple /tmp/site
set -u
wheels=${1:?usage: source tools/offline_install.sh WHEELS [INDEX_URL] [TARGET]}
index=${2:-file:///opt/pypi/simple}
target=${3:-/tmp/site}
started=$SECONDS
# The host's index has these (with their own dependencies); jax is left to the host.
from_index=(flax optax orbax-checkpoint tensorflow-cpu ml-collections absl-py
            tensorboard pillow opencv-python-headless matplotlib huggingface_hub safetensors pyarrow
            scipy importlib_resources psutil immutabledict)
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target "$target" "$wheels"/*.whl || return 1 2>/dev/null || exit 1
# Names the index lacks are said, not fatal: carry their wheels in WHEELS.
if [[ $index == file://* ]]; then
  present=()
  for name in "${from_index[@]}"; do
    folder=$(echo "$name" | tr 'A-Z_.' 'a-z--')
    if [ -d "${index#file://}/$folder" ]; then present+=("$name"); else echo "offline_install: $index lacks $name"; fi
  done
  from_index=("${present[@]}")
fi
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile \
  --no-cache-dir --index-url "$index" --find-links "$wheels" --target "$target" "${from_index[@]}" \
  2>&1 | grep -v '^\[notice\]' || true
# pip may have brought its own jax, numpy or scipy along: the host's, which its jaxlib was built
# against, must win.
for name in jax jaxlib libtpu numpy scipy ml_dtypes opt_einsum; do rm -rf "$target/$name" "$target/$name"-* "$target/$name".libs; done
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$target"
echo "offline_install: done in $((SECONDS - started)) s into $target"
