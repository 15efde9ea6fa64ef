"""Recipe ablation: the head's decoder layer initialised from the target's last layer, against
the usual random start, at the same training budget (docs/training.md, "What limits the head").

    RUN=runs/ablate-init
    eyas data prepare --source sharegpt --output-dir $RUN/prepared --keep conversation --max-turns 1 \
        --min-chars 16 --max-chars 4000 --limit 400 --workers 1
    eyas data render --model smollm2-135m --input $RUN/prepared/train.jsonl --output $RUN/all.jsonl --max-length 256
    head -120 $RUN/all.jsonl > $RUN/train.jsonl
    OMP_NUM_THREADS=1 eyas features --model smollm2-135m --data $RUN/train.jsonl --out $RUN/features --max-length 256
    python scripts/ablate-head-init.py init $RUN             # $RUN/init-random, $RUN/init-target
    for arm in random target; do
      OMP_NUM_THREADS=1 eyas train --model smollm2-135m --features $RUN/features --out $RUN/train-$arm \
          --init-from $RUN/init-$arm --ttt-steps 5 --max-steps 160 --lr 5e-4 --save-every 0 --eval-fraction 0
    done
    OMP_NUM_THREADS=1 python scripts/ablate-head-init.py eval $RUN $RUN/train-random/head $RUN/train-target/head

Both arms share everything but the start of `fc`, `midlayer` and `norm`: the draft vocabulary
(the shipped head's 8,192 ids), the output layer (the target's rows of those ids), the data, the
steps and the learning rate. The target-initialised arm copies the target's last decoder layer
into `midlayer` (its q/k/v read the normed feature through the second half of their inputs; the
embedding half keeps its random start), the target's final norm into `norm` and `hidden_norm`,
and starts `fc` as the identity on the deepest tap. `eval` scores heads on the target's greedy
answers to held-out prompts, as `eyas eval diagnose` does. (`eyas train
--init-layer-from-target` starts a head this way; scripts/ablate-head.py compares it with the
other recipe arms at a fixed CPU budget.) Result (docs/training.md, section 11):
held-out accuracy per step 0.153, 0.101, 0.073, 0.062, 0.057 (random) against 0.132, 0.099,
0.085, 0.064, 0.056 (the target's last layer): no gain at this budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch


def init_heads(run: Path) -> None:
    from eyas.eagle3 import load_head
    from eyas.eagle3.checkpoint import save_head
    from eyas.eagle3.config import Eagle3Config
    from eyas.eagle3.head import Eagle3Head
    from eyas.eagle3.shipped import shipped_head_dir
    from eyas.features.target_io import describe_target, load_output_weights
    from eyas.training.heads import init_layer_from_target

    info = describe_target("smollm2-135m")
    _, lm_head = load_output_weights(info)
    vocab = load_head(shipped_head_dir("smollm2-135m")).draft_vocab
    for arm in ("random", "target"):
        torch.manual_seed(0)  # the same random start in both arms
        head = Eagle3Head(Eagle3Config.for_target(info.config, vocab.size, target_model="smollm2-135m",
                                                  target_architectures=info.architectures))
        head.set_vocab(vocab)
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_head[vocab.kept_ids])
        if arm == "target":  # what `eyas train --init-layer-from-target` does
            init_layer_from_target(head, info)
        save_head(head, run / f"init-{arm}")
        print(f"wrote {run / f'init-{arm}'}")


def eval_heads(run: Path, heads: list[str], prompts: int = 16, max_tokens: int = 64) -> None:
    from eyas.bench.diagnose.data import pick, prepared_sharegpt, read_conversations
    from eyas.bench.diagnose.measure import greedy_answers, measure_split
    from eyas.bench.diagnose.stats import accept_length
    from eyas.eagle3 import load_head
    from eyas.engine.target import load_target
    from eyas.features.target_io import describe_target, load_output_weights

    target = load_target("smollm2-135m", dtype="float32")
    _, lm_head = load_output_weights(describe_target("smollm2-135m"))
    held_out = pick(read_conversations(prepared_sharegpt() / "eval.jsonl"), prompts)
    sequences = greedy_answers(target, held_out, max_tokens)
    results = {}
    for folder in heads:
        head = load_head(folder, embedding=target.model.embed_tokens.weight.float())
        split = measure_split(target, head, lm_head, sequences, ttt_steps=5)
        accuracy = (split.head_correct / split.head_counted).tolist()
        results[folder] = {"positions": split.target_argmax.numel(),
                           "accuracy_per_step": [round(a, 4) for a in accuracy],
                           "accept_length": round(accept_length(accuracy), 4)}
        print(folder, json.dumps(results[folder]), flush=True)
    (run / "ablation.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "init":
        init_heads(Path(sys.argv[2]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "eval":
        eval_heads(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(__doc__)
