#!/usr/bin/env bash
# The 2-GPU measurements (device kind nvidia-h200-x2). Run from the repo root on the GPU machine:
#   bash benchmarks/scaling_x2.sh PART [PART ...]   # the parts in the order given, each in a shell of its own;
#                                                   # a failing part does not stop the next; the exit status is 1
#                                                   # if any failed
# after
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/src
# with .devdata/samsum_validation.json (a copy of ../shared/data) and .tok/smollm2 (the SmolLM2 tokenizer).
# Every part writes its raw files to $OUT as h200x2_<model>_<what>.<ext> (a device command brings back at most 8
# files) and ends with the seconds it took. A command cut by its time limit still leaves what its finished runs
# wrote: start it as `timeout -k 15 575 bash benchmarks/scaling_x2.sh ...`.
#
# The shipped configs as they are, with no speed overrides: these parts ignore EXTRA and unset DDPTUNE_SPEED, so
# the speed decider chooses (each run's summary.json, kept in the *_runs.tgz files, says what and why). A
# `ddptune scale` run is short (the 1-process run of both modes 66 steps, each 2-process run 33): the decider
# weighs set-up against those steps, and a run of the tutorial's length (921 steps; benchmarks/speed.py --epoch)
# may choose otherwise. Expected times, estimated from earlier runs of the same jobs (an 8B run costs 60-100 s
# beyond its steps, the first on a fresh machine 70-80 s more for the compiler; the recipe about 3.5 s a step):
#   defaults-8b       ddptune scale on the tutorial's job (configs/samsum_qlora_llama31_8b.yaml, SAMSum rows 0-699)
#                     at 1 and 2 GPUs, both modes (same-per-device: 16 samples a GPU; same-global: 16 in all),
#                     --steps 30 --warmup 3; REPEAT (default 1) names the repeat, for the spread between two:
#                     h200x2_llama31_8b_qlora_defaults_scale_r{1,2}.json and h200x2_llama31_8b_qlora_defaults_scale_r{1,2}_runs.tgz.
#                     About 6 min on a fresh machine, 4.5 min on a warm one.
#   recipe            the tutorial's Trainer recipe (benchmarks/reference_recipe.py: QLoRA, checkpointing, padding), 8B
#                     shape, at 1 and 2 GPUs in one command, RECIPE_STEPS=30 steps each of which the first 5 are left
#                     out (25 measured): h200x2_llama31_8b_qlora_recipe_n{1,2}.json. About 5.5 min.
#   defaults-smollm2  SmolLM2-135M-Instruct with its real weights (SMOLLM2=the .gguf file), LoRA, ddptune scale at 1 and
#                     2 GPUs at a global batch of 16 (84 steps, same-global), validation loss and ROUGE-1/2/L on SAMSum
#                     rows 700-817 at each count: h200x2_smollm2_135m_lora_defaults_scale.json and
#                     h200x2_smollm2_135m_lora_defaults_scale_runs.tgz. About 3 min.
#   fsdp-qlora-8b     8B QLoRA at a global batch of 16, FSDP_STEPS=30 steps: FSDP over 2 GPUs (train.strategy=fsdp),
#                     DDP over 2 GPUs and one process, with `ddptune plan` for each; benchmarks/train_runs.py puts the
#                     losses, step times and peak memory per GPU against the plan in h200x2_llama31_8b_qlora_fsdp_ddp_n1.json.
#                     FSDP first: a checkout whose config checks refuse FSDP-QLoRA stops the part before any run.
#                     About 5 min. One GPU is enough with FSDP_RUNS="fsdp:1 ddp:1 ddp:1:dequantize=false" (FSDP and DDP
#                     at one process, the last with the 4-bit base FSDP keeps) and FSDP_NAME for the file's name.
#   gpu-tests         pytest tests/test_gpu.py with both GPUs visible: h200x2_test_gpu.txt and h200x2_test_gpu.xml
#                     (JUnit). About 2 min.
# Together: one machine, four device commands back to back (each within the 30 s a machine stays warm), about
# 25-27 min of GPU-machine time with the machine's start; each command carries .whl and installs it where /tmp/site is gone:
#   1. defaults-8b (REPEAT=1), gpu-tests          about 8 min
#   2. recipe                                     about 5.5 min; also stashes SmolLM2's first half (.m1, from
#                                                 ../shared/device/smollm2_parts.sh) in /root/stash
#   3. defaults-smollm2, defaults-8b (REPEAT=2)   about 7 min; joins the halves (.m2) into $SMOLLM2 first
#   4. fsdp-qlora-8b                              about 5 min; needs nothing of the others, so it may start a fresh
#                                                 machine (1-2 min more) if the first has been held 30 min
# Then `python benchmarks/scaling_report.py --scale R1.json R2.json --runs R1_runs R2_runs --recipe-1 N1.json
# --recipe-2 N2.json ...` (its docstring) writes the tables' files.
#
# Other parts. EXTRA adds config overrides to them; DDPTUNE_SPEED forces the decider's choices for every run
# (src/ddptune/speed.py), e.g. DDPTUNE_SPEED=graphs=step,lengths=4,bucket_mb=256,dequantize=true,checkpointing=false:
#   qlora-8b        ddptune scale on the 8B job, 1 and 2 GPUs (MODE: both, same-per-device or same-global; STEPS,
#                   default 20; SCALE_ARGS: more `ddptune scale` options): h200x2_llama31_8b_qlora_scale_MODE.json
#   smollm2         the defaults-smollm2 job with EXTRA and DDPTUNE_SPEED applied: h200x2_smollm2_135m_lora_scale.json
#   smollm2-shape   the SmolLM2 job with random weights of its shape (no GGUF file, no ROUGE): scale at 1 and 2 GPUs,
#                   then `train` at 1 GPU for the step time and losses, once for each DDPTUNE_SPEED value in SPEEDS
#                   (default "- graphs=off": "-" leaves the decider free), about 300 s each; SMOL_TRAIN=0 leaves out
#                   the `train` runs: h200x2_smollm2_135m_shape_lora_scale_<speed>.json
#   graphs-profile  where the SmolLM2-shape step with CUDA graphs goes at 1 and 2 processes: a profile of 4 steps
#                   each, and benchmarks/gpu_gaps.py on rank 0's trace (benchmarks/timeline.py reads every rank's);
#                   about 150 s
#   full-1b         Llama-3.2-1B shape, full fine-tuning: DDP and FSDP, 1 and 2 GPUs, with `plan` (STRATEGIES=fsdp for
#                   one of them)
#   full-8b         Llama-3.1-8B shape, full fine-tuning with AdamW: `plan` for 1 GPU and for FSDP over 2, then FSDP
#                   over 2 GPUs trains it (FULL8B_STEPS steps)
#   full-8b-1gpu    the same 8B full fine-tune on ONE GPU (it held 119.8 GiB on an H200)
#   threads         the OpenMP-threads lever: the 8B job same-per-device at OMP_NUM_THREADS of each value in THREADS
#                   (default "1 16"; 1 is ddptune's default on GPUs)
#   stalls          why a full fine-tune's steps stall: the 1B full run at 1 GPU with TORCH_LOGS=recompiles, its per-step
#                   times and the recompile log
#   buckets         DDP's gradient buckets: the 8B job at a global batch of 16, `train` at 1 GPU, then at 2 GPUs with
#                   DDPTUNE_SPEED=bucket_mb=N for each N in BUCKETS (default "25 256": torch's bucket size, then one
#                   bucket after the backward; BUCKET_SPEED forces more, e.g. graphs=step); median step times; ~100 s a run
#   graph-warmup    (one GPU is enough) the CUDA-graph tests of tests/test_gpu.py, then the 8B job at 16 samples with
#                   GRAPH_SPEED (default graphs=step,lengths=4,dequantize=true) at 1 GPU: every step over 3x the median
#                   after the first (none on 2026-11-30: each length is recorded before step 1)
#   head-shapes     (one GPU is enough; about 90 s a run) the 8B job at 8 samples a step, 1 GPU, DDPTUNE_SPEED=HEAD_SPEED
#                   (default graphs=step,dequantize=true), alternating the code in $BEFORE (a copy of an older src/ that
#                   reads the same config keys and DDPTUNE_SPEED) and this one, twice: median step, and the GPU's idle
#                   inside the profiled steps (benchmarks/gpu_gaps.py), with who launched late. HEAD_JOB=smollm2: the
#                   SmolLM2-shape job at 8 samples instead (about 40 s a run). A run named *-eager sets
#                   CUDA_MODULE_LOADING=EAGER (HEAD_RUNS, default "before after before after before-eager"; HEAD_GPU
#                   picks the GPU, default 0, so two lists can run side by side on a 2-GPU machine)
#   cache           the compiler's cache to $OUT/inductor.tgz (kept only if under 16 MiB). Compiling the layers takes
#                   50-76 s of each run's first step on a fresh machine; copied into .inductor/, the next run on a fresh
#                   machine starts warm (every part unpacks .inductor/inductor.tgz first).
set -euo pipefail
export PYTHONUNBUFFERED=1 DDPTUNE_CACHE=${DDPTUNE_CACHE:-/root/ddpcache}
DATA=.devdata/samsum_validation.json
TOK=.tok/smollm2
OUT=${OUT:-/tmp/out}
EXTRA=${EXTRA:-}   # more config overrides for the parts that take them, e.g. EXTRA=train.cuda_graphs=false
SCALE_ARGS=${SCALE_ARGS:-}  # more `ddptune scale` options for qlora-8b and smollm2-shape, e.g. SCALE_ARGS="--bandwidth-sizes none"
QLORA_8B=(configs/samsum_qlora_llama31_8b.yaml "model.tokenizer=$TOK" "data.train=$DATA" data.train_rows=0:700 data.val=null)
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
if [ -f .inductor/inductor.tgz ] && [ ! -d "$TORCHINDUCTOR_CACHE_DIR" ]; then
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && tar xzf .inductor/inductor.tgz -C "$TORCHINDUCTOR_CACHE_DIR"
fi
keep_runs() {  # DIR NAME: a scale run's scaling.json as $OUT/NAME.json, and its table, manifest and every process
  # count's per-step files and summary as far as they got in $OUT/NAME_runs.tgz (one archive, not a file a count)
  [ -f "$1/scaling.json" ] && cp "$1/scaling.json" "$OUT/$2.json"
  (cd "$1" 2>/dev/null && find . -name ranks.jsonl -o -name metrics.jsonl -o -name summary.json -o -name 'scaling.md' \
     -o -name manifest.json | tar czf "$OUT/$2_runs.tgz" -T -)
  return 0
}
quiet() { tr '\r' '\n' | { grep -v -E '^(train|Loading weights|generate)' || true; }; }
only() { grep -E "$1" || true; }  # the lines that match, and no failure where none does
drop() { grep -v -E "$1" || true; }  # the lines that do not match, and no failure where all do
median_steps() {  # METRICS.jsonl NAME [SUMMARY.json]: the run's median step after its first 4, and its DDP buckets
  python3 -c "import json,sys,statistics as s; t=[r['step_time_s'] for r in map(json.loads, open(sys.argv[1])) if 'step_time_s' in r][4:]; d=json.load(open(sys.argv[3])) if len(sys.argv) > 3 else {}; print(sys.argv[2], 'median step', round(s.median(t), 4), 's over', len(t), 'steps; buckets', d.get('grad_buckets'), '; speed', {k: d.get('speed', {}).get(k) for k in ('graphs', 'lengths', 'dequantize', 'checkpointing', 'bucket_mb')})" "$@"
}
# the SmolLM2 job of the smollm2 parts with random weights of the same shape (no GGUF file needed, no ROUGE)
smol_shape=(configs/demo.yaml model.source=preset:smollm2-135m "model.tokenizer=$TOK" "data.train=$DATA" data.train_rows=0:700
            data.val=null data.max_length=512 train.effective_batch_size=16 train.grad_accum=null train.lr=5e-4
            train.warmup_steps=5 eval.enabled=false)

