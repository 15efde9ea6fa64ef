#!/usr/bin/env bash
# A/B of uncommitted engine changes against HEAD, side by side on one machine.
#
#   bash scripts/ab-working-tree.sh [ROUNDS]      # default 2
#
# Alternates the working tree ("new") and HEAD ("old", via git stash) ROUNDS times. Each run:
# the serving engine at concurrency 1 (8 MT-Bench first turns x 64 tokens, median of 3 rounds,
# eyas.scheduler.measure), then plain `generate` on the same prompts (median tok/s). Run it on
# a quiet machine and compare the ratios. Old BENCHMARKS.md section 1 quotes one run.
set -euo pipefail
ROUNDS=${1:-2}
PY=${PY:-.venv/bin/python}
git diff --quiet && { echo "no uncommitted change to compare" >&2; exit 1; }
for _ in $(seq "$ROUNDS"); do
    for version in new old; do
        [ "$version" = old ] && git stash -q
        "$PY" -m eyas.scheduler.measure --prompts mtbench --configs none --concurrency 1 \
            --max-tokens 64 --rounds 3 | tail -1 | sed "s/^/$version serving /"
        "$PY" - <<'PY' | sed "s/^/$version /"
import statistics
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.scheduler.measure import load_prompts

target = load_target("smollm2-135m")
prompts = load_prompts(target, "mtbench", 8)
params = SamplingParams(max_tokens=64)
generate(target, prompts[0], params)  # warm-up
rates = [generate(target, prompt, params).stats["tokens_per_s"] for prompt in prompts]
print("generate median tok/s", round(statistics.median(rates), 1))
PY
        [ "$version" = old ] && git stash pop -q
    done
done
