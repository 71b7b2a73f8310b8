#!/usr/bin/env bash
# Continue training the shipped target on an accelerator for a fixed time, then evaluate it;
# the export and the figures land in $OUT (the device tool's output folder).
#
#   bash train/accelerator.sh [MINUTES] [DATA]       defaults: 6, runs/data-s19
#
# Installs nothing: it needs the repository's runtime and training packages importable
# (jax, optax, orbax-checkpoint, flax, safetensors, tokenizers, tqdm). DATA is a
# `python -m train.data` shard folder; it is git-ignored, so carry it to the machine.
# The loss weighs rename replies as the shipped target's last stage did (REPLY_WEIGHT,
# RENAME_WEIGHT: 8 and 16; 1 and 1 for shards without train_marks.npy).
# A 20-step calibration run measures tokens/s first, so the real run's cosine schedule
# ends inside the budget; a timeout (SIGTERM makes the trainer save) guards the rest.
# Orbax state stays outside $OUT (it is 3x the model); $OUT gets the bf16 export
# (`tiny-code/`, the layout of checkpoints/tiny-code), `eval.json` and the logs.
# Two cores train ~940 tok/s; a few minutes of a GPU are hours here.
set -euo pipefail
MINUTES=${1:-6}
DATA=${2:-runs/data-s19}
OUT=${OUT:-runs/accelerator}
WORK=${WORK:-/tmp/specjax-accelerator}
BATCH=${BATCH:-32}
LR=${LR:-5e-4}
REPLY_WEIGHT=${REPLY_WEIGHT:-8}
RENAME_WEIGHT=${RENAME_WEIGHT:-16}
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/calibrate"
python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/devices.txt"

# common flags of both runs; the target's trained context is 1024
TRAIN=(python -m train.target --config tiny-code --init checkpoints/tiny-code --data "$DATA"
       --seq 1024 --batch "$BATCH" --lr "$LR" --reply-weight "$REPLY_WEIGHT" --rename-weight "$RENAME_WEIGHT")

"${TRAIN[@]}" --ckpt-dir "$WORK/calibrate" --steps 20 --warmup 5 --eval-every 10 --eval-batches 1 \
  --save-every-minutes 600 > "$OUT/calibrate.log" 2>&1
STEPS=$(python - "$WORK/calibrate/metrics.jsonl" "$MINUTES" "$BATCH" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
a, b = rows[-2], rows[-1]  # evaluations at steps 10 and 20: compile time excluded
rate = (b["tokens"] - a["tokens"]) / (b["time"] - a["time"])
steps = int(0.85 * float(sys.argv[2]) * 60 * rate / (int(sys.argv[3]) * 1024))  # 15 % for evaluations
print(max(steps, 20))
print(f"calibration: {rate:,.0f} tokens/s -> {steps} steps", file=sys.stderr)
EOF
)
echo "training $STEPS steps of $BATCH x 1024 tokens" | tee -a "$OUT/devices.txt"
timeout -s TERM $((MINUTES * 60 + 120)) \
  "${TRAIN[@]}" --ckpt-dir "$WORK/ckpt" --export "$OUT/tiny-code" --steps "$STEPS" --warmup $((STEPS / 25 + 1)) \
    --eval-every $((STEPS / 8 + 1)) --eval-batches 8 --save-every-minutes 2 > "$OUT/train.log" 2>&1 || true
cp "$WORK/ckpt/metrics.jsonl" "$OUT/metrics.jsonl"
python -m train.evaluate --model "$OUT/tiny-code" > "$OUT/eval.json" 2> "$OUT/eval.log"
cat "$OUT/eval.json"
