#!/usr/bin/env bash
# The on-chip measurements of docs/performance.md, in parts that each fit a 10-minute command on a
# TPU v5e host (13 cores), each under its own time limit, printing as it goes; results go to OUT
# (default ./tpu_round), the JSON files merged across parts as the benchmarks merge them, and the
# parts' logs into OUT/logs.tar.gz at the end (a device call brings back at most 8 files).
#
#   tools/tpu_round.sh PART [PART ...]
#
# PARTs (measured minutes on a v5e host, where known):
#   input     the input pipeline alone vs tf.data (row c; ~2 min), then `host_probes batches` (~1 min)
#   e2e       ResNet-50 end to end from a JPEG folder vs tf.data + the Flax example (row b; ~5 min)
#   startup   cifar10.py's first step cold and warm, cifar10_fast.py's whole run (row e; needs CIFAR;
#             ~3 min)
#   decode    CIFAR-10 decoded into memory vs tf.data (row d; needs CIFAR; ~1 min)
#   imports   cifar10.py twice (cold, then warm) under `python -X importtime` and JAX_LOG_COMPILES: its
#             slowest programs to trace, lower and compile, and its slowest imports (needs CIFAR; ~1 min)
#   startup-profile   $IMPORTS_CONFIG (default cifar10_resnet.py) cold to its first step under cProfile: the
#             main thread's functions by cumulative time (~2 min)
#   overhead  ResNet-20 for $OVERHEAD_EPOCHS (12) epochs with the per-epoch evaluation and checkpoint each on and
#             off: the wall time of an epoch and the step's img/s in each (~3 min)
#   profile   benchmarks/device/step_profile.py: each chip case in $PROFILE_CASES (default resnet50) traced, its
#             ops ranked by device time with the FLOP/s and bytes/s they reach (~1.5 min a case);
#             $PROFILE_ARGS go to each (e.g. "--remat dots_with_no_batch_dims_saveable"), in `ab` too
#   ab        each case in $PROFILE_CASES profiled twice in a row: by the tree in $AB_BASE (an earlier commit's
#             flaxtpu, benchmarks and configs: `git archive REF flaxtpu benchmarks configs | tar x -C DIR`,
#             carried with the repo), then by this one: an optimisation measured alone (~3 min a case)
#   runtime   `host_probes runtime`: importing JAX and starting the TPU runtime, under settings that
#             might skip work, and one verbose start's log (runtime_verbose.log in the logs; ~2 min)
#   configs-a, configs-b   every config in configs/ with the data folder set (configs-a: the CIFAR-10
#             ones, mnist's on that folder, digits; configs-b: photos, imagenet_resnet50 and finetune on
#             the generated photos (imagenet_resnet50's with ImageNet's split names), finetune from
#             imagenet_resnet50's run: no hub here); cifar10, cifar10_fast and digits whole, the
#             others --config.num_train_steps=150 (needs CIFAR; configs-b ~7.5 min)
#   resnets, accumulate, modern, tuned   benchmarks/device/chip.py's groups with --compile-alone: flaxtpu's step
#             compiled before its peers, not beside them, so its cold compile is its own (6.5 and 7 min
#             measured; tuned, Swin-T beside Swin-T with model.remat_mlps=1, 4; accumulate, ResNet-50 at
#             batch 512 beside 512 an update in two batches of 256, ~4)
#   mobile-a, mobile-b       the `mobile` group's EfficientNet-B0 and MobileNetV3-L, one a part (the
#             group with --compile-alone, ~9.5 min, would not fit; 4 min measured for mobile-a)
#   remat-a, remat-b, remat-c        the remat table, two families each (~6 min each)
#   sweep     experiments/resnet20_lr_first_step.py (4 trials, the learning rate only differs) on a generated
#             CIFAR-sized folder (32x32 JPEGs, 10 classes x 5,000 + 1,000), from an empty compilation cache: each
#             trial's time to its first step and where its train step came from (issue 69)
#   he        He et al.'s CIFAR ResNets at full length (182 epochs) on CIFAR, resnet$DEPTHS (default 20), with
#             log_every_steps=7100 (a progress line every ~18 epochs), each stopped by SIGTERM at HE_LIMIT s
#             (default 480) and resumed by the same command in a later call: the workdirs travel in
#             OUT/he_workdirs.tar.gz (carry it back as HE_TAR); each run's epoch times (benchmarks/device/epoch_times)
#   he-keras  the same recipe in Keras 3 (JAX backend), benchmarks/peers/keras_cifar_resnet.py, depth $KERAS_DEPTH
#             (default 20), 182 epochs, on the same folder and chip (needs CIFAR); stopped by SIGTERM at KERAS_LIMIT
#             s (default 560) and resumed like `he` (its --state travels in the same tarball)
#   remat-auto  Swin-T's `--mode=plan --config.model.remat=auto` (configs/imagenet_resnet50.py on the
#             generated photos) at batch 256 and 512: the candidates each compiled, their plans and which
#             fitted, from plan.json (~4 min)
#
# A fresh device call also spends ~2 min starting the machine and installing (tools/offline_install.sh),
# out of the same device budget: a part must fit what is left after them.
#
# CIFAR: a CIFAR-10 JPEG folder (train/<class>/*.jpg, test/...) in $CIFAR, or a tar.gz of one in
# $CIFAR_TAR (unpacked into /tmp/data). Without internet, install first:
#   source tools/offline_install.sh WHEELS
set -u
out=${OUT:-$PWD/tpu_round}
logs=$(mktemp -d /tmp/tpu_round_logs.XXXXXX)
mkdir -p "$out" /tmp/bench
trap 'tar czf "$out/logs.tar.gz" -C "$logs" . 2>/dev/null' EXIT
trap 'exit 143' TERM INT
# The committed results: a part measures its rows again and keeps the others (same kind of device).
for name in tpu chip; do
  [ -f "$out/$name.json" ] || cp "benchmarks/results/$name.json" "$out/$name.json" 2>/dev/null || true
