"""`Trainer`: a draft head trained offline or online on 1..N ranks: the EAGLE-3 head with
training-time test (`method="eagle3"`) or K Medusa heads (`method="medusa"`, training/medusa.py).

One optimizer step = one global batch (micro batch x accumulation x ranks):
  1. load this rank's micro batches; count the answer tokens of the whole global batch (the
     loss normalizer, all-reduced), so that any split over ranks and micro batches gives the
     same gradient as one process;
  2. per micro batch: the target's taps and last hidden state (stored, or computed now), its
     distribution over the draft vocabulary, the K-step TTT unroll (or the K Medusa heads),
     backward (DDP syncs gradients on the last micro batch only);
  3. clip, AdamW step with the warmup + decay rate (schedule.py); log; checkpoint every N steps.

Recipe options (TrainConfig): soft or hard labels, noise on the fed features (noise.py), the
learning-rate decay, the decoder layer started from the target's last layer (heads.py).

Usage:
    trainer = Trainer(TrainConfig(model="smollm2-135m", data="train.jsonl", output="runs/a"))
    summary = trainer.train()
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from eyas.eagle3.checkpoint import EMBEDDING_NAME, load_head, load_head_state
from eyas.eagle3.config import check_target_layer_ids
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import build_draft_vocab, count_answer_tokens
from eyas.engine.target import Target, load_target
from eyas.errors import EyasError
from eyas.features.store import FeatureStore
from eyas.features.target_io import compute_target_features, describe_target, load_output_weights
from eyas.features.tokenized import read_tokenized
from eyas.training.checkpoints import (
    check_resume_settings,
    restore_newest_checkpoint,
    save_checkpoint,
    write_head,
)
from eyas.training.config import SETTINGS_BEFORE_THEY_EXISTED, TrainConfig, cpu_has_amx
from eyas.training.data import Batch, BatchPlan, OfflineSource, OnlineSource, collate, split_held_out
from eyas.training.distributed import DistributedContext
from eyas.training.heads import build_eagle3, build_medusa
from eyas.training.metrics import MetricsLogger, acceptance_length
from eyas.training.noise import add_feature_noise
from eyas.training.schedule import WarmupSchedule
from eyas.training.ttt import (
    TargetLabels,
    TargetOutputLayer,
    answer_count,
    hard_labels,
    scored_target_rows,
    target_distribution,
    weighted_loss,
)


@dataclass
class StepStats:
    loss: float  # the optimized loss: sum_k decay^k loss_k / answer tokens
    step_losses: list[float]  # per TTT step, per answer token
    accuracies: list[float]
    tokens: int
    grad_norm: float = 0.0

    @property
    def accept_length(self) -> float:
        return acceptance_length(self.accuracies)


@dataclass
class TrainSummary:
    steps: int
    head_dir: str
    train: StepStats | None
    held_out: StepStats | None
    tokens_per_second: float
    seconds: float


class Trainer:
    def __init__(self, config: TrainConfig, target: Target | None = None) -> None:
        self.config = config
        self.clock = time.perf_counter  # the time budget's clock (tests give a fake one)
        self.context = DistributedContext.start(config.device)
        self.device = self.context.device
        # On a GPU, and in bfloat16 on a CPU, a batch's length is rounded up to 64 tokens: a few
        # shapes, whose kernel plans are reused (padding rows are never scored). A float32 CPU
        # run computes every row it is given.
        self.pad_multiple = config.shape_multiple(self.device)
        self.output = Path(config.output)
        self._load_target_and_data(target)
        self._build_head()
        self._build_optimizer()

    # ---- set-up --------------------------------------------------------------------------------
    def _load_target_and_data(self, target: Target | None) -> None:
        config = self.config
        info = describe_target(config.model)
        num_layers = info.config.num_hidden_layers
        self.target: Target | None = None
        if config.online:
            self.layer_ids = check_target_layer_ids(config.target_layer_ids or info.default_layer_ids, num_layers)
            samples = read_tokenized(config.data, vocab_size=info.config.vocab_size)  # type: ignore[arg-type]
            self.source = OnlineSource(samples, config.max_length)
            self.target = target or load_target(config.model, dtype=config.target_dtype,
                                                device=str(self.device))
        else:
            store = FeatureStore(config.features)  # type: ignore[arg-type]
            meta = store.meta
            if (meta.hidden_size, meta.vocab_size) != (info.config.hidden_size, info.config.vocab_size):
                raise EyasError(f"the features in {config.features} were made with a target of hidden "
                                f"{meta.hidden_size} / vocabulary {meta.vocab_size}, but --model "
                                f"{config.model} has {info.config.hidden_size} / {info.config.vocab_size}")
            if config.target_layer_ids and list(config.target_layer_ids) != meta.target_layer_ids:
                raise EyasError(f"--target-layer-ids {config.target_layer_ids} differ from the layers "
                                f"stored in {config.features}: {meta.target_layer_ids}")
            if meta.target_model != config.model and self.context.is_main:
                print(f"[eyas] note: the features were made with --model {meta.target_model}; training "
                      f"with --model {config.model} (same shape; make sure it is the same target)",
                      flush=True)
            # ids from before they were checked at extraction: refused here rather than at serve time
            self.layer_ids = check_target_layer_ids(meta.target_layer_ids, num_layers)
            self.source = OfflineSource(store)
        # Both modes read the embedding and lm_head from the target's files, in float32.
        embedding, lm_head = load_output_weights(info)
        self.embedding, self.lm_head_weight = embedding.to(self.device), lm_head.to(self.device)
        self.info = info
        self.train_indices, self.eval_indices = split_held_out(
            len(self.source), config.eval_fraction, config.eval_max_samples, config.seed)
        self.global_batch = config.micro_batch_size * config.grad_accum * self.context.world_size
        self.plan = BatchPlan(self.train_indices, self.global_batch, config.seed)
        epochs_steps = int(config.epochs * self.plan.steps_per_epoch)
        self.total_steps = config.max_steps or max(1, epochs_steps)

    def _build_head(self) -> None:
        config = self.config
        torch.manual_seed(config.seed)
        # 1. The draft vocabulary from the answer tokens of the training split (Medusa heads
        #    that share the target's output layer draft from the whole vocabulary).
        train = set(self.train_indices)
        arrays = (pair for i, pair in enumerate(self.source.token_arrays()) if i in train)
        vocab_size = self.info.config.vocab_size
        self.counts = count_answer_tokens(arrays, vocab_size)
        initial = self._initial_head() if config.init_from else None
        if initial is not None:  # its draft vocabulary goes with its weights
            vocab = initial.draft_vocab
        else:
            size = vocab_size if config.share_lm_head else min(config.draft_vocab_size, vocab_size)
            vocab = build_draft_vocab(self.counts, size)
        self.vocab_coverage = vocab.coverage(self.counts)
        self.vocab = vocab
        # With fast bfloat16 products (AMX), the first epoch's full-vocabulary argmax is screened
        # in bfloat16 with a proven bound (the same labels; eyas/training/label_screen.py).
        self.output_layer = TargetOutputLayer(self.lm_head_weight, vocab,
                                              screen=self.device.type == "cpu" and cpu_has_amx())
        # The target's argmax per sample row (in_draft [T], argmax_draft [T]), by sample index:
        # it depends on the sample alone, so from the second epoch on only the draft
        # vocabulary's rows of the target's output layer run.
        self.label_cache: dict[int, tuple[Tensor, Tensor]] = {}
        # 2. The head(s), and the module whose forward gives the K loss terms.
        build = build_medusa if config.method == "medusa" else build_eagle3
        self.head, self.model = build(config, self.info, self.layer_ids, vocab,
                                      self.embedding, self.lm_head_weight, self.device)
        if initial is not None:
            state = {k: v for k, v in initial.state_dict().items() if k != EMBEDDING_NAME}
            load_head_state(self.head, state, config.init_from)
        if self.context.is_distributed:
            # d2t and t2d are equal on every rank and never change: no buffer sync per forward.
            self.model = DistributedDataParallel(self.model, forward_sync_buffers=False)

    def _initial_head(self) -> Eagle3Head:
        """The head of --init-from, checked against this run's target and taps."""
        config = self.config
        initial = load_head(config.init_from)  # float32, on the CPU; no embedding needed
        head_config = initial.config
        if (head_config.hidden_size, head_config.vocab_size) != (self.info.config.hidden_size,
                                                                  self.info.config.vocab_size):
            raise EyasError(f"--init-from {config.init_from}: the head was trained for a target of "
                            f"hidden {head_config.hidden_size} / vocabulary {head_config.vocab_size}, "
                            f"not {config.model}")
        if list(head_config.target_layer_ids) != list(self.layer_ids):
            raise EyasError(f"--init-from {config.init_from}: the head reads layers "
                            f"{list(head_config.target_layer_ids)}, these features hold {self.layer_ids}")
        if self.context.is_main and head_config.draft_vocab_size != config.draft_vocab_size:
            print(f"[eyas] note: --init-from keeps its draft vocabulary of "
                  f"{head_config.draft_vocab_size} tokens (--draft-vocab-size is ignored)", flush=True)
        return initial

    def _build_optimizer(self) -> None:
        config = self.config
        parameters = [p for p in self.head.parameters() if p.requires_grad]
        # fused: one kernel over every parameter (4x faster than the default loop on a CPU).
        self.optimizer = torch.optim.AdamW(
            parameters, lr=config.learning_rate, weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2), fused=self.device.type in ("cpu", "cuda"))
        self.schedule = WarmupSchedule(config.learning_rate, self.total_steps,
                                       int(config.warmup_ratio * self.total_steps), config.min_lr_ratio,
                                       config.lr_schedule, config.max_time_s)
        self.start_step = 0
        self.time_spent = 0.0  # training seconds before this process (a resumed run's budget)
        if config.resume:  # the newest checkpoint that verifies (skipped ones are named on stderr)
            found = restore_newest_checkpoint(self.output, self.head, self.optimizer,
                                              is_main=self.context.is_main)
            if found is not None:
                folder, state = found
                state["settings"] = {**SETTINGS_BEFORE_THEY_EXISTED, **state.get("settings", {})}
                check_resume_settings(state, config.result_settings(), self.global_batch)
                self.schedule.check_state(state["schedule"])
                self.start_step = int(state["step"])
                self.time_spent = float(state.get("time_spent_s", 0.0))
                if self.context.is_main:
                    print(f"[eyas] resuming from {folder} (step {self.start_step})", flush=True)
        self.time_spent_now = self.time_spent

    # ---- one micro batch -----------------------------------------------------------------------
    def _micro_batch(self, batch: Batch, indices: list[int], noise_key: tuple[int, int] | None = None
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """(weighted loss sum, loss_sums [K], correct [K], counted [K], tokens) of a micro batch of
        the samples `indices`; noise_key (step, micro batch) while training: the feature noise's."""
        input_ids = batch.input_ids.to(self.device)
        loss_mask = batch.loss_mask.to(self.device)
        if batch.taps is None:  # online: the target runs now
            assert self.target is not None
            taps, hidden = compute_target_features(self.target.model, input_ids, self.layer_ids)
        else:
            taps, hidden = batch.taps.to(self.device), batch.hidden.to(self.device)
        # The target's distribution only on the rows the loss reads (Medusa heads: all rows).
        rows = None if self.config.method == "medusa" else scored_target_rows(loss_mask, self.config.ttt_steps)
        labels = self._cached_labels(indices, batch)
        target = target_distribution(hidden, self.output_layer, self.vocab, rows=rows, labels=labels)
        if labels is None:
            for row, index in enumerate(indices):
                length = int(batch.lengths[row])
                self.label_cache[index] = (target.in_draft[row, :length].cpu(),
                                           target.argmax_draft[row, :length].cpu().int())
        if self.config.labels == "hard":
            target = hard_labels(target)
        if noise_key is not None:  # the target itself is computed from the clean features
            config = self.config
            noise = (config.feature_noise, config.feature_noise_std, config.seed, *noise_key)
            if config.method == "medusa":  # Medusa heads read the last hidden state
                hidden = add_feature_noise(hidden, *noise)
            else:
                taps = add_feature_noise(taps, *noise)
        autocast_dtype = self.config.autocast_dtype(self.device)
        autocast = (torch.autocast(self.device.type, dtype=autocast_dtype) if autocast_dtype
                    else nullcontext())
        with autocast:
            if self.config.method == "medusa":
                result = self.model(hidden.float(), loss_mask, target)
            else:
                result = self.model(taps.float(), input_ids, loss_mask, target)
        loss = weighted_loss(result.loss_sums, self.config.ttt_decay)
        return loss, result.loss_sums.detach(), result.correct, result.counted, batch.num_tokens

    def _cached_labels(self, indices: list[int], batch: Batch) -> TargetLabels | None:
        """The batch's target argmax [B, T] from the cache, or None unless every sample is there
        (rows past a sample's length are padding: never scored)."""
        if not all(index in self.label_cache for index in indices):
            return None
        in_draft = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
        argmax_draft = torch.zeros(batch.input_ids.shape, dtype=torch.int64)
        for row, index in enumerate(indices):
            drafted, best = self.label_cache[index]
            in_draft[row, :drafted.numel()] = drafted
            argmax_draft[row, :best.numel()] = best
        return TargetLabels(in_draft.to(self.device), argmax_draft.to(self.device))

    # ---- one optimizer step --------------------------------------------------------------------
    def train_step(self, step: int, position: float | None = None) -> StepStats:
        """One optimizer step; `position`: the schedule's (under a time budget), else `step`."""
        config, context = self.config, self.context
        self.model.train()
        plan = self.plan.micro_batches(step, context.rank, context.world_size, config.micro_batch_size)
        micro_batches = [(collate([self.source.get(i) for i in indices], self.pad_multiple), list(indices))
                         for indices in plan]
        # 1. The loss normalizer: answer tokens of the whole global batch.
        local = sum(answer_count(batch.loss_mask) for batch, _ in micro_batches)
        normalizer = float(context.all_reduce_sum(torch.tensor(float(local))).clamp(min=1.0))
        lr = self.schedule.apply(self.optimizer, step if position is None else position)
        k = config.loss_terms
        sums = torch.zeros(3 * k + 1)  # loss_sums, correct, counted, tokens
        # 2. Forward and backward per micro batch; gradients sync on the last one only.
        for number, (batch, indices) in enumerate(micro_batches):
            last = number == len(micro_batches) - 1
            sync = nullcontext() if last or not context.is_distributed else self.model.no_sync()
            with sync:
                noise_key = (step, context.rank * len(micro_batches) + number)
                loss, loss_sums, correct, counted, tokens = self._micro_batch(batch, indices, noise_key)
                # DDP averages gradients over ranks: scale by world size to sum them instead.
                (loss * context.world_size / normalizer).backward()
            sums += torch.cat([loss_sums.cpu(), correct.cpu().float(), counted.cpu().float(),
                               torch.tensor([float(tokens)])])
        # 3. Clip and step.
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.head.parameters() if p.requires_grad], config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums = context.all_reduce_sum(sums)
        stats = _stats_from_sums(sums, k, config.ttt_decay, normalizer)
        stats.grad_norm = float(grad_norm)
        self.last_lr = lr
        return stats

    # ---- held-out evaluation -------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> StepStats | None:
        if not self.eval_indices:
            return None
        context, k = self.context, self.config.loss_terms
        self.model.eval()
        mine = self.eval_indices[context.rank::context.world_size]
        size = self.config.micro_batch_size
        sums = torch.zeros(3 * k + 1)
        answers = torch.zeros(1)
        for start in range(0, len(mine), size):
            indices = mine[start:start + size]
            batch = collate([self.source.get(i) for i in indices], self.pad_multiple)
            _, loss_sums, correct, counted, tokens = self._micro_batch(batch, indices)
            answers += float(answer_count(batch.loss_mask))
            sums += torch.cat([loss_sums.cpu(), correct.cpu().float(), counted.cpu().float(),
                               torch.tensor([float(tokens)])])
        sums = context.all_reduce_sum(sums)
        answers = context.all_reduce_sum(answers)
        return _stats_from_sums(sums, k, self.config.ttt_decay, float(answers.clamp(min=1.0)))

    # ---- the loop ------------------------------------------------------------------------------
    def train(self, stop_after: int | None = None) -> TrainSummary:
        """Run to the last step; `stop_after` ends the run early, as a kill would (tests)."""
        config, context = self.config, self.context
        resumed = self.start_step if config.resume and self.start_step > 0 else None
        logger = MetricsLogger(self.output, config.loss_terms, resumed, enabled=context.is_main)
        if context.is_main:
            what = (f"{config.medusa_heads} Medusa heads" if config.method == "medusa"
                    else "EAGLE-3 head")
            vocabulary = ("the target's output layer (shared)" if config.share_lm_head else
                          f"draft vocabulary {self.vocab.size} covers {self.vocab_coverage:.1%} of "
                          f"answer tokens")
            if self.output_layer.screen is not None:
                vocabulary += "; the labels' full-vocabulary argmax screened in bfloat16 (AMX, exact)"
            print(f"[eyas] train ({what}): {len(self.train_indices)} samples "
                  f"({len(self.eval_indices)} held out), {self.total_steps} steps of "
                  f"{self.global_batch} samples, {context.world_size} rank(s); {vocabulary}",
                  flush=True)
        bar = tqdm(total=self.total_steps, initial=self.start_step, unit="step", desc="train",
                   disable=not (config.progress and context.is_main), dynamic_ncols=True)
        started = time.perf_counter()
        budget_start = self.clock()  # the time budget's clock (training time, every rank alike)
        window_tokens, window_start = 0, started
        total_tokens = 0
        done = self.start_step
        stats: StepStats | None = None
        held_out: StepStats | None = None
        position = self.schedule.position(self.start_step, self.time_spent)
        # a resumed run whose budget was already spent takes no step (its head is written)
        last_step = self.start_step if self.schedule.out_of_time(self.time_spent) else self.total_steps
        for step in range(self.start_step, last_step):
            stats = self.train_step(step, position)
            done = step + 1
            self.time_spent_now = self._time_spent(budget_start)
            out_of_time = self.schedule.out_of_time(self.time_spent_now)
            last = done == self.total_steps or out_of_time
            position = self.schedule.position(done, self.time_spent_now)
            window_tokens += stats.tokens
            total_tokens += stats.tokens
            if config.max_time_s is not None and not last:  # the bar's end: where the budget runs out
                rate = (done - self.start_step) / max(self.time_spent_now - self.time_spent, 1e-9)
                expected = done + rate * max(config.max_time_s - self.time_spent_now, 0.0)
                bar.total = min(self.total_steps, max(done + 1, round(expected)))
            elif out_of_time:
                bar.total = done
            bar.update(1)
            bar.set_postfix(loss=f"{stats.loss:.3f}", acc0=f"{stats.accuracies[0]:.2f}",
                            tau=f"{stats.accept_length:.2f}")
            if done % config.log_every == 0 or last:
                now = time.perf_counter()
                logger.log(self._row(done, "train", stats, window_tokens / max(now - window_start, 1e-9),
                                     now - started))
                window_tokens, window_start = 0, now
            periodic = config.save_every and done % config.save_every == 0
            if periodic or last:
                self._save(done)
            evaluate_now = (done % config.eval_every == 0) if config.eval_every else periodic
            if evaluate_now or last:
                held_out = self.evaluate()
                if held_out is not None:
                    logger.log(self._row(done, "held_out", held_out, 0.0, time.perf_counter() - started))
            if out_of_time:
                if context.is_main:
                    bar.write(f"[eyas] the time budget of {config.max_time_s:.0f} s is spent: stopping "
                              f"after step {done} of at most {self.total_steps}")
                break
            if stop_after is not None and done >= stop_after:
                break
        bar.close()
        logger.close()
        seconds = time.perf_counter() - started
        head_dir = self.output / "head"
        finished = done == self.total_steps or self.schedule.out_of_time(self.time_spent_now)
        if context.is_main and finished:
            write_head(self.head, head_dir)
        context.barrier()
        return TrainSummary(steps=done, head_dir=str(head_dir), train=stats,
                            held_out=held_out, tokens_per_second=total_tokens / max(seconds, 1e-9),
                            seconds=seconds)

    def _time_spent(self, budget_start: float) -> float:
        """Training seconds spent, this run's and those before a resume; under a time budget
        every rank takes rank 0's (their schedules and their stop must agree)."""
        spent = self.time_spent + self.clock() - budget_start
        if self.config.max_time_s is not None and self.context.is_distributed:
            mine = torch.tensor([spent if self.context.is_main else 0.0], dtype=torch.float64)
            spent = float(self.context.all_reduce_sum(mine))
        return spent

    def _save(self, step: int) -> None:
        if self.context.is_main:
            epoch, offset = divmod(step, self.plan.steps_per_epoch)
            state = {"epoch": epoch, "data_position": {"epoch": epoch, "step_in_epoch": offset,
                                                       "samples_seen": step * self.global_batch},
                     "global_batch": self.global_batch, "world_size": self.context.world_size,
                     "schedule": self.schedule.state_dict(), "settings": self.config.result_settings()}
            state["time_spent_s"] = self.time_spent_now
            save_checkpoint(self.output, step, self.head, self.optimizer, state,
                            self.config.keep_checkpoints)
        self.context.barrier()

    def _row(self, step: int, split: str, stats: StepStats, tokens_per_s: float, elapsed: float) -> dict:
        row = {"step": step, "split": split, "epoch": round(step / self.plan.steps_per_epoch, 4),
               "lr": getattr(self, "last_lr", 0.0), "loss": stats.loss, "accept_length": stats.accept_length,
               "grad_norm": stats.grad_norm, "tokens": stats.tokens, "tokens_per_s": tokens_per_s,
               "elapsed_s": elapsed}
        for k, (loss, accuracy) in enumerate(zip(stats.step_losses, stats.accuracies)):
            row[f"loss_{k}"], row[f"acc_{k}"] = loss, accuracy
        return row

    def close(self) -> None:
        self.context.stop()


def _stats_from_sums(sums: Tensor, k: int, decay: float, normalizer: float) -> StepStats:
    loss_sums, correct, counted, tokens = sums[:k], sums[k:2 * k], sums[2 * k:3 * k], sums[3 * k]
    weights = decay ** torch.arange(k, dtype=sums.dtype)
    return StepStats(
        loss=float((weights * loss_sums).sum() / normalizer),
        step_losses=(loss_sums / counted.clamp(min=1.0)).tolist(),
        accuracies=(correct / counted.clamp(min=1.0)).tolist(),
        tokens=int(tokens),
    )
