#!/usr/bin/env bash
# The 2-GPU measurements (device kind nvidia-h200-x2), one part per run (each part takes under 10 minutes;
# together they take longer). Run from the repo root on the GPU machine, after
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/src
# with .devdata/samsum_validation.json (a copy of ../shared/data) and .tok/smollm2 (the SmolLM2 tokenizer).
#
#   bash benchmarks/scaling_x2.sh recipe     # the tutorial's Trainer recipe, 8B-shape QLoRA, 1 and 2 GPUs (accelerate launch);
#                                            # about 200 s a count at RECIPE_STEPS=13 (load and quantize included) plus
#                                            # 25 s to write the preset once: RECIPE_COUNTS=2 runs one count alone
#   bash benchmarks/scaling_x2.sh qlora-8b   # ddptune scale on the same job, 1 and 2 GPUs, both modes (MODE=one of them;
#                                            # SCALE_ARGS=--alone adds one GPU alone at 2 GPUs' share, same-global)
#   bash benchmarks/scaling_x2.sh smollm2    # SmolLM2-135M LoRA (real weights at $SMOLLM2), global batch 16, 1 and 2 GPUs,
#                                            # with validation loss and ROUGE on SAMSum rows 700-817 at each count
#   bash benchmarks/scaling_x2.sh smollm2-shape  # the same SmolLM2 job with random weights (no GGUF file needed, no ROUGE):
#                                            # scale at 1 and 2 GPUs, then `train` at 1 GPU for the step time and losses,
#                                            # each with and without train.cuda_graphs (GRAPHS="true false"), about 300 s each;
#                                            # SMOL_TRAIN=0 leaves out the `train` runs; EXTRA=train.cuda_graph_scope=step
#                                            # records each whole step instead of each layer
#   bash benchmarks/scaling_x2.sh graphs-profile  # where the SmolLM2-shape step with CUDA graphs goes at 1 and 2 processes
#                                            # (the 2-GPU step is slower than the 1-GPU one): a profile of 4 steps each, and
#                                            # benchmarks/gpu_gaps.py on rank 0's trace; about 150 s
#   bash benchmarks/scaling_x2.sh full-1b    # Llama-3.2-1B shape, full fine-tuning: DDP and FSDP, 1 and 2 GPUs, with `plan`
#                                            # (STRATEGIES=fsdp for one of them)
#   bash benchmarks/scaling_x2.sh full-8b    # Llama-3.1-8B shape, full fine-tuning with AdamW: `plan` for 1 GPU
#                                            # and for FSDP over 2, then FSDP over 2 GPUs trains it (FULL8B_STEPS steps)
#   bash benchmarks/scaling_x2.sh full-8b-1gpu  # the same 8B full fine-tune on ONE GPU (it held 119.8 GiB on an H200)
#   bash benchmarks/scaling_x2.sh threads    # the OpenMP-threads lever: the 8B job same-per-device at OMP_NUM_THREADS
#                                            # of each value in THREADS (default "1 16"; 1 is ddptune's default on GPUs)
#   bash benchmarks/scaling_x2.sh binding    # the CPU-binding lever: the 8B job same-per-device without and with
#                                            # --numa-binding exclusive (torchrun's; needs numactl on the machine)
#   bash benchmarks/scaling_x2.sh stalls     # why a full fine-tune's steps stall: the 1B full run at 1 GPU with
#                                            # TORCH_LOGS=recompiles, its per-step times and the recompile log
#   bash benchmarks/scaling_x2.sh buckets    # DDP's gradient buckets: the 8B job at a global batch of 16 (EXTRA, default
#                                            # CUDA graphs and a dequantized base), `train` at 1 GPU, then at 2 GPUs with
#                                            # train.ddp_bucket_mb at each value of BUCKETS (default "null 256": torch's
#                                            # buckets, then one bucket after the backward); median step times; ~100 s a run
#   bash benchmarks/scaling_x2.sh graph-warmup  # (one GPU is enough) the CUDA-graph tests of tests/test_gpu.py, then the 8B job
#                                            # at 16 samples with 4 graph lengths at 1 GPU: every step over 3x the median
#                                            # after the first (none on 2026-11-30: each length is recorded before step 1)
#   bash benchmarks/scaling_x2.sh head-shapes  # (one GPU is enough; about 90 s a run) the 8B job at 8 samples a step, CUDA graphs,
#                                            # 1 GPU, alternating the code in $BEFORE (a copy of an older src/, e.g. main's before the
#                                            # targets were padded) and this one, twice: median step, and the GPU's idle inside the
#                                            # profiled steps (benchmarks/gpu_gaps.py), with who launched late. HEAD_JOB=smollm2: the
#                                            # SmolLM2-shape job of smollm2-shape at 8 samples instead (about 40 s a run). A run named
#                                            # *-eager sets CUDA_MODULE_LOADING=EAGER: every kernel loaded at start, none on first use
#                                            # (HEAD_RUNS, default "before after before after before-eager"; HEAD_GPU picks
#                                            # the GPU, default 0, so two lists can run side by side on a 2-GPU machine;
#                                            # HEAD_GRAPHS=false profiles the shipped default, compiled layers without graphs)
#   bash benchmarks/scaling_x2.sh cache      # the compiler's cache to $OUT/inductor.tgz (kept only if
#                                            # under 16 MiB). Compiling the layers takes 50-76 s of each run's first
#                                            # step on a fresh machine; copied into .inductor/, the next run on a fresh
#                                            # machine starts warm (every part unpacks .inductor/inductor.tgz first).
# Each part copies its raw results to $OUT; `python benchmarks/scaling_report.py DIR...` turns them into
# benchmarks/results/h200x2_*.json.
set -euo pipefail
export PYTHONUNBUFFERED=1 DDPTUNE_CACHE=${DDPTUNE_CACHE:-/root/ddpcache}
DATA=.devdata/samsum_validation.json
TOK=.tok/smollm2
STEPS=${STEPS:-20}
OUT=${OUT:-/tmp/out}
EXTRA=${EXTRA:-}   # more config overrides for the ddptune parts, e.g. EXTRA=train.cuda_graphs=true
SCALE_ARGS=${SCALE_ARGS:-}  # more `ddptune scale` options for qlora-8b and smollm2-shape, e.g. SCALE_ARGS=--alone
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
if [ -f .inductor/inductor.tgz ] && [ ! -d "$TORCHINDUCTOR_CACHE_DIR" ]; then
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && tar xzf .inductor/inductor.tgz -C "$TORCHINDUCTOR_CACHE_DIR"
fi
keep_runs() {  # DIR PREFIX: a scale run's tables, and every process count's per-step files as far as they got
  # in one PREFIX_runs.tgz (one archive per run instead of a file per count)
  for f in scaling.json scaling.md scaling.png; do [ -f "$1/$f" ] && cp "$1/$f" "$2.${f#*.}"; done
  (cd "$1" 2>/dev/null && find . -name ranks.jsonl -o -name metrics.jsonl | tar czf "$2_runs.tgz" -T -)
  return 0
}
quiet() { tr '\r' '\n' | grep -v -E '^(train|Loading weights|generate)' ; }
# the SmolLM2 job of the smollm2 part with random weights of the same shape (no GGUF file needed, no ROUGE)
smol_shape=(configs/demo.yaml model.source=preset:smollm2-135m model.tokenizer=$TOK data.train=$DATA data.train_rows=0:700
            data.val=null data.max_length=512 train.effective_batch_size=16 train.grad_accum=null train.lr=5e-4
            train.warmup_steps=5 eval.enabled=false $EXTRA)