done
began=$SECONDS
say() { echo "[tpu_round $((SECONDS - began)) s] $*"; }

cifar() {
  if [ -z "${CIFAR:-}" ] && [ -n "${CIFAR_TAR:-}" ]; then  # unpacked once a machine (a warm one keeps it)
    local top; top=/tmp/data/$(tar tzf "$CIFAR_TAR" | head -1 | cut -d/ -f1)
    [ -d "$top/test" ] || { mkdir -p /tmp/data && tar xzf "$CIFAR_TAR" -C /tmp/data; } && CIFAR=$top
  fi
  [ -n "${CIFAR:-}" ] || { say "no CIFAR folder (set CIFAR or CIFAR_TAR)"; return 1; }
}

# NAME SECONDS COMMAND...: runs COMMAND under a limit, its output in OUT/NAME.log, the end of it shown.
part() {
  local name=$1 limit=$2; shift 2
  say "$name: $* (limit ${limit} s)"
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1
  say "$name: exit $?"
  grep -v '^WARNING\|^I0\|^W0\|Transparent hugepages\|warnings.warn' "$logs/$name.log" | tail -n 30
}

photos=/tmp/bench/photos_100x64_375-500  # what benchmarks/device/tpu.py generates for rows b and c
make_photos() {
  [ -d "$photos" ] || python -m benchmarks.data.make_image_folder --out "$photos" --classes 100 \
    --train-per-class 64 --test-per-class 2 --min-side 375 --max-side 500 > "$logs/photos.log" 2>&1
}

# The same photos under ImageNet's split names (its eval split is `validation`), linked so.
imagenet=/tmp/bench/photos_imagenet_layout
make_imagenet_photos() {
  make_photos
  mkdir -p "$imagenet" && ln -sfn "$photos/train" "$imagenet/train" && ln -sfn "$photos/test" "$imagenet/validation"
}

# The he parts' workdirs (flaxtpu's, and Keras's --state): unpacked from $HE_TAR once a machine, carried back in
# OUT/he_workdirs.tar.gz by each part.
he_workdirs() {
  mkdir -p /tmp/he
  if [ -n "${HE_TAR:-}" ] && [ -f "$HE_TAR" ] && [ ! -e /tmp/he/.unpacked ]; then
    tar xzf "$HE_TAR" -C /tmp/he && touch /tmp/he/.unpacked && say "he: resumed workdirs from $HE_TAR"
  fi
}

