"""Recipe ablations of the EAGLE-3 head at a fixed CPU budget: every arm (a list of `eyas train`
flags on top of the baseline recipe) trains for the same process CPU seconds, then is scored on
the same held-out prompts, teacher-forced on the target's greedy answers (as `eyas eval
diagnose` scores heads). Prints one table and the baseline's held-out curve.

    RUN=runs/ablate
    eyas data prepare --source sharegpt --output-dir $RUN/prepared --keep conversation --max-turns 1 \
        --min-chars 16 --max-chars 4000 --limit 400 --workers 1
    eyas data render --model smollm2-135m --input $RUN/prepared/train.jsonl --output $RUN/train.jsonl --max-length 256
    OMP_NUM_THREADS=1 eyas features --model smollm2-135m --data $RUN/train.jsonl --out $RUN/features --max-length 256
    OMP_NUM_THREADS=1 nice -n 10 python scripts/ablate-head.py $RUN --cpu-seconds 150 --curve-points 4
    OMP_NUM_THREADS=1 python scripts/ablate-head.py $RUN --arms baseline,hard    # some arms only
    OMP_NUM_THREADS=1 python scripts/ablate-head.py $RUN --paired     # step-0 deltas, paired by position

The budget: each arm's optimizer steps are chosen so that its training steps cost --cpu-seconds
of process CPU time (set-up and evaluation excluded): the CPU seconds per training token are
measured over a few steps (once per cost shape: TTT depth, draft vocabulary), and the steps are
counted off the arm's own batch order until the budget's tokens are spent. Arms that share a
cost shape get the same steps. The schedule of each arm spans its whole budget.

Results go to RUN/ablation/<arm>.json as each arm ends (a rerun skips finished arms) and the
table to RUN/ablation/table.md. The held-out prompts: the eval split of the prepared ShareGPT
prompts of the shipped recipe (never trained on), picked by a fixed hash; their greedy answers
are cached in RUN/ablation/held-out.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

# Today's recipe (scripts/train-smollm2-head.sh, step 5), on top of which each arm changes flags.
BASELINE = ["--draft-vocab-size", "8192", "--ttt-steps", "5", "--lr", "5e-4"]
ARMS: dict[str, list[str]] = {
    "baseline": [],
    "baseline-seed1": ["--seed", "1"],
    "lr-3e-4": ["--lr", "3e-4"],
    "lr-1e-3": ["--lr", "1e-3"],
    "ttt-3": ["--ttt-steps", "3"],
    "ttt-3-lr-1e-3": ["--ttt-steps", "3", "--lr", "1e-3"],
    "ttt-7": ["--ttt-steps", "7"],
    "vocab-16k": ["--draft-vocab-size", "16384"],
    "hard-labels": ["--labels", "hard"],
    "noise-uniform": ["--feature-noise", "uniform", "--feature-noise-std", "0.2"],
    "init-from-target": ["--init-layer-from-target"],
    "lr-schedule-linear": ["--lr-schedule", "linear"],
    "bf16-autocast": ["--precision", "bfloat16"],
    "ttt-3-bf16": ["--ttt-steps", "3", "--precision", "bfloat16"],
}
COST_FLAGS = ("ttt_steps", "draft_vocab_size", "precision", "micro_batch_size", "grad_accum")
EVAL_TTT_STEPS = 5


def train_config(run: Path, features: str, arm: str, flags: list[str], max_steps: int):
    from eyas.cli.main import build_parser
    from eyas.cli.train import config_from_args

    argv = ["train", "--model", "smollm2-135m", "--features", features, "--out", str(run / "ablation" / arm),
            "--save-every", "0", "--eval-fraction", "0", "--no-progress", "--log-every", "1000000",
            *BASELINE, *flags, "--max-steps", str(max_steps)]
    return config_from_args(build_parser().parse_args(argv))


def sample_tokens(trainer) -> list[int]:
    """Tokens of each sample of the trainer's source (what a step over it costs)."""
    return [int(ids.numel()) for ids, _ in trainer.source.token_arrays()]


def step_tokens(trainer, lengths: list[int], step: int) -> int:
    return sum(lengths[i] for i in trainer.plan.step_indices(step))


def calibrate(run: Path, features: str, arm: str, flags: list[str], steps: int = 14, skip: int = 2) -> float:
    """CPU seconds per training token of this arm's cost shape, over `steps` steps (the first
    `skip` not counted)."""
    from eyas.training.trainer import Trainer

    trainer = Trainer(train_config(run, features, f"calibrate-{arm}", flags, max_steps=10_000))
    lengths = sample_tokens(trainer)
    cpu, tokens = 0.0, 0
    for step in range(steps):
        start = time.process_time()
        trainer.train_step(step)
        if step >= skip:
            cpu += time.process_time() - start
            tokens += step_tokens(trainer, lengths, step)
    trainer.close()
    return cpu / tokens