case "$1" in
recipe)
  model=$(python3 -c "from ddptune import model; print(model.preset_folder('llama-3.1-8b', 0))")
  for n in ${RECIPE_COUNTS:-1 2}; do
    # one process sees one GPU: on a 2-GPU machine the Trainer would otherwise wrap the model in
    # DataParallel over both GPUs and double the batch
    launch=(env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) accelerate launch --num_processes "$n" --mixed_precision bf16)
    [ "$n" -gt 1 ] && launch+=(--multi_gpu)
    "${launch[@]}" benchmarks/reference_recipe.py --model-dir "$model" --tokenizer-dir $TOK --data $DATA --rows 700 \
      --method qlora --max-steps "${RECIPE_STEPS:-15}" --warmup-steps-excluded 5 --out "$OUT/recipe_n$n.json" 2>&1 | quiet | tail -4
  done
  ;;
qlora-8b)
  # a run cut by a time limit leaves no scaling.json, but every finished run's ranks.jsonl and
  # metrics.jsonl are kept in scale_8b_MODE_runs.tgz (scaling_report.py --ranks rebuilds the rows from them)
  mode=${MODE:-both}; dir=$(mktemp -u -d /tmp/scale-8b-$mode-XXXX)  # a fresh folder for each run of this part
  trap 'keep_runs "$dir" "$OUT/scale_8b_$mode"' EXIT
  trap 'exit 143' TERM  # timeout's SIGTERM: leave through the EXIT trap
  python3 -m ddptune scale configs/samsum_qlora_llama31_8b.yaml model.tokenizer=$TOK data.train=$DATA data.train_rows=0:700 data.val=null $EXTRA \
    --nproc 1,2 --mode "$mode" --steps "$STEPS" --warmup 3 $SCALE_ARGS --out "$dir" 2>&1 | quiet | grep -v '^ddptune:' | tail -30
  ;;