# NAME SECONDS ARGS...: one training run of configs/NAME.py (ARGS: its overrides), then what it
# reached and when its first step came.
config_run() {
  local name=$1 limit=$2; shift 2
  part "config_$name" "$limit" python -m flaxtpu.main --config="configs/$name.py" \
    --workdir="/tmp/bench/configs/$name" "$@"
  python - "$name" <<'PY'
import json, sys
name = sys.argv[1]
try:
  results = json.load(open(f'/tmp/bench/configs/{name}/results.json'))
except OSError as e:
  print(f'{name}: no results.json ({e.strerror})')
else:
  print(f"{name}: accuracy {results.get('eval_accuracy')}, step {results.get('step')}, first step after "
        f"{results.get('time_to_first_step_s')} s, {results.get('train_images_per_sec')} img/s")
PY
}

tpu=(python -m benchmarks.device.tpu --out "$out/tpu.json" --workdir /tmp/bench)
chip=(python -m benchmarks.device.chip --out "$out/chip.json")

for which in "$@"; do
  case $which in
    input)
      part input 240 "${tpu[@]}" --only input
      part batches 120 python -m benchmarks.input.host_probes batches --folder "$photos" --processes 13 ;;
    e2e) part e2e 560 "${tpu[@]}" --only e2e ;;
    profile)
      for case in ${PROFILE_CASES:-resnet50}; do
        part "profile_$case" 300 python -m benchmarks.device.step_profile --case "$case" --top 30 ${PROFILE_ARGS:-}
      done ;;
    ab)
      [ -d "${AB_BASE:-}/flaxtpu" ] || { say "ab: set AB_BASE to a copy of the earlier tree"; continue; }
      base_profile=benchmarks.device.step_profile  # a tree from before benchmarks/ had folders: benchmarks.step_profile
      [ -f "$AB_BASE/benchmarks/device/step_profile.py" ] || base_profile=benchmarks.step_profile
      for case in ${PROFILE_CASES:-resnet50}; do
        (cd "$AB_BASE" && part "ab_base_$case" 200 python -m "$base_profile" --case "$case" --top 15 \
          ${PROFILE_ARGS:-})
        part "ab_new_$case" 200 python -m benchmarks.device.step_profile --case "$case" --top 15 ${PROFILE_ARGS:-}
        say "ab $case: the earlier tree, then this one:"
        grep -h 'built in\|traced' "$logs/ab_base_$case.log" "$logs/ab_new_$case.log"
      done ;;
    startup) cifar && part startup 580 "${tpu[@]}" --cifar "$CIFAR" --only startup ;;
    decode) cifar && part decode 200 "${tpu[@]}" --cifar "$CIFAR" --only decode ;;
    imports)
      cifar || continue
      for run in cold warm; do
        JAX_LOG_COMPILES=1 part "imports_$run" 200 python -X importtime -m flaxtpu.main \
          --config="${IMPORTS_CONFIG:-configs/cifar10.py}" --config.dataset.folder="$CIFAR" --workdir="/tmp/bench/imports_$run" \
          --config.num_train_steps=20 --config.compilation_cache_dir=/tmp/bench/imports_cache
        say "imports_$run: its start-up lines, and each program that took over 0.2 s to trace, lower or compile:"
        grep -E 'trainer imported|compiled the train step|data read in|first step done' "$logs/imports_$run.log" \
          | sed 's/^.*\] //'
        grep -E '^[IW].*Finished .* in [0-9.]+ sec' "$logs/imports_$run.log" | sed 's/^.*Finished //' \
          | awk '$(NF-1) > 0.2'
      done
      say "slowest imports (cumulative us) of the warm run, then by their own time:"
      grep '^import time:' "$logs/imports_warm.log" | sort -t'|' -k2 -n -r | head -n 25
      grep '^import time:' "$logs/imports_warm.log" | sort -t'|' -k1.13 -n -r | head -n 15 ;;
    runtime) part runtime 200 python -m benchmarks.input.host_probes runtime --log "$logs/runtime_verbose.log" ;;
    configs-a)
      cifar || continue
      config_run cifar10 200 --config.dataset.folder="$CIFAR"
      config_run cifar10_fast 200 --config.dataset.folder="$CIFAR"
      config_run cifar10_resnet 200 --config.dataset.folder="$CIFAR" --config.num_train_steps=150
      config_run mnist 150 --config.dataset.folder="$CIFAR" --config.num_train_steps=150
      config_run digits 100 ;;
    configs-b)
      make_photos
      config_run photos 200 --config.dataset.folder="$photos" --config.num_train_steps=150
      make_imagenet_photos
      config_run imagenet_resnet50 280 --config.dataset.folder="$imagenet" --config.num_train_steps=150
      config_run finetune 200 --config.dataset.folder="$photos" --config.num_train_steps=150 \
        --config.init_from.checkpoint=/tmp/bench/configs/imagenet_resnet50 ;;
    resnets|accumulate|modern|tuned) part "chip_$which" 580 "${chip[@]}" --compile-alone --only "$which" ;;
    mobile-a) part chip_mobile_a 580 "${chip[@]}" --compile-alone --only efficientnet_b0 ;;
    mobile-b) part chip_mobile_b 580 "${chip[@]}" --compile-alone --only mobilenetv3_l ;;
    remat-auto)
      make_imagenet_photos
      for batch in 256 512; do
        part "remat_auto_$batch" 280 python -m flaxtpu.main --config=configs/imagenet_resnet50.py --mode=plan \
          --workdir="/tmp/bench/remat_auto_$batch" --config.dataset.folder="$imagenet" \
          --config.model.name=swin_t --config.model.remat=auto --config.batch_size="$batch"
        python - "/tmp/bench/remat_auto_$batch/plan.json" "$batch" <<'PY' || true
