#!/usr/bin/env bash
# How the shipped SmolLM2-135M EAGLE-3 head (eyas/assets/heads/smollm2-135m) was trained, step by
# step, on the 2-core CPU (docs/training.md, "The shipped head", has the sizes and timings).
# Every step is resumable: run the script again after an interruption.
#
#   bash scripts/train-smollm2-head.sh [RUN_DIR]       # default runs/head
#
# Steps 1-6 made the first head (704 answers); steps 7-10 trained it further on the answers
# written when the same regeneration was resumed later (--init-from); steps 11-15 trained it
# further again on answers to the prompts after the first 2,400; steps 16-20 (TTT depth 3) on
# answers of the served int4 target to prompts after the first 5,000 (not shipped); steps 21-22
# trained the shipped head further on 5,804 answers with TTT depth 3; steps 23-24 trained that
# head on one GPU, ten more epochs of the same answers, then 3.4 epochs of those and 3,072 more
# (the head shipped now).
# MT-Bench is the evaluation set: it is never read here.
#
# TTT depth: 3 is the recipe's default (at the same CPU budget it beat 5 and 7 at every draft
# step, docs/training.md section 11); stages 1-3 of the shipped head used TTT_STEPS=5.
set -euo pipefail
RUN=${1:-runs/head}
TTT_STEPS=${TTT_STEPS:-3}
EYAS=${EYAS:-.venv/bin/eyas}
mkdir -p "$RUN"

# Answers written by SmolLM2 itself (greedy, at most 256 tokens) to the prompts on stdin: two
# processes of one thread each on alternate prompts (float32: the fastest batched decoding on
# a CPU), joined in DIR/regenerated.jsonl.     regenerate_halves DIR FIRST SECOND BATCH_SIZE
regenerate_halves() {
    local dir=$1 first=$2 second=$3 batch=$4 part
    awk -v odd="$dir/part$first.jsonl" -v even="$dir/part$second.jsonl" \
        'NR % 2 == 1 { print > odd } NR % 2 == 0 { print > even }'
    for part in "$first" "$second"; do
        OMP_NUM_THREADS=1 "$EYAS" data regenerate --input "$dir/part$part.jsonl" \
            --output "$dir/regen$part.jsonl" --model smollm2-135m --dtype float32 \
            --batch-size "$batch" --max-tokens 256 --no-progress &
    done
    wait
    cat "$dir/regen$first.jsonl" "$dir/regen$second.jsonl" > "$dir/regenerated.jsonl"
}

# SmolLM2's chat template (the loss mask keeps the answers only), then the hidden-state features
# (taps of layers 2, 15, 27 and the last hidden state) on two ranks.
#                                              render_and_extract CONVERSATIONS TOKENIZED FEATURES
render_and_extract() {
    "$EYAS" data render --model smollm2-135m --input "$1" --output "$2" --max-length 1024
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 -m eyas.cli.features \
        --model smollm2-135m --data "$2" --out "$3" --max-length 1024 --samples-per-shard 64
}

# The head in HEAD_DIR becomes the shipped one, in bfloat16 (half the size; the engine computes
# in float32).                                 ship HEAD_DIR
ship() {
    .venv/bin/python - "$1" <<'PY'
import sys, torch
from eyas.eagle3.checkpoint import load_head, save_head
head = load_head(sys.argv[1])
head.config.target_model = "smollm2-135m"  # the alias, not the path the run loaded
save_head(head, "eyas/assets/heads/smollm2-135m", dtype=torch.bfloat16)
PY
}