smollm2)
  python3 -m ddptune scale configs/demo.yaml model.source="$SMOLLM2" data.train=$DATA data.train_rows=0:700 \
    data.val=$DATA data.val_rows=700:818 data.max_length=512 train.effective_batch_size=16 train.grad_accum=null \
    train.lr=5e-4 train.warmup_steps=5 eval.enabled=true eval.zero_shot=false eval.max_samples=null \
    eval.max_new_tokens=64 eval.batch_size=32 $EXTRA --nproc 1,2 --mode same-global --steps "${SMOLLM2_STEPS:-84}" --warmup 4 \
    --out /tmp/scale-smollm2 2>&1 | quiet | grep -v '^ddptune:' | tail -30
  cp /tmp/scale-smollm2/scaling.json "$OUT/scale_smollm2.json"; cp /tmp/scale-smollm2/scaling.md "$OUT/scale_smollm2.md"
  cp /tmp/scale-smollm2/scaling.png "$OUT/scale_smollm2.png"
  ;;
smollm2-shape)
  for g in ${GRAPHS:-true false}; do
    dir=$(mktemp -u -d /tmp/scale-smol-graphs$g-XXXX)  # `scale` overwrites no earlier run's folder: a fresh one each time
    python3 -m ddptune scale "${smol_shape[@]}" train.cuda_graphs=$g --nproc 1,2 --mode same-global --steps 30 --warmup 4 \
      $SCALE_ARGS --out "$dir" 2>&1 | quiet | grep -E '^\| same|^ddptune: CUDA' | cut -c1-900
    keep_runs "$dir" "$OUT/scale_smollm2_shape_graphs$g"
    [ "${SMOL_TRAIN:-1}" = 1 ] || continue
    python3 -m ddptune train "${smol_shape[@]}" train.cuda_graphs=$g train.max_steps=34 train.save_every=0 --nproc 1 \
      output_dir=/tmp/train-smol-graphs$g 2>&1 | quiet | tail -2
    cp /tmp/train-smol-graphs$g/metrics.jsonl "$OUT/train_smollm2_shape_graphs${g}_n1.jsonl"
  done
  ;;
graphs-profile)
  for n in 1 2; do
    python3 -m ddptune train "${smol_shape[@]}" train.cuda_graphs=true train.max_steps=16 train.profile_steps=4 \
      train.save_every=0 --nproc $n output_dir=/tmp/prof-smol-n$n 2>&1 | quiet | tail -2
    python3 benchmarks/gpu_gaps.py /tmp/prof-smol-n$n/trace.json --json "$OUT/smollm2_shape_graphs_n${n}_gaps.json" | tail -8
    [ -f /tmp/prof-smol-n$n/profile.txt ] && cp /tmp/prof-smol-n$n/profile.txt "$OUT/smollm2_shape_graphs_n${n}_profile.txt"
  done
  ;;
full-1b)
  job=(configs/samsum_qlora_llama31_8b.yaml model.source=preset:llama-3.2-1b model.tokenizer=$TOK train.method=full
       data.train=$DATA data.train_rows=0:700 data.val=null $EXTRA)
  for s in ${STRATEGIES:-ddp fsdp}; do
    for n in 1 2; do
      python3 -m ddptune plan "${job[@]}" train.strategy=$s --gpus $n --json "$OUT/plan_1b_full_${s}_n$n.json" | tail -3
    done
    python3 -m ddptune scale "${job[@]}" train.strategy=$s --nproc 1,2 --mode same-per-device --steps "$STEPS" --warmup 3 \
      --out /tmp/scale-1b-$s 2>&1 | quiet | grep -v '^ddptune:' | tail -12
    for f in scaling.json scaling.md scaling.png; do cp /tmp/scale-1b-$s/$f "$OUT/scale_1b_full_$s.${f#*.}"; done
  done
  ;;
