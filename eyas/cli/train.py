"""`eyas train`: train a draft head: EAGLE-3 with training-time test (--method eagle3, the
default) or K Medusa heads on the target's last hidden state (--method medusa).

Online (the target runs on the fly over tokenized conversations) or offline (from a feature
store made by `eyas features`). Writes OUT/checkpoints/step-N/ every --save-every steps,
OUT/metrics.csv (per TTT step, or per Medusa head, loss and accuracy; estimated acceptance
length on the held-out split) and the final head in OUT/head/ (`--draft eagle3:OUT/head` or
`--draft medusa:OUT/head` in generate, serve and bench).

Examples:
    eyas train --model smollm2-135m --data train.tokenized.jsonl --out runs/smol --max-steps 200
    eyas train --model smollm2-135m --features features/smol --out runs/smol --epochs 2
    eyas train --model smollm2-135m --features features/smol --out runs/smol --resume
    eyas train --config presets/cpu.yaml --model smollm2-135m --data train.jsonl --out runs/x
    eyas train --model smollm2-135m --features features/smol --out runs/long --epochs 20 --max-time 2h
    eyas train --method medusa --model smollm2-135m --features features/smol --out runs/medusa \\
        --medusa-heads 4 --draft-vocab-size 8192 --lr 1e-3
    torchrun --nproc_per_node 2 -m eyas.cli.train --model smollm2-135m --data train.jsonl \\
        --out runs/ddp --micro-batch-size 2        # DDP: gloo on CPU, nccl on GPU
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def _duration(text: str) -> float:
    """Seconds of '900', '900s', '45m' or '1.5h'."""
    text = text.strip().lower()
    scale = _UNITS.get(text[-1:], None)
    try:
        value = float(text[:-1] if scale else text) * (scale or 1.0)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration like 900, 900s, 45m or 1.5h, "
                                         f"got {text!r}")
    return value


def _default(name: str) -> object:
    from eyas.training.config import TrainConfig

    field = TrainConfig.__dataclass_fields__[name]
    return field.default if field.default is not MISSING else None


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,15,27, got {text!r}")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train an EAGLE-3 or Medusa draft head (online or from stored features)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = argparse.SUPPRESS  # defaults live in TrainConfig only; absent flags keep them
    io = parser.add_argument_group("target and data")
    io.add_argument("--model", default=s, help="target: alias (smollm2-135m), HF folder or .gguf")
    io.add_argument("--data", default=s, help="tokenized conversations .jsonl (online mode)")
    io.add_argument("--features", default=s, help="feature store folder (offline mode)")
    io.add_argument("--out", dest="output", default=s, help="run folder")
    io.add_argument("--config", dest="preset", default=None,
                    help="YAML preset of TrainConfig keys; flags override it")
    head = parser.add_argument_group("head and TTT")
    head.add_argument("--method", default=s, choices=("eagle3", "medusa"),
                      help="eagle3: one head with training-time test; medusa: K heads on the "
                           "target's last hidden state (default: eagle3)")
    head.add_argument("--medusa-heads", type=int, default=s,
                      help=f"medusa: K, head k guesses the token k + 1 positions ahead "
                           f"(default: {_default('medusa_heads')})")
    head.add_argument("--medusa-layers", type=int, default=s,
                      help=f"medusa: residual blocks per head (default: {_default('medusa_layers')})")
    head.add_argument("--share-lm-head", action="store_true", default=s,
                      help="medusa: the heads read the target's own lm_head (frozen, not stored) "
                           "instead of training one over --draft-vocab-size ids")
    head.add_argument("--draft-vocab-size", type=int, default=s,
                      help=f"draft vocabulary N (default: {_default('draft_vocab_size')}, capped at the "
                           f"target vocabulary; smaller is faster on a CPU)")
    head.add_argument("--target-layer-ids", type=_layer_ids, default=s,
                      help="tap layers as boundary ids, e.g. 2,15,27 (default: 2,L//2,L-3; offline: "
                           "the stored ones)")
    head.add_argument("--ttt-steps", type=int, default=s,
                      help=f"eagle3: K (default: {_default('ttt_steps')})")
    head.add_argument("--ttt-decay", type=float, default=s,
                      help=f"step k (medusa: head k + 1) weighs decay^k (default: {_default('ttt_decay')})")
    head.add_argument("--labels", default=s, choices=("soft", "hard"),
                      help="soft: cross-entropy against the target's probabilities over the draft "
                           "vocabulary (EAGLE-3's loss); hard: against its argmax "
                           f"(default: {_default('labels')})")
    head.add_argument("--feature-noise", default=s, choices=("none", "uniform", "gaussian"),
                      help="noise added to the target features the head is fed while training "
                           f"(default: {_default('feature_noise')})")
    head.add_argument("--feature-noise-std", type=float, default=s,
                      help=f"its scale: gaussian standard deviation or uniform half-width "
                           f"(default: {_default('feature_noise_std')})")
    head.add_argument("--max-length", type=int, default=s,
                      help=f"online: tokens per sample (default: {_default('max_length')})")
    head.add_argument("--no-init-lm-head", dest="init_lm_head_from_target", action="store_false",
                      default=s, help="start lm_head at random instead of the target's kept rows")
    head.add_argument("--init-layer-from-target", action="store_true", default=s,
                      help="eagle3: start the decoder layer and norms from the target's last layer "
                           "and final norm, fc as the identity on the deepest tap")
    head.add_argument("--init-from", default=s, metavar="HEAD_DIR",
                      help="eagle3: start from this head (weights and draft vocabulary), e.g. to "
                           "train a shipped head further on new data")
    opt = parser.add_argument_group("optimization")
    opt.add_argument("--micro-batch-size", type=int, default=s,
                     help=f"samples per forward and rank (default: {_default('micro_batch_size')})")
    opt.add_argument("--grad-accum", type=int, default=s,
                     help=f"micro batches per optimizer step (default: {_default('grad_accum')})")
    opt.add_argument("--epochs", type=float, default=s, help=f"(default: {_default('epochs')})")
    opt.add_argument("--max-steps", type=int, default=s, help="optimizer steps (overrides --epochs)")
    opt.add_argument("--max-time", dest="max_time_s", type=_duration, default=s, metavar="DURATION",
                     help="time budget, e.g. 45m, 2h, 900 (seconds): no new step once this much "
                          "training time is spent (the final evaluation and save follow). The "
                          "learning rate follows the larger of the steps' and the time's share, so "
                          "it still warms up and decays to its floor; --epochs / --max-steps stay the "
                          "upper bound")
    opt.add_argument("--lr", dest="learning_rate", type=float, default=s,
                     help=f"peak AdamW learning rate (default: {_default('learning_rate')})")
    opt.add_argument("--lr-schedule", default=s, choices=("cosine", "linear", "constant"),
                     help=f"decay after the warmup, to --min-lr-ratio x peak at the last step "
                          f"(default: {_default('lr_schedule')})")
    opt.add_argument("--min-lr-ratio", type=float, default=s,
                     help=f"decay floor / peak (default: {_default('min_lr_ratio')})")
    opt.add_argument("--warmup-ratio", type=float, default=s,
                     help=f"share of steps in linear warmup (default: {_default('warmup_ratio')})")
    opt.add_argument("--weight-decay", type=float, default=s,
                     help=f"(default: {_default('weight_decay')})")
    opt.add_argument("--max-grad-norm", type=float, default=s,
                     help=f"gradient clipping (default: {_default('max_grad_norm')})")
    opt.add_argument("--precision", default=s, choices=("auto", "float32", "bfloat16"),
                     help="head autocast: auto = bf16 on a GPU and on a CPU with AMX, fp32 on other CPUs "
                          "(default: auto)")
    opt.add_argument("--target-dtype", default=s,
                     help=f"online: target precision, as load_target takes it "
                          f"(default: {_default('target_dtype')})")
    opt.add_argument("--device", default=s, help="cpu, cuda or cuda:N (default: cpu)")
    opt.add_argument("--seed", type=int, default=s, help=f"(default: {_default('seed')})")
    run = parser.add_argument_group("checkpoints, evaluation, logs")
    run.add_argument("--save-every", type=int, default=s,
                     help=f"checkpoint every N steps, 0 = at the end only (default: {_default('save_every')})")
    run.add_argument("--keep-checkpoints", type=int, default=s,
                     help=f"(default: {_default('keep_checkpoints')})")
    run.add_argument("--resume", action="store_true", default=s,
                     help="continue from the latest checkpoint in --out (same settings required)")
    run.add_argument("--eval-fraction", type=float, default=s,
                     help=f"held-out share of the samples (default: {_default('eval_fraction')})")
    run.add_argument("--eval-max-samples", type=int, default=s,
                     help=f"(default: {_default('eval_max_samples')})")
    run.add_argument("--eval-every", type=int, default=s,
                     help="evaluate every N steps; 0 = at each checkpoint and at the end")
    run.add_argument("--log-every", type=int, default=s, help=f"(default: {_default('log_every')})")
    run.add_argument("--no-progress", dest="progress", action="store_false", default=s,
                     help="no progress bar")
    parser.set_defaults(func=run_train)


def config_from_args(args: argparse.Namespace):  # -> TrainConfig
    from eyas.training.config import TrainConfig, read_preset

    names = {f.name for f in fields(TrainConfig)}
    flags = {k: v for k, v in vars(args).items() if k in names}
    preset = read_preset(args.preset) if args.preset else {}
    return TrainConfig.from_dict({**preset, **flags})


def run_train(args: argparse.Namespace) -> int:
    from eyas.training.trainer import Trainer

    trainer = Trainer(config_from_args(args))
    try:
        summary = trainer.train()
        if trainer.context.is_main:
            print(f"[eyas] head written to {summary.head_dir} after {summary.steps} steps; "
                  f"{summary.tokens_per_second:.0f} "
                  f"training tokens/s over {summary.seconds:.0f} s")
            if summary.held_out is not None:
                accuracies = " ".join(f"{a:.3f}" for a in summary.held_out.accuracies)
                print(f"[eyas] held-out: per-step accuracy {accuracies}; estimated acceptance length "
                      f"{summary.held_out.accept_length:.2f}")
    finally:
        trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m eyas.cli.train ...` (what torchrun launches) runs `eyas train ...`."""
    from eyas.cli.main import run_subcommand

    return run_subcommand("train", argv)


if __name__ == "__main__":
    sys.exit(main())