# The head in HEAD_DIR beside the shipped one: teacher-forced on the fixed held-out split, then
# alone on MT-Bench, into STAGE_DIR/diagnose-{shipped,new} and STAGE_DIR/eval-{shipped,new}.
#                                              compare_with_shipped STAGE_DIR HEAD_DIR
compare_with_shipped() {
    local pair name head
    for pair in shipped=smollm2-135m new="$2"; do
        name=${pair%%=*} head=${pair#*=}
        OMP_NUM_THREADS=1 "$EYAS" eval diagnose --head "$head" --held-out-prompts 48 --train-prompts 0 \
            --skip-counts 1 --vocab-sizes 8192 --mtbench-prompts 0 --output-dir "$1/diagnose-$name"
        "$EYAS" eval --draft "eagle3:$head" --num-prompts 40 --max-tokens 128 --output-dir "$1/eval-$name"
    done
}

# A time-budgeted online run on $DEVICE (steps 23-26: micro batches of 16, 1,024 tokens, the
# draft vocabulary of 8,192, a 2% held-out split), resumable.
#                     train_on_gpu DATA OUT INIT_HEAD LR EPOCHS MAX_TIME EVAL_SAMPLES SAVE_EVERY
train_on_gpu() {
    "$EYAS" train --model smollm2-135m --data "$1" --out "$2" --device "$DEVICE" --init-from "$3" \
        --ttt-steps "$TTT_STEPS" --draft-vocab-size 8192 --micro-batch-size 16 --max-length 1024 \
        --lr "$4" --epochs "$5" --max-time "$6" --eval-fraction 0.02 --eval-max-samples "$7" \
        --save-every "$8" --resume
}

# 1. ShareGPT user prompts (first turn), PII/DLP filtered, 1,500 characters at most.
"$EYAS" data prepare --source sharegpt --output-dir "$RUN/prepared" --keep user --max-turns 1 \
    --min-chars 16 --max-chars 1500 --workers 1

# 2. Answers to the first 2,400 prompts, batches of 32. The shipped head used the first 704
#    answers (the run was stopped after 33 minutes).
head -2400 "$RUN/prepared/train.jsonl" | regenerate_halves "$RUN" A B 32

# 3-4. Template and features.
render_and_extract "$RUN/regenerated.jsonl" "$RUN/train.tokenized.jsonl" "$RUN/features"

# 5. The head: training-time test with $TTT_STEPS steps, an 8,192-token draft vocabulary.
"$EYAS" train --model smollm2-135m --features "$RUN/features" --out "$RUN/train" \
    --draft-vocab-size 8192 --ttt-steps "$TTT_STEPS" --epochs 3 --lr 5e-4 --save-every 200 \
    --eval-fraction 0.03 --resume

# 6. Evaluate on MT-Bench (tau, acceptance by position, speedup per category).
"$EYAS" eval --draft "eagle3:$RUN/train/head" --dataset mtbench --output-dir "$RUN/eval"

# 7. The same two regenerations, resumed for about 35 more minutes; the answers that were not
#    in the first 704 are the second training set.
.venv/bin/python - "$RUN" <<'PY'
import json, sys
run = sys.argv[1]
seen = {json.loads(line)["id"] for line in open(f"{run}/regenerated.jsonl")}
with open(f"{run}/regenerated2.jsonl", "w") as out:
    for part in "AB":
        for line in open(f"{run}/regen{part}.jsonl"):
            if json.loads(line)["id"] not in seen:
                out.write(line)
PY
render_and_extract "$RUN/regenerated2.jsonl" "$RUN/train2.tokenized.jsonl" "$RUN/features2"

# 8. The first head, trained further on the new answers only (its held-out split is new to it).
"$EYAS" train --model smollm2-135m --features "$RUN/features2" --out "$RUN/train2" \
    --init-from "$RUN/train/head" --ttt-steps "$TTT_STEPS" --epochs 1.5 --lr 3e-4 --save-every 200 \
    --eval-fraction 0.05 --resume

# 9. Evaluate it as in step 6.
"$EYAS" eval --draft "eagle3:$RUN/train2/head" --dataset mtbench --num-prompts 40 --output-dir "$RUN/eval2"

# 10. Ship it.
ship "$RUN/train2/head"

# 11. Answers to the prompts after the first 2,400 (the regeneration now batches prompts of
#     similar length: about 3x the tokens/s of step 2), two 1-thread processes, stopped after
#     about 40 minutes.
mkdir -p "$RUN/stage3"
tail -n +2401 "$RUN/prepared/train.jsonl" | regenerate_halves "$RUN/stage3" C D 64

# 12. Template and features as in steps 3-4.
render_and_extract "$RUN/stage3/regenerated.jsonl" "$RUN/stage3/train.tokenized.jsonl" \
    "$RUN/stage3/features"

# 13. The second-stage head, trained further on these answers only.
"$EYAS" train --model smollm2-135m --features "$RUN/stage3/features" --out "$RUN/stage3/train" \
    --init-from "$RUN/train2/head" --ttt-steps "$TTT_STEPS" --epochs 1 --lr 3e-4 --save-every 200 \
    --eval-fraction 0.03 --resume

# 14. Evaluate it as in step 9.
"$EYAS" eval --draft "eagle3:$RUN/stage3/train/head" --dataset mtbench --num-prompts 40 \
    --output-dir "$RUN/stage3/eval"

# 15. Ship it as in step 10 (only if step 14 beat the head shipped before).
ship "$RUN/stage3/train/head"

# 16. A fourth stage with the recipe's TTT depth of 3: answers to prompts after the first 5,000
#     (none of the earlier stages' prompts), written by the served int4 target through the
#     serving engine's continuous batching (64 conversations in flight), stopped after ~33
#     minutes on the shared machine.
mkdir -p "$RUN/stage4"
tail -n +5001 "$RUN/prepared/train.jsonl" > "$RUN/stage4/prompts.jsonl"
"$EYAS" data regenerate --input "$RUN/stage4/prompts.jsonl" --output "$RUN/stage4/regenerated.jsonl" \
    --model smollm2-135m --dtype int4 --concurrency 64 --max-tokens 256 --limit 3000

# 17. Template and features as in steps 3-4.
render_and_extract "$RUN/stage4/regenerated.jsonl" "$RUN/stage4/train.tokenized.jsonl" \
    "$RUN/stage4/features"

# 18. The shipped head, trained further on these answers with TTT depth 3.
"$EYAS" train --model smollm2-135m --features "$RUN/stage4/features" --out "$RUN/stage4/train" \
    --init-from eyas/assets/heads/smollm2-135m --ttt-steps "$TTT_STEPS" --epochs 1.5 --lr 3e-4 \
    --save-every 200 --eval-fraction 0.05 --resume

# 19. Evaluate it beside the shipped head: teacher-forced on the fixed held-out split, then on
#     MT-Bench as in step 14.
for pair in shipped=smollm2-135m new="$RUN/stage4/train/head"; do
    name=${pair%%=*} head=${pair#*=}
    OMP_NUM_THREADS=1 "$EYAS" eval diagnose --head "$head" --held-out-prompts 48 --train-prompts 0 \
        --skip-counts 1 --vocab-sizes 8192 --mtbench-prompts 0 --output-dir "$RUN/stage4/diagnose-$name"
    "$EYAS" eval --draft "eagle3:$head+ngram" --num-prompts 40 --output-dir "$RUN/stage4/eval-$name"
done

# 20. Ship it as in step 10 (only if step 19 beat the head shipped before).
ship "$RUN/stage4/train/head"

# 21. A fifth stage, the shipped head since 2026-11-27: 5,804 answers of the target to prompts
#     of step 1 (3,190 written on a GPU: 3,072 by the float32 target through transformers'
#     generate, 118 by `eyas data regenerate --device cuda`; 2,614 by the int4 target on this
#     CPU, `eyas data regenerate --dtype int4 --concurrency 64`), joined in
#     $RUN/stage5/regenerated.jsonl; the features taken through the served int4 target's fused
#     layers (the values the head reads when it drafts); two epochs with TTT depth 3 from the
#     head shipped before, bf16 autocast on a CPU with AMX (`--precision auto`).
mkdir -p "$RUN/stage5"
"$EYAS" data render --model smollm2-135m --input "$RUN/stage5/regenerated.jsonl" \
    --output "$RUN/stage5/train.tokenized.jsonl" --max-length 1024
"$EYAS" features --model smollm2-135m --data "$RUN/stage5/train.tokenized.jsonl" \
    --out "$RUN/stage5/features" --max-length 1024 --target-dtype int4 --samples-per-shard 128
"$EYAS" train --model smollm2-135m --features "$RUN/stage5/features" --out "$RUN/stage5/train" \
    --init-from eyas/assets/heads/smollm2-135m --ttt-steps "$TTT_STEPS" --epochs 1 --lr 3e-4 \
    --save-every 500 --eval-fraction 0.02 --resume
# A second epoch, from the first's head, in another order (--seed 1).
"$EYAS" train --model smollm2-135m --features "$RUN/stage5/features" --out "$RUN/stage5/train2" \
    --init-from "$RUN/stage5/train/head" --ttt-steps "$TTT_STEPS" --epochs 1 --lr 2e-4 --seed 1 \
    --save-every 1000 --eval-fraction 0.02 --resume

# 22. Evaluate it beside the shipped head as in step 19 (and alone on MT-Bench), then ship it.
compare_with_shipped "$RUN/stage5" "$RUN/stage5/train2/head"
ship "$RUN/stage5/train2/head"

# 23. A sixth stage (with 23b, shipped on the evening of 2026-11-27): the fifth stage's 5,804
#     conversations again, online on one GPU (the float32 target there, TF32 matmuls), from the
#     fifth-stage head under a time budget of 444 s: ten epochs at ~37,000 training tokens/s
#     beside a second run on the same H200 (~70,000 alone). DEVICE=cpu runs it too (its
#     budget then buys about a sixth of an epoch online: raise --max-time).
DEVICE=${DEVICE:-cuda}
train_on_gpu "$RUN/stage5/train.tokenized.jsonl" "$RUN/stage6/train" "$RUN/stage5/train2/head" \
    3e-4 40 444 200 200

# 23b. The same GPU, 120 s more: from that head, at a third of the rate, on those answers
#     and 3,072 more to prompts of step 1 (written on the GPU by the float32 target through
#     transformers' generate, 768 prompts a batch, joined to the fifth stage's in
#     $RUN/stage6/regenerated.jsonl): 3.4 epochs of 8,773 conversations at ~72,000 tokens/s.
"$EYAS" data render --model smollm2-135m --input "$RUN/stage6/regenerated.jsonl" \
    --output "$RUN/stage6/train.tokenized.jsonl" --max-length 1024
train_on_gpu "$RUN/stage6/train.tokenized.jsonl" "$RUN/stage6/train2" "$RUN/stage6/train/head" \
    1e-4 40 120 100 100000

# 24. Evaluate it beside the shipped head as in step 22, then ship it.
compare_with_shipped "$RUN/stage6" "$RUN/stage6/train2/head"
ship "$RUN/stage6/train2/head"

# 25. A seventh stage (the shipped head since late 2026-11-27), on the same GPU: answers to the
#     prepared prompts that have none yet (the shipped run: 4,592 of its prepared set, written
#     with transformers' generate on the GPU, 1,536 prompts a batch, 938k answer tokens in 263 s,
#     while step 26's first run trained beside it; `--endpoint` against a vLLM or SGLang server
#     is the way at scale).
mkdir -p "$RUN/stage7"
.venv/bin/python - "$RUN" <<'PY'
import json, sys
run = sys.argv[1]
seen = {json.loads(line)["id"] for line in open(f"{run}/stage6/regenerated.jsonl")}
with open(f"{run}/stage7/todo.jsonl", "w") as out:
    for line in open(f"{run}/prepared/train.jsonl"):
        if json.loads(line)["id"] not in seen:
            out.write(line)
PY
"$EYAS" data regenerate --model smollm2-135m --device "$DEVICE" --dtype float32 --concurrency 256 \
    --max-tokens 256 --input "$RUN/stage7/todo.jsonl" --output "$RUN/stage7/regenerated.jsonl"
"$EYAS" data render --model smollm2-135m --input "$RUN/stage7/regenerated.jsonl" \
    --output "$RUN/stage7/new.tokenized.jsonl" --max-length 1024
cat "$RUN/stage6/train.tokenized.jsonl" "$RUN/stage7/new.tokenized.jsonl" > "$RUN/stage7/train.tokenized.jsonl"

# 26. Three runs under time budgets: D1, the sixth-stage head on the 8,773 older conversations
#     (195 s, beside step 25's generation: ~29,500 tokens/s); D2, D1's head on all 13,465 (210 s
#     alone, ~71,700 tokens/s); D3, D2's head on them again at half the rate (185 s).
train_on_gpu "$RUN/stage6/train.tokenized.jsonl" "$RUN/stage7/d1" "$RUN/stage6/train2/head" \
    1e-4 60 195 100 100000
train_on_gpu "$RUN/stage7/train.tokenized.jsonl" "$RUN/stage7/d2" "$RUN/stage7/d1/head" \
    1e-4 60 210 100 100000
train_on_gpu "$RUN/stage7/train.tokenized.jsonl" "$RUN/stage7/d3" "$RUN/stage7/d2/head" \
    5e-5 60 185 100 100000

# 27. Evaluate it beside the shipped head as in step 22, then ship it.
compare_with_shipped "$RUN/stage7" "$RUN/stage7/d3/head"
ship "$RUN/stage7/d3/head"
