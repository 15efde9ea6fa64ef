"""The settings of `eyas eval diagnose` (the CLI maps its flags onto this dataclass)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.errors import EyasError

TARGET_DTYPES = ("float32", "bfloat16", "int4", "auto")


@dataclass
class DiagnoseConfig:
    model: str = "smollm2-135m"
    head: str = "smollm2-135m"  # a head folder, or the name of a shipped head
    target_dtype: str = "float32"  # the teacher-forced passes (the shipped head's features: float32)
    prompts: str | None = None  # a prepared folder (train.jsonl, eval.jsonl); None = embedded ShareGPT
    held_out_prompts: int = 24  # picked by hash from eval.jsonl (never trained on)
    train_prompts: int = 16  # picked by hash from the first `train_pool` lines of train.jsonl
    train_pool: int = 704  # the prompts whose answers the shipped head's first stage trained on
    max_tokens: int = 96  # greedy answer length per prompt
    vocab_sizes: tuple[int, ...] = (8192, 16384, 32768)  # frequency-rule vocabularies (+ the head's, + full)
    vocab_data: str = "sharegpt-answers"  # or a tokenized .jsonl (data.vocabulary_counts)
    vocab_pool: int = 3680  # sharegpt-answers: the first N train prompts' original answers
    ttt_steps: int = 5
    skip_counts: tuple[int, ...] = (1, 2, 4)  # layer-skip drafts: the n least influential layers
    mtbench_prompts: int = 16  # acceptance by position on MT-Bench (`eyas eval`); 0 = skip
    mtbench_tokens: int = 64
    eval_dtype: str = "auto"  # the MT-Bench run's precision (as `eyas eval`)
    tree: str | None = None  # the MT-Bench run's draft tree (`eyas eval --tree`); None = chain:K, a
    # top-1 chain as deep as the TTT steps, so that acceptance by position reads beside accuracy per step
    seed: int = 0  # torch seed (only ties could depend on it)

    def __post_init__(self) -> None:
        self.vocab_sizes = tuple(sorted({int(n) for n in self.vocab_sizes}))
        self.skip_counts = tuple(sorted({int(n) for n in self.skip_counts}))
        if self.tree is None:
            self.tree = f"chain:{self.ttt_steps}"
        if self.target_dtype not in TARGET_DTYPES:
            raise EyasError(f"--target-dtype must be one of {', '.join(TARGET_DTYPES)}, "
                            f"got '{self.target_dtype}'")
        for name in ("held_out_prompts", "train_pool", "ttt_steps", "vocab_pool"):
            if getattr(self, name) < 1:
                raise EyasError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("train_prompts", "mtbench_prompts"):
            if getattr(self, name) < 0:
                raise EyasError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.max_tokens < 2 or self.mtbench_tokens < 2:
            raise EyasError("--max-tokens and --mtbench-tokens must be >= 2")
        if any(n < 1 for n in self.vocab_sizes):
            raise EyasError(f"--vocab-sizes must be positive, got {list(self.vocab_sizes)}")
        if any(n < 1 for n in self.skip_counts):
            raise EyasError(f"--skip-counts must be >= 1 (layers left out), got {list(self.skip_counts)}")