@torch.no_grad()
def held_out_accuracy(target, lm_head: torch.Tensor, sequences, head) -> list[float]:
    from eyas.bench.diagnose.measure import measure_split

    was_training = head.training
    head.eval()
    split = measure_split(target, head, lm_head, sequences, ttt_steps=EVAL_TTT_STEPS)
    head.train(was_training)
    return (split.head_correct.double() / split.head_counted.clamp(min=1).double()).tolist()


def training_accuracy(trainer, indices: list[int]) -> list[float]:
    """The trainer's own teacher-forced TTT accuracy on fixed training samples."""
    held, trainer.eval_indices = trainer.eval_indices, indices
    stats = trainer.evaluate()
    trainer.eval_indices = held
    return stats.accuracies


def run_arm(run: Path, features: str, arm: str, flags: list[str], seconds_per_token: float,
            cpu_seconds: float, target, lm_head, sequences, curve_points: int) -> dict:
    from eyas.training.checkpoints import write_head
    from eyas.training.trainer import Trainer

    # 1. Steps: the arm's batch order, summed until the budget's tokens are spent.
    probe = Trainer(train_config(run, features, arm, flags, max_steps=10_000))
    lengths = sample_tokens(probe)
    budget_tokens, steps, tokens = cpu_seconds / seconds_per_token, 0, 0
    while tokens < budget_tokens:
        tokens += step_tokens(probe, lengths, steps)
        steps += 1
    probe.close()
    # 2. Train, timing the steps only; the curve's points in between.
    trainer = Trainer(train_config(run, features, arm, flags, max_steps=steps))
    train_slice = trainer.train_indices[:16]
    marks = {round(steps * (i + 1) / curve_points) for i in range(curve_points)} if curve_points else set()
    cpu, seen, curve = 0.0, 0, []
    for step in range(steps):
        start = time.process_time()
        trainer.train_step(step)
        cpu += time.process_time() - start
        seen += step_tokens(trainer, lengths, step)
        if step + 1 in marks and step + 1 < steps:
            curve.append({"step": step + 1, "tokens": seen, "cpu_s": round(cpu, 1),
                          "held_out": held_out_accuracy(target, lm_head, sequences, trainer.head),
                          "train": training_accuracy(trainer, train_slice)})
            print(f"  {arm} step {step + 1}: {json.dumps(curve[-1])}", flush=True)
    # 3. Score the final head.
    result = {"arm": arm, "flags": flags, "steps": steps, "tokens": seen, "cpu_s": round(cpu, 1),
              "held_out": held_out_accuracy(target, lm_head, sequences, trainer.head),
              "train": training_accuracy(trainer, train_slice), "curve": curve}
    if curve_points:
        curve.append({"step": steps, "tokens": seen, "cpu_s": result["cpu_s"],
                      "held_out": result["held_out"], "train": result["train"]})
    write_head(trainer.head, run / "ablation" / arm / "head")
    trainer.close()
    return result


def paired_deltas(run: Path, target, lm_head: torch.Tensor, sequences, arms: list[str]) -> str:
    """Step-0 accuracy of each finished arm's head minus the baseline's, over the same held-out
    positions, with the standard error of that paired difference."""
    from eyas.bench.diagnose.measure import measure_split
    from eyas.eagle3 import load_head

    hits = {}
    for arm in ["baseline", *[a for a in arms if a != "baseline"]]:
        folder = run / "ablation" / arm / "head"
        if not folder.is_dir():
            continue
        head = load_head(folder, embedding=target.model.embed_tokens.weight.float())
        split = measure_split(target, head, lm_head, sequences, ttt_steps=1)
        hits[arm] = split.head_first_hits.double()
    lines = ["| arm | step-0 accuracy | paired delta vs baseline | standard error |", "|---|---|---|---|"]
    for arm, arm_hits in hits.items():
        difference = arm_hits - hits["baseline"]
        error = difference.std() / difference.numel() ** 0.5
        lines.append(f"| {arm} | {arm_hits.mean():.4f} | {difference.mean():+.4f} | {error:.4f} |")
    return "\n".join(lines)