scale_8b() {  # NAME MODE STEPS [overrides and scale options...]: ddptune scale on the 8B job into $OUT/NAME*
  local name=$1 mode=$2 steps=$3 dir
  shift 3
  dir=$(mktemp -u -d "/tmp/scale-$name-XXXX")  # `scale` writes into no earlier run's folder: a fresh one each time
  # a run cut by a time limit leaves no scaling.json, but every finished run's ranks.jsonl and metrics.jsonl are kept
  # (scaling_report.py --ranks rebuilds the rows from them)
  # shellcheck disable=SC2064  # the trap keeps this run's folder and name (expanded now: they are local)
  trap "keep_runs '$dir' '$name'" EXIT
  trap 'exit 143' TERM  # timeout's SIGTERM: leave through the EXIT trap
  python3 -m ddptune scale "${QLORA_8B[@]}" "$@" --nproc 1,2 --mode "$mode" --steps "$steps" --warmup 3 --out "$dir" 2>&1 \
    | quiet | drop '^ddptune:' | tail -30
}

smollm2_scale() {  # NAME [overrides...]: SmolLM2's real weights, scale at 1 and 2 GPUs at a global batch of 16, with ROUGE
  local name=$1 dir
  shift
  [ -f "${SMOLLM2:-}" ] || { echo "set SMOLLM2 to SmolLM2-135M-Instruct's .gguf file (../shared/device/smollm2_parts.sh)"; return 2; }
  dir=$(mktemp -u -d "/tmp/scale-$name-XXXX")
  # shellcheck disable=SC2064
  trap "keep_runs '$dir' '$name'" EXIT
  trap 'exit 143' TERM
  python3 -m ddptune scale configs/demo.yaml model.source="$SMOLLM2" data.train=$DATA data.train_rows=0:700 \
    data.val=$DATA data.val_rows=700:818 data.max_length=512 train.effective_batch_size=16 train.grad_accum=null \
    train.lr=5e-4 train.warmup_steps=5 eval.enabled=true eval.zero_shot=false eval.max_samples=null \
    eval.max_new_tokens=64 eval.batch_size=32 "$@" --nproc 1,2 --mode same-global --steps "${SMOLLM2_STEPS:-84}" --warmup 4 \
    --out "$dir" 2>&1 | quiet | drop '^ddptune:' | tail -30
}