import json, sys
plan = json.load(open(sys.argv[1]))
print(f"batch {sys.argv[2]}: chose remat={plan['remat']} remat_mlps={plan.get('remat_mlps', 0)}")
for row in plan['remat_auto']:
  print('  ', row)
PY
      done ;;
    sweep)
      cifar_like=/tmp/bench/cifar_like
      [ -d "$cifar_like" ] || part cifar_like 120 python -m benchmarks.data.make_image_folder --out "$cifar_like" \
        --classes 10 --train-per-class 5000 --test-per-class 1000 --min-side 32 --max-side 32 --workers 13
      rm -rf /tmp/bench/sweep
      part sweep 480 python -m flaxtpu.sweep experiments/resnet20_lr_first_step.py --workdir=/tmp/bench/sweep/lr \
        --config.dataset.folder="$cifar_like" --config.compilation_cache_dir=/tmp/bench/sweep/cache
      grep -h 'compiled train step in\|first step done' "$logs/sweep.log" | sed 's/^.*\] //'
      python - /tmp/bench/sweep/lr <<'PY' || true
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], '*', 'results.json'))):
  results = json.load(open(path))
  print(f"{os.path.basename(os.path.dirname(path))}: first step {results.get('time_to_first_step_s'):.1f} s, "
        f"train step from {results.get('memory_plan', {}).get('compiled_from')}, "
        f"{results.get('train_images_per_sec'):.0f} img/s, eval accuracy {results.get('eval_accuracy'):.4f}")