full-8b)
  job=(configs/samsum_qlora_llama31_8b.yaml model.tokenizer=$TOK train.method=full data.train=$DATA data.train_rows=0:700
       data.val=null $EXTRA)
  python3 -m ddptune plan "${job[@]}" --gpus 1 --json "$OUT/plan_8b_full_ddp_n1.json" | tail -3
  python3 -m ddptune plan "${job[@]}" train.strategy=fsdp --gpus 2 --json "$OUT/plan_8b_full_fsdp_n2.json" | tail -3
  python3 -m ddptune train "${job[@]}" train.strategy=fsdp train.max_steps="${FULL8B_STEPS:-24}" train.save_every=0 \
    output_dir=/tmp/full-8b --nproc 2 2>&1 | quiet | tail -8
  cp /tmp/full-8b/summary.json "$OUT/full_8b_fsdp_n2_summary.json"; cp /tmp/full-8b/metrics.jsonl "$OUT/full_8b_fsdp_n2_metrics.jsonl"
  ;;
full-8b-1gpu)
  CUDA_VISIBLE_DEVICES=0 python3 -m ddptune train configs/samsum_qlora_llama31_8b.yaml model.tokenizer=$TOK train.method=full \
    data.train=$DATA data.train_rows=0:700 data.val=null train.max_steps="${FULL8B_STEPS:-24}" train.save_every=0 \
    train.memory_check=false output_dir=/tmp/full-8b-1 2>&1 | quiet | tail -6 || true
  cp /tmp/full-8b-1/metrics.jsonl "$OUT/full_8b_1gpu_metrics.jsonl" 2>/dev/null || true
  ;;
threads)
  for t in ${THREADS:-1 16}; do
    OMP_NUM_THREADS=$t python3 -m ddptune scale configs/samsum_qlora_llama31_8b.yaml model.tokenizer=$TOK data.train=$DATA \
      data.train_rows=0:700 data.val=null $EXTRA --nproc 1,2 --mode same-per-device --steps "$STEPS" --warmup 3 \
      --out /tmp/scale-8b-t$t 2>&1 | quiet | grep '^| same' | cut -c1-260
    for f in scaling.json scaling.md; do cp /tmp/scale-8b-t$t/$f "$OUT/scale_8b_threads$t.${f#*.}"; done
  done
  ;;
binding)
  command -v numactl > /dev/null || { echo "numactl is not installed here: torchrun cannot bind"; exit 0; }
  for b in none exclusive; do
    bind=(); [ "$b" != none ] && bind=(--numa-binding "$b")
    python3 -m ddptune scale configs/samsum_qlora_llama31_8b.yaml model.tokenizer=$TOK data.train=$DATA data.train_rows=0:700 \
      data.val=null $EXTRA --nproc 1,2 --mode same-per-device --steps "$STEPS" --warmup 3 "${bind[@]}" --out /tmp/scale-8b-bind-$b \
      2>&1 | quiet | grep '^| same' | cut -c1-260 || true
    keep_runs /tmp/scale-8b-bind-$b "$OUT/scale_8b_binding_$b"
  done
  ;;
stalls)
  TORCH_LOGS=recompiles python3 -m ddptune train configs/samsum_qlora_llama31_8b.yaml model.source=preset:llama-3.2-1b \
    model.tokenizer=$TOK train.method=full data.train=$DATA data.train_rows=0:700 data.val=null train.max_steps="$STEPS" \
    output_dir=/tmp/stalls > "$OUT/stalls.log" 2>&1 || true
  grep -c Recompiling "$OUT/stalls.log" || true
  cp /tmp/stalls/metrics.jsonl "$OUT/stalls_metrics.jsonl"
  python3 -c "import json,sys; [print(r['step'], round(r['step_time_s'], 3)) for r in map(json.loads, open(sys.argv[1])) if r.get('step_time_s', 0) > 0.5]" "$OUT/stalls_metrics.jsonl"
  ;;
buckets)
  for run in n1:null ${BUCKETS:-null 256}; do
    n=2; mb=$run; [ "${run%%:*}" = n1 ] && { n=1; mb=null; }
    name=n${n}_bucket$mb
    python3 -m ddptune train configs/samsum_qlora_llama31_8b.yaml model.tokenizer=$TOK data.train=$DATA data.train_rows=0:700 \
      data.val=null train.effective_batch_size=16 train.grad_accum=null train.max_steps=24 train.save_every=0 \
      ${EXTRA:-train.cuda_graphs=true train.dequantize_base=true} train.ddp_bucket_mb=$mb output_dir=/tmp/buckets-$name \
      --nproc $n 2>&1 | quiet | tail -1
    cp /tmp/buckets-$name/metrics.jsonl "$OUT/buckets_$name.jsonl"
    python3 -c "import json,sys,statistics as s; d=json.load(open(sys.argv[2])); t=[r['step_time_s'] for r in map(json.loads, open(sys.argv[1])) if 'step_time_s' in r][4:]; print(sys.argv[3], 'median step', round(s.median(t), 4), 's over', len(t), 'steps; buckets', d['grad_buckets'])" \
      /tmp/buckets-$name/metrics.jsonl /tmp/buckets-$name/summary.json $name
  done
  ;;