fsdp_qlora_8b() {  # FSDP against DDP, the same 16 samples a step, the same stream; FSDP_RUNS lists STRATEGY:PROCESSES[:SPEED]
  # (SPEED: a DDPTUNE_SPEED for that run), default "fsdp:2 ddp:2 ddp:1"; on one GPU FSDP_RUNS="fsdp:1 ddp:1 ddp:1:dequantize=false"
  local dir runs=() failed=0 first=1 s n speed name
  dir=$(mktemp -d /tmp/fsdp-qlora-XXXX)
  local job=("${QLORA_8B[@]}" train.effective_batch_size=16 train.grad_accum=null train.max_steps="${FSDP_STEPS:-30}"
             train.save_every=0)
  for run in ${FSDP_RUNS:-fsdp:2 ddp:2 ddp:1}; do
    IFS=: read -r s n speed <<< "$run"
    name=${s}_n$n${speed:+_${speed//[=,]/_}}
    if ! python3 -m ddptune plan "${job[@]}" train.strategy="$s" --gpus "$n" --json "$dir/plan_$name.json" | tail -1; then
      # FSDP first: a checkout whose config checks refuse FSDP-QLoRA stops the part before any run
      [ "$first" = 1 ] && { echo "fsdp-qlora-8b: this checkout does not run $run (ddptune's line says why)"; return 3; }
    fi
    first=0
    DDPTUNE_SPEED=$speed python3 -m ddptune train "${job[@]}" train.strategy="$s" output_dir="$dir/$name" --nproc "$n" 2>&1 \
      | quiet | tail -3 || failed=1  # the others still run; train_runs.py lists a run that did not finish
    runs+=("$name=$dir/$name:$dir/plan_$name.json")
  done
  python3 benchmarks/train_runs.py --warmup 5 --out "$OUT/${FSDP_NAME:-h200x2_llama31_8b_qlora_fsdp_ddp_n1}.json" "${runs[@]}"
  return $failed
}

run_part() {
  case "$1" in
  defaults-8b)
    unset DDPTUNE_SPEED
    scale_8b "h200x2_llama31_8b_qlora_defaults_scale_r${REPEAT:-1}" both 30
    ;;
  defaults-smollm2)
    unset DDPTUNE_SPEED
    smollm2_scale h200x2_smollm2_135m_lora_defaults_scale
    ;;
  fsdp-qlora-8b)
    unset DDPTUNE_SPEED
    fsdp_qlora_8b
    ;;
  gpu-tests)
    python3 -c "import torch; n = torch.cuda.device_count(); print(n, 'GPUs visible'); raise SystemExit(0 if n >= 2 else 'gpu-tests: fewer than 2 GPUs visible')"
    env -u CUDA_VISIBLE_DEVICES python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py \
      --junitxml "$OUT/h200x2_test_gpu.xml" 2>&1 | tee "$OUT/h200x2_test_gpu.txt" | tail -25
    ;;
  recipe)
    local model n
    model=$(python3 -c "from ddptune import model; print(model.preset_folder('llama-3.1-8b', 0))")
    for n in ${RECIPE_COUNTS:-1 2}; do
      # one process sees one GPU: on a 2-GPU machine the Trainer would otherwise wrap the model in
      # DataParallel over both GPUs and double the batch
      launch=(env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" accelerate launch --num_processes "$n" --mixed_precision bf16)
      [ "$n" -gt 1 ] && launch+=(--multi_gpu)
      "${launch[@]}" benchmarks/reference_recipe.py --model-dir "$model" --tokenizer-dir $TOK --data $DATA --rows 700 \
        --method qlora --max-steps "${RECIPE_STEPS:-30}" --warmup-steps-excluded 5 \
        --out "$OUT/h200x2_llama31_8b_qlora_recipe_n$n.json" 2>&1 | quiet | tail -4
    done
    ;;
  qlora-8b)
    # shellcheck disable=SC2086  # EXTRA and SCALE_ARGS are lists of words
    scale_8b "h200x2_llama31_8b_qlora_scale_${MODE:-both}" "${MODE:-both}" "${STEPS:-20}" $EXTRA $SCALE_ARGS
    ;;
  smollm2)
    # shellcheck disable=SC2086
    smollm2_scale h200x2_smollm2_135m_lora_scale $EXTRA
    ;;
  smollm2-shape)
    local speed label dir
    for speed in ${SPEEDS:-- graphs=off}; do
      label=defaults; [ "$speed" != - ] && label=$(echo "$speed" | tr '=,' '-_')
      local force=(); [ "$speed" != - ] && force=(env DDPTUNE_SPEED="$speed")
      dir=$(mktemp -u -d "/tmp/scale-smol-$label-XXXX")
      # shellcheck disable=SC2086
      "${force[@]}" python3 -m ddptune scale "${smol_shape[@]}" $EXTRA --nproc 1,2 --mode same-global --steps 30 --warmup 4 \
        $SCALE_ARGS --out "$dir" 2>&1 | quiet | only '^\| same|^ddptune: CUDA' | cut -c1-900
      keep_runs "$dir" "h200x2_smollm2_135m_shape_lora_scale_$label"
      [ "${SMOL_TRAIN:-1}" = 1 ] || continue
      # shellcheck disable=SC2086
      "${force[@]}" python3 -m ddptune train "${smol_shape[@]}" $EXTRA train.max_steps=34 train.save_every=0 --nproc 1 \
        output_dir="/tmp/train-smol-$label" 2>&1 | quiet | tail -2
      cp "/tmp/train-smol-$label/metrics.jsonl" "$OUT/h200x2_smollm2_135m_shape_lora_train_${label}_n1.jsonl"
    done
    ;;
  graphs-profile)
    local n
    for n in 1 2; do
      # shellcheck disable=SC2086
      python3 -m ddptune train "${smol_shape[@]}" $EXTRA train.cuda_graphs=true train.max_steps=16 train.profile_steps=4 \
        train.save_every=0 --nproc $n output_dir=/tmp/prof-smol-n$n 2>&1 | quiet | tail -2
      python3 benchmarks/gpu_gaps.py /tmp/prof-smol-n$n/trace.json --json "$OUT/h200x2_smollm2_135m_shape_lora_graphs_n${n}_gaps.json" | tail -8
      [ -f /tmp/prof-smol-n$n/profile.txt ] && cp /tmp/prof-smol-n$n/profile.txt "$OUT/h200x2_smollm2_135m_shape_lora_graphs_n${n}_profile.txt"
    done
    ;;
  full-1b)
    local s n
    local job=("${QLORA_8B[@]}" model.source=preset:llama-3.2-1b train.method=full)
    for s in ${STRATEGIES:-ddp fsdp}; do
      for n in 1 2; do
        # shellcheck disable=SC2086
        python3 -m ddptune plan "${job[@]}" $EXTRA train.strategy=$s --gpus $n --json "$OUT/h200x2_llama32_1b_full_plan_${s}_n$n.json" | tail -3
      done
      # shellcheck disable=SC2086
      python3 -m ddptune scale "${job[@]}" $EXTRA train.strategy=$s --nproc 1,2 --mode same-per-device --steps "${STEPS:-20}" \
        --warmup 3 --out /tmp/scale-1b-$s 2>&1 | quiet | drop '^ddptune:' | tail -12
      keep_runs "/tmp/scale-1b-$s" "h200x2_llama32_1b_full_${s}_scale"
    done
    ;;
  full-8b)
    local job=("${QLORA_8B[@]}" train.method=full)
    # shellcheck disable=SC2086
    python3 -m ddptune plan "${job[@]}" $EXTRA --gpus 1 --json "$OUT/h200x2_llama31_8b_full_plan_ddp_n1.json" | tail -3
    # shellcheck disable=SC2086
    python3 -m ddptune plan "${job[@]}" $EXTRA train.strategy=fsdp --gpus 2 --json "$OUT/h200x2_llama31_8b_full_plan_fsdp_n2.json" | tail -3
    # shellcheck disable=SC2086
    python3 -m ddptune train "${job[@]}" $EXTRA train.strategy=fsdp train.max_steps="${FULL8B_STEPS:-24}" train.save_every=0 \
      output_dir=/tmp/full-8b --nproc 2 2>&1 | quiet | tail -8
    cp /tmp/full-8b/summary.json "$OUT/h200x2_llama31_8b_full_fsdp_n2_summary.json"
    cp /tmp/full-8b/metrics.jsonl "$OUT/h200x2_llama31_8b_full_fsdp_n2_metrics.jsonl"
    ;;
  full-8b-1gpu)
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 python3 -m ddptune train "${QLORA_8B[@]}" $EXTRA train.method=full train.max_steps="${FULL8B_STEPS:-24}" \
      train.save_every=0 train.memory_check=false output_dir=/tmp/full-8b-1 2>&1 | quiet | tail -6 || true
    cp /tmp/full-8b-1/metrics.jsonl "$OUT/h200x2_llama31_8b_full_1gpu_metrics.jsonl" 2>/dev/null || true
    ;;
  threads)
    local t
    for t in ${THREADS:-1 16}; do
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=$t python3 -m ddptune scale "${QLORA_8B[@]}" $EXTRA --nproc 1,2 --mode same-per-device --steps "${STEPS:-20}" \
        --warmup 3 --out /tmp/scale-8b-t$t 2>&1 | quiet | only '^\| same' | cut -c1-260
      keep_runs "/tmp/scale-8b-t$t" "h200x2_llama31_8b_qlora_threads$t"
    done
    ;;
  stalls)
    TORCH_LOGS=recompiles python3 -m ddptune train "${QLORA_8B[@]}" model.source=preset:llama-3.2-1b train.method=full \
      train.max_steps="${STEPS:-20}" output_dir=/tmp/stalls > "$OUT/h200x2_llama32_1b_full_stalls.log" 2>&1 || true
    grep -c Recompiling "$OUT/h200x2_llama32_1b_full_stalls.log" || true
    cp /tmp/stalls/metrics.jsonl "$OUT/h200x2_llama32_1b_full_stalls_metrics.jsonl"
    python3 -c "import json,sys; [print(r['step'], round(r['step_time_s'], 3)) for r in map(json.loads, open(sys.argv[1])) if r.get('step_time_s', 0) > 0.5]" \
      "$OUT/h200x2_llama32_1b_full_stalls_metrics.jsonl"
    ;;
  buckets)
    local run n mb name speed
    for run in n1 ${BUCKETS:-25 256}; do
      n=2; mb=$run; speed=${BUCKET_SPEED:+$BUCKET_SPEED,}bucket_mb=$run
      [ "$run" = n1 ] && { n=1; mb=none; speed=${BUCKET_SPEED:-}; }
      name=n${n}_bucket$mb
      # shellcheck disable=SC2086
      DDPTUNE_SPEED=$speed python3 -m ddptune train "${QLORA_8B[@]}" train.effective_batch_size=16 train.grad_accum=null \
        train.max_steps=24 train.save_every=0 $EXTRA output_dir=/tmp/buckets-$name --nproc $n 2>&1 | quiet | tail -1
      cp "/tmp/buckets-$name/metrics.jsonl" "$OUT/h200x2_llama31_8b_qlora_buckets_$name.jsonl"
      median_steps "/tmp/buckets-$name/metrics.jsonl" "$name" "/tmp/buckets-$name/summary.json"
    done
    ;;
  graph-warmup)
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k graphs 2>&1 | tail -15
    CUDA_VISIBLE_DEVICES=0 DDPTUNE_SPEED=${GRAPH_SPEED:-graphs=step,lengths=4,dequantize=true} python3 -m ddptune train \
      "${QLORA_8B[@]}" train.effective_batch_size=16 train.grad_accum=null train.max_steps=24 train.save_every=0 \
      output_dir=/tmp/graph-warmup --nproc 1 2>&1 | quiet | only '^ddptune: (CUDA graphs|done)'
    cp /tmp/graph-warmup/metrics.jsonl "$OUT/h200x2_llama31_8b_qlora_graph_warmup_n1.jsonl"
    python3 -c "import json,sys,statistics as s; t=[r['step_time_s'] for r in map(json.loads, open(sys.argv[1])) if 'step_time_s' in r]; m=s.median(t); print('median', round(m, 4), 's; steps over 3x it after the first:', [(i + 1, round(x, 2)) for i, x in enumerate(t) if i and x > 3 * m])" /tmp/graph-warmup/metrics.jsonl
    ;;
  head-shapes)
    [ -d "${BEFORE:-}" ] || { echo "head-shapes: set BEFORE to a folder holding the older src/ to compare with"; return 2; }
    local v src loading d
    for v in ${HEAD_RUNS:-before after before after before-eager}; do
      src=$PWD/src; [ "${v%-eager}" = before ] && src=$BEFORE
      loading=LAZY; [ "${v%-eager}" != "$v" ] && loading=EAGER
      d=$(mktemp -u -d "/tmp/head-$v-XXXX")
      local job=("${QLORA_8B[@]}")
      [ "${HEAD_JOB:-8b}" = smollm2 ] && job=("${smol_shape[@]}")
      DDPTUNE_SPEED=${HEAD_SPEED:-graphs=step,dequantize=true} CUDA_MODULE_LOADING=$loading PYTHONPATH=/tmp/site:$src \
        CUDA_VISIBLE_DEVICES=${HEAD_GPU:-0} python3 -m ddptune train "${job[@]}" train.effective_batch_size=8 \
        train.grad_accum=null train.max_steps=30 train.save_every=0 train.profile_steps=4 output_dir="$d" --nproc 1 2>&1 \
        | quiet | only '^ddptune: (CUDA graphs|done)' | cut -c1-200
      python3 benchmarks/gpu_gaps.py "$d/trace.json" --json "$d/gaps.json" > /dev/null
      python3 -c "import json,sys,statistics as s; t=[r['step_time_s'] for r in map(json.loads, open(sys.argv[1])) if 'step_time_s' in r]; g=json.load(open(sys.argv[2])); print(sys.argv[3], 'median of steps 8-30', round(s.median(t[7:]) * 1000, 1), 'ms; idle inside profiled steps', [round(x['idle_inside_ms'], 1) for x in g['steps']], 'ms; late launches', [(x['launcher'][-40:], round(x['idle_ms'], 1)) for x in g['idle_by_launcher'][:3]])" \
        "$d/metrics.jsonl" "$d/gaps.json" "$v" | tee -a "$OUT/h200x2_head_shapes.txt"
    done
    ;;
  cache)
    local size
    tar czf "$OUT/inductor.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" .
    size=$(stat -c %s "$OUT/inductor.tgz")
    if [ "$size" -gt 16000000 ]; then rm "$OUT/inductor.tgz"; echo "compiler cache: $size bytes, over what \$OUT brings back"; fi
    ;;
  *)
    echo "usage: $0 PART [PART ...], each of: defaults-8b recipe defaults-smollm2 fsdp-qlora-8b gpu-tests qlora-8b smollm2" \
         "smollm2-shape graphs-profile full-1b full-8b full-8b-1gpu threads stalls buckets graph-warmup head-shapes cache" >&2
    return 2
    ;;
  esac
}

[ $# -gt 0 ] || { run_part usage; exit 2; }
failed=0
for part in "$@"; do
  start=$SECONDS
  set +e
  ( set -e; run_part "$part" )  # not in an || list: that would turn errexit off inside the part
  rc=$?
  set -e
  echo "scaling_x2.sh: part $part: exit $rc after $((SECONDS - start)) s"
  [ "$rc" = 0 ] || failed=1
done
exit $failed
