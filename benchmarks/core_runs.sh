#!/usr/bin/env bash
# One-GPU training through the launcher, and evaluation; run on the GPU machine from the repo root:
#   bash benchmarks/core_runs.sh qlora-1b   # QLoRA, Llama-3.2-1B shape, gradient checkpointing, torchrun + NCCL (world size 1)
#   bash benchmarks/core_runs.sh smollm2    # LoRA on real SmolLM2-135M-Instruct weights (GGUF at $SMOLLM2),
#                                           # SAMSum validation rows 0-699, ROUGE on rows 700-817, zero-shot vs fine-tuned
#   NAME=smollm2_nographs DDPTUNE_SPEED=graphs=off bash benchmarks/core_runs.sh smollm2   # the same, CUDA graphs forced off
# Needs: .devdata/samsum_validation.json (copy of ../shared/data), .tok/smollm2 (tokenizer for the presets).
# Copies each run's raw files to $OUT/<name>/.
set -euo pipefail
export PYTHONUNBUFFERED=1 DDPTUNE_CACHE=${DDPTUNE_CACHE:-/tmp/ddptune-cache}
DATA=.devdata/samsum_validation.json
keep() {  # name run_dir
  mkdir -p "$OUT/$1"
  for f in summary.json metrics.jsonl eval/metrics.json eval-base/metrics.json eval/predictions.jsonl; do
    [ -f "$2/$f" ] && cp "$2/$f" "$OUT/$1/$(echo "$f" | tr / _)"
  done
  return 0
}
case "$1" in
qlora-1b)
  python3 -m ddptune train configs/samsum_qlora_llama31_8b.yaml model.source=preset:llama-3.2-1b \
    model.tokenizer=.tok/smollm2 data.train=$DATA data.val=$DATA train.max_steps=40 train.val_every=20 \
    train.gradient_checkpointing=true train.save_every=20 output_dir=/tmp/runs/qlora_1b --nproc 1 \
    2>&1 | tr '\r' '\n' | grep -v '^train:' | tee "$OUT/qlora_1b.log"
  keep qlora_1b /tmp/runs/qlora_1b
  ;;
smollm2)
  python3 -m ddptune train configs/demo.yaml model.source="$SMOLLM2" data.train=$DATA data.train_rows=0:700 \
    data.val=$DATA data.val_rows=700:818 data.max_length=512 train.max_steps=null train.epochs=2 \
    train.micro_batch_size=8 train.effective_batch_size=16 train.lr=5e-4 train.warmup_steps=5 train.val_every=22 \
    train.packing=true eval.max_samples=null eval.max_new_tokens=64 eval.batch_size=32 \
    output_dir="/tmp/runs/${NAME:-smollm2}" --nproc 1 2>&1 | tr '\r' '\n' | grep -v '^train:' | tee "$OUT/${NAME:-smollm2}.log"
  keep "${NAME:-smollm2}" "/tmp/runs/${NAME:-smollm2}"
  ;;
*) echo "usage: $0 qlora-1b|smollm2" >&2; exit 2 ;;
esac