graph-warmup)
  CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k graphs 2>&1 | tail -15
  CUDA_VISIBLE_DEVICES=0 python3 -m ddptune train configs/samsum_qlora_llama31_8b.yaml model.tokenizer=$TOK data.train=$DATA \
    data.train_rows=0:700 data.val=null train.effective_batch_size=16 train.grad_accum=null train.max_steps=24 \
    train.save_every=0 train.cuda_graphs=true train.dequantize_base=true train.cuda_graph_lengths=4 \
    output_dir=/tmp/graph-warmup --nproc 1 2>&1 | quiet | grep -E '^ddptune: (CUDA graphs|done)'
  cp /tmp/graph-warmup/metrics.jsonl "$OUT/graph_warmup_n1.jsonl"
  python3 -c "import json,sys,statistics as s; t=[r['step_time_s'] for r in map(json.loads, open(sys.argv[1])) if 'step_time_s' in r]; m=s.median(t); print('median', round(m, 4), 's; steps over 3x it after the first:', [(i + 1, round(x, 2)) for i, x in enumerate(t) if i and x > 3 * m])" /tmp/graph-warmup/metrics.jsonl
  ;;
head-shapes)
  [ -d "${BEFORE:-}" ] || { echo "head-shapes: set BEFORE to a folder holding the older src/ to compare with"; exit 2; }
  for v in ${HEAD_RUNS:-before after before after before-eager}; do
    src=$PWD/src; [ "${v%-eager}" = before ] && src=$BEFORE
    loading=LAZY; [ "${v%-eager}" != "$v" ] && loading=EAGER
    d=$(mktemp -u -d /tmp/head-$v-XXXX)
    job=(configs/samsum_qlora_llama31_8b.yaml model.tokenizer=$TOK data.train=$DATA data.train_rows=0:700 data.val=null
         train.dequantize_base=true)
    [ "${HEAD_JOB:-8b}" = smollm2 ] && job=("${smol_shape[@]}")
    CUDA_MODULE_LOADING=$loading PYTHONPATH=/tmp/site:$src CUDA_VISIBLE_DEVICES=${HEAD_GPU:-0} python3 -m ddptune train "${job[@]}" train.effective_batch_size=8 \
      train.grad_accum=null train.max_steps=30 train.save_every=0 train.cuda_graphs=${HEAD_GRAPHS:-true} \
      train.profile_steps=4 output_dir=$d --nproc 1 2>&1 | quiet | grep -E '^ddptune: (CUDA graphs|done)' | cut -c1-200
    python3 benchmarks/gpu_gaps.py $d/trace.json --json $d/gaps.json > /dev/null
    python3 -c "import json,sys,statistics as s; t=[r['step_time_s'] for r in map(json.loads, open(sys.argv[1])) if 'step_time_s' in r]; g=json.load(open(sys.argv[2])); print(sys.argv[3], 'median of steps 8-30', round(s.median(t[7:]) * 1000, 1), 'ms; idle inside profiled steps', [round(x['idle_inside_ms'], 1) for x in g['steps']], 'ms; late launches', [(x['launcher'][-40:], round(x['idle_ms'], 1)) for x in g['idle_by_launcher'][:3]])" \
      $d/metrics.jsonl $d/gaps.json $v | tee -a "$OUT/head_shapes.txt"
  done
  ;;
cache)
  tar czf "$OUT/inductor.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" .
  size=$(stat -c %s "$OUT/inductor.tgz")
  if [ "$size" -gt 16000000 ]; then rm "$OUT/inductor.tgz"; echo "compiler cache: $size bytes, over what \$OUT brings back"; fi
  ;;
*) echo "usage: $0 recipe|qlora-8b|smollm2|smollm2-shape|graphs-profile|full-1b|full-8b|full-8b-1gpu|threads|binding|stalls|buckets|graph-warmup|head-shapes|cache" >&2; exit 2 ;;
esac