PY
      cp -r /tmp/bench/sweep/lr/*/results.json "$logs/" 2>/dev/null || true ;;
    startup-profile)
      cifar || continue
      # One cold run of $IMPORTS_CONFIG (default cifar10_resnet.py) to its first step under cProfile, from an
      # empty compilation cache: the main thread's functions by cumulative time (tracing, compiling, init,
      # writers); each thread's own work is not in it.
      part startup_profile 240 python -m cProfile -o /tmp/bench/startup.prof -m flaxtpu.main \
        --config="${IMPORTS_CONFIG:-configs/cifar10_resnet.py}" --config.dataset.folder="$CIFAR" \
        --workdir=/tmp/bench/startup_profile --config.num_train_steps=1 \
        --config.compilation_cache_dir=/tmp/bench/startup_profile_cache
      grep -v '^import time' "$logs/startup_profile.log" | grep -E '^[IW][0-9]{4} ' | grep -v '^I.*| ' | cut -c6-300
      python - <<'PY'
import pstats
stats = pstats.Stats('/tmp/bench/startup.prof')
stats.sort_stats('cumulative').print_stats(r'flaxtpu|jax/_src/(pjit|interpreters/pxla|compiler|dispatch)|clu|orbax|tensorflow/__init__|flax/linen/module', 70)
PY
      ;;
    overhead)
      cifar || continue
      # What evaluating and checkpointing every epoch cost a long run: ResNet-20 for $OVERHEAD_EPOCHS epochs
      # with each on and off, a progress line an epoch (its img/s leaves the pauses out; the wall clock
      # between lines does not).
      for v in both eval save none; do
        case $v in
          both) a=() ;;
          eval) a=(--config.checkpoint_every_steps=1000000) ;;
          save) a=(--config.eval_every_steps=1000000) ;;
          none) a=(--config.eval_every_steps=1000000 --config.checkpoint_every_steps=1000000) ;;
        esac
        part "overhead_$v" 200 python -m flaxtpu.main --config=configs/cifar10_resnet.py \
          --workdir="/tmp/bench/overhead_$v" --config.dataset.folder="$CIFAR" \
          --config.num_epochs="${OVERHEAD_EPOCHS:-12}" --config.log_every_steps=390 ${a[@]+"${a[@]}"}
        python - "$logs/overhead_$v.log" "$v" <<'PY'
import re, statistics, sys, datetime
times, rates = [], []
for line in open(sys.argv[1], errors='replace'):
  m = re.match(r'^I\d{4} (\d{2}):(\d{2}):(\d{2}\.\d+) .*\] step (\d+)/\d+ .* (\d+) img/s .*\[(.*)\]', line)
  if m:
    h, mi, s, step, rate, split = m.groups()
    times.append(int(h) * 3600 + int(mi) * 60 + float(s)); rates.append((int(rate), split))
gaps = [b - a for a, b in zip(times, times[1:])]
print(f'{sys.argv[2]}: epochs (wall between progress lines) median {statistics.median(gaps[1:]):.3f} s over '
      f'{len(gaps) - 1}; step img/s median {statistics.median(r for r, _ in rates[1:]):.0f}; last split {rates[-1][1]}')
PY
      done ;;
    he)
      cifar || continue
      he_workdirs
      for depth in ${DEPTHS:-20}; do
        part "he_resnet$depth" "${HE_LIMIT:-480}" python -m flaxtpu.main --config=configs/cifar10_resnet.py \
          --workdir="/tmp/he/resnet$depth" --config.dataset.folder="$CIFAR" --config.model.name="resnet$depth" \
          --config.num_epochs=182 --config.log_every_steps=7100
        cat "$logs/he_resnet$depth.log" >> "/tmp/he/resnet$depth/log.txt"
        grep -h 'resum\|stopped by\|first step done\|step [0-9]*/' "$logs/he_resnet$depth.log" | cut -d']' -f2-
        python -m benchmarks.device.epoch_times "$logs/he_resnet$depth.log"
        cat "/tmp/he/resnet$depth/results.json" 2>/dev/null; echo
      done
      tar czf "$out/he_workdirs.tar.gz" -C /tmp/he . ;;
    he-keras)
      cifar || continue
      he_workdirs
      part "keras_resnet${KERAS_DEPTH:-20}" "${KERAS_LIMIT:-560}" python -m benchmarks.peers.keras_cifar_resnet --data "$CIFAR" \
        --depth "${KERAS_DEPTH:-20}" --epochs 182 --state "/tmp/he/keras_resnet${KERAS_DEPTH:-20}" \
        --out "$out/keras_resnet${KERAS_DEPTH:-20}.json"
      tar czf "$out/he_workdirs.tar.gz" -C /tmp/he . ;;
    remat-a) part remat_a 580 "${chip[@]}" --remat-table --only resnet50,mobilenetv3_l ;;
    remat-b) part remat_b 580 "${chip[@]}" --remat-table --only vit_b16,efficientnet_b0 ;;
    remat-c) part remat_c 580 "${chip[@]}" --remat-table --only convnext_t,swin_t ;;
    *) say "unknown part $which"; exit 2 ;;
  esac
done