def held_out_sequences(run: Path, target, prompts: int, max_tokens: int):
    from eyas.bench.diagnose.data import pick, prepared_sharegpt, read_conversations
    from eyas.bench.diagnose.measure import Sequence, greedy_answers

    cache = run / "ablation" / "held-out.json"
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved["prompts"] == prompts and saved["max_tokens"] == max_tokens:
            return [Sequence(s["prompt"], s["answer"]) for s in saved["sequences"]]
    conversations = pick(read_conversations(prepared_sharegpt() / "eval.jsonl"), prompts)
    sequences = greedy_answers(target, conversations, max_tokens)
    cache.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "sequences": [
        {"prompt": s.prompt, "answer": s.answer} for s in sequences]}))
    return sequences


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["arm"] == "baseline"), results[0])
    steps = len(base["held_out"])
    head = ("| arm | flags | steps | tokens seen | CPU s | " + " | ".join(f"acc {k}" for k in range(steps))
            + " | step-0 delta vs baseline | train acc 0 |")
    lines = [head, "|" + "---|" * (steps + 7)]
    for r in results:
        accuracy = " | ".join(f"{a:.3f}" for a in r["held_out"])
        delta = r["held_out"][0] - base["held_out"][0]
        lines.append(f"| {r['arm']} | {' '.join(r['flags']) or '(baseline)'} | {r['steps']} | {r['tokens']:,} | "
                     f"{r['cpu_s']:.0f} | {accuracy} | {delta:+.3f} | {r['train'][0]:.3f} |")
    return "\n".join(lines)


def curve_table(result: dict) -> str:
    lines = ["| step | tokens seen | CPU s | held-out acc 0 | held-out acc 1 | train acc 0 | train acc 1 |",
             "|---|---|---|---|---|---|---|"]
    for point in result["curve"]:
        lines.append(f"| {point['step']} | {point['tokens']:,} | {point['cpu_s']:.0f} | "
                     f"{point['held_out'][0]:.3f} | {point['held_out'][1]:.3f} | "
                     f"{point['train'][0]:.3f} | {point['train'][1]:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--features", default=None, help="feature store (default: RUN/features)")
    parser.add_argument("--cpu-seconds", type=float, default=200.0, help="training CPU seconds per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=96, help="greedy answer tokens per prompt")
    parser.add_argument("--curve-points", type=int, default=5, help="baseline: held-out points")
    parser.add_argument("--paired", action="store_true",
                        help="no training: the finished arms' step-0 accuracy minus the baseline's, "
                             "position by position, with its standard error")
    args = parser.parse_args()
    from eyas.engine.target import load_target
    from eyas.features.target_io import describe_target, load_output_weights
    from eyas.training.config import TrainConfig

    torch.set_num_threads(1)
    features = args.features or str(args.run / "features")
    (args.run / "ablation").mkdir(parents=True, exist_ok=True)
    target = load_target("smollm2-135m", dtype="float32")
    _, lm_head = load_output_weights(describe_target("smollm2-135m"))
    sequences = held_out_sequences(args.run, target, args.prompts, args.max_tokens)
    print(f"held-out: {len(sequences)} prompts, {sum(len(s.answer) for s in sequences)} answer tokens", flush=True)
    if args.paired:
        text = paired_deltas(args.run, target, lm_head, sequences, args.arms.split(","))
        (args.run / "ablation" / "paired.md").write_text(text + "\n")
        print(text)
        return
    costs: dict[tuple, float] = {}
    results = []
    for arm in args.arms.split(","):
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
        done = args.run / "ablation" / f"{arm}.json"
        flags = ARMS[arm]
        config: TrainConfig = train_config(args.run, features, arm, flags, 1)
        shape = tuple(getattr(config, name) for name in COST_FLAGS)
        if done.is_file():  # its calibration holds for the arms of its cost shape run after it
            results.append(json.loads(done.read_text()))
            costs.setdefault(shape, results[-1]["cpu_ms_per_token"] / 1e3)
            continue
        if shape not in costs:
            costs[shape] = calibrate(args.run, features, arm, flags)
            print(f"{arm}: {costs[shape] * 1e3:.3f} CPU ms per training token", flush=True)
        result = run_arm(args.run, features, arm, flags, costs[shape], args.cpu_seconds, target, lm_head,
                         sequences, args.curve_points if arm == "baseline" else 0)
        result["cpu_ms_per_token"] = costs[shape] * 1e3
        done.write_text(json.dumps(result, indent=1) + "\n")
        results.append(result)
        print(f"{arm}: {result['steps']} steps, held-out {[round(a, 3) for a in result['held_out']]}", flush=True)
    text = table(results)
    baseline = next((r for r in results if r["arm"] == "baseline" and r["curve"]), None)
    if baseline is not None:
        text += "\n\nBaseline, accuracy against tokens seen:\n\n" + curve_table(baseline)
    (args.run / "ablation" / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
