"""The run context: everything a training run needs that is not its algorithm, composed by every trainer.

A trainer's `train()` reads top to bottom as

    ctx = RunContext.start(cfg, run_dir, trainer="ddpo", ...)     # accelerator, run dir, pipeline, sampler,
    ctx.load_state(stat_tracker=...)                              #   rewards, prompts, weights, optimizer, EMA,
    for epoch, record in ctx.epochs():                            #   state, resume
        rollout = ctx.rollout()                                   # sample + score (shared prompt/seed stream)
        ... the algorithm: losses, ctx.backward(loss, last=...), ctx.optimizer_step(finite) ...
        ctx.end_epoch(record, rollout, stats)                     # metrics, grids, reward curve, checkpoint
    return ctx.finish()                                           # final evaluation

Composition, not a base class: the context owns no loop and knows no loss. What it does, in order, is exactly
what DDPO and DPOK did before it existed (their final weights are pinned by tests/trainers/test_golden_weights.py),
so a new trainer gets resume, multi-process training, NaN guards, EMA, evaluation with a gold reward and the
run-dir format for free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from diffrl.config import derived_numbers
from diffrl.prompts import load_prompts
from diffrl.rundir import latest_checkpoint
from diffrl.training import setup
from diffrl.training.console import RunConsole
from diffrl.training.distributed import broadcast_parameters, policy_backward, prepare_policy
from diffrl.training.guards import NanStepGuard, check_run_dir_writable
from diffrl.training.loop import (
    data_grid,
    optimizer_step,
    reward_summary,
    run_evaluation,
    stop_run,
    training_grid,
    write_epoch_images,
)
from diffrl.training.metrics import (
    TENSORBOARD_MISSING,
    CurvePlotter,
    MetricsLogger,
    plot_reward_curve,
    read_metrics,
    save_before_after,
    tensorboard_installed,
    truncate_metrics,
)
from diffrl.training.rollout import Rollout, collect_rollouts
from diffrl.training.state import (
    BEST_DIR,
    TrainState,
    load_checkpoint,
    read_best,
    resume_path,
    save_best,
    save_checkpoint,
)
from diffrl.training.update import PolicyUpdate
from diffrl.training.weights import setup_policy_weights
from rewards.combine import check_prompts


@dataclass
class RunContext:
    """The shared state of one run. Build it with `RunContext.start`, then `load_state`."""

    cfg: object
    run_dir: Path
    trainer: str
    accelerator: object
    derived: dict
    resume: bool
    pipe: object
    sampler: object
    reward: object
    gold: object
    train_prompts: list[str]
    eval_prompts: list[str]
    params: list  # the trainable tensors (LoRA or the whole UNet; FSDP2 shards)
    optimizer: object
    lr_scheduler: object
    step_callback: object = None
    state: TrainState | None = None
    nan_guard: NanStepGuard | None = None
    logprob_check_atol: float = 1e-5  # the recipe's, raised on reduced-precision GPU kernels
    history: list = field(default_factory=list)  # this run's epoch records so far (main process)
    _logger: object = None
    _curve: object = None
    _console: RunConsole | None = None  # progress and evaluation lines (prints on the main process only)
    _record: dict = field(default_factory=dict)
    _clock_evals: int = 0  # run.eval_every_minutes periods already evaluated
    _last_epoch_s: float = 0.0  # the last epoch's training wall-clock (run.max_train_minutes)
    _losses_finite: bool = True  # every loss since the last optimizer step was finite (`accumulate`)

    @property
    def unet(self):
        """The trained network: the pipeline's UNet, or its transformer for flow-matching pipelines."""
        # deferred: diffrl.models imports diffusers (seconds); importing a trainer loads torch only
        from diffrl.models import model_family

        return model_family(self.pipe).denoiser

    @property
    def grid_images_per_process(self) -> int:
        """Images each process keeps of an epoch's samples for the grid (0 when grids are off)."""
        log = self.cfg.log
        return -(-log.grid_images // self.accelerator.num_processes) if log.image_every else 0

    @property
    def rng(self) -> np.random.Generator:
        """The trainer's generator (prompt draws, seeds, shuffles), saved in checkpoints."""
        return self.state.rng

    # -----------------------------------------------------------------------------------------------------------
    # start
    # -----------------------------------------------------------------------------------------------------------

    @classmethod
    def start(cls, cfg, run_dir, *, trainer: str, resume: bool = False, accelerator=None,
              step_callback=None, micro_batch_size: int, backwards_per_step: int) -> RunContext:
        """Accelerator, run dir and `config.yaml`, seeds, prompts, rewards, pipeline, sampler, trainable weights,
        optimizer and LR schedule, in that order (the order fixes the random streams).

        Args:
            cfg (`RunConfig`): the resolved recipe.
            run_dir (`Path`): the run dir (created if needed; `config.yaml` is written here unless `diffrl run`
                already wrote it).
            trainer (`str`): the trainer's name (checkpoints and trackers record it).
            resume (`bool`): continue from the newest checkpoint (or `cfg.run.resume`).
            step_callback (`Callable`, *optional*): called before training and after every optimizer step.
            micro_batch_size (`int`): samples per backward pass, per process (DeepSpeed's micro batch).
            backwards_per_step (`int`): backward calls per optimizer step (DeepSpeed's accumulation count).
        """
        run_dir = Path(run_dir)
        check_run_dir_writable(run_dir)  # before anything slow: a bad output dir fails in seconds
        accelerator = setup.make_accelerator(cfg, run_dir, accelerator)
        setup.check_distributed_type(accelerator, trainer, use_ema=cfg.optim.use_ema)
        derived = derived_numbers(cfg, accelerator.num_processes)
        if accelerator.is_main_process and not resume and not (run_dir / setup.CONFIG_FILE).exists():
            setup.write_run_config(run_dir, cfg, derived)  # `diffrl run` writes it before any model loads
        setup.print_derived(derived, accelerator)
        setup.seed_everything(cfg.run.seed, accelerator.process_index)

        train_prompts = load_prompts(cfg.prompts.source)
        eval_prompts = load_prompts(cfg.prompts.eval_source or cfg.prompts.source)
        reward, gold = setup.build_reward(cfg), setup.build_gold_reward(cfg)
        check_prompts(reward, train_prompts + eval_prompts)  # a prompt the reward cannot read fails before sampling
        if gold is not None:
            check_prompts(gold, eval_prompts)
        pipe = setup.load_policy_pipeline(cfg, accelerator)
        sampler = setup.make_sampler(cfg.sample.sampler, pipe)
        from diffrl.models import model_family  # deferred: see `unet`

        network = model_family(pipe).denoiser  # the UNet, or a flow pipeline's transformer
        params = setup_policy_weights(network, cfg.model, use_lora=not cfg.model.full_finetune)
        broadcast_parameters(params, accelerator)  # every process starts from rank 0's (random) adapter
        opt = cfg.optim
        optimizer = setup.make_optimizer(params, learning_rate=opt.learning_rate, betas=(opt.adam_beta1, opt.adam_beta2),
                                         weight_decay=opt.weight_decay, eps=opt.adam_epsilon)
        # under FSDP2 this shards the UNet in place and `params` become its (DTensor) shards; DeepSpeed wraps it
        optimizer, params = prepare_policy(network, params, optimizer, accelerator, micro_batch_size=micro_batch_size,
                                           backwards_per_step=backwards_per_step, max_grad_norm=opt.max_grad_norm)
        lr_scheduler = setup.make_lr_scheduler(optimizer, opt.lr_scheduler, warmup_steps=opt.lr_warmup_steps,
                                               total_steps=derived["total_optimizer_steps"])
        return cls(cfg=cfg, run_dir=run_dir, trainer=trainer, accelerator=accelerator, derived=derived,
                   resume=resume, pipe=pipe, sampler=sampler, reward=reward, gold=gold, train_prompts=train_prompts,
                   eval_prompts=eval_prompts, params=params, optimizer=optimizer, lr_scheduler=lr_scheduler,
                   step_callback=step_callback,
                   logprob_check_atol=setup.logprob_check_atol(cfg, cfg.sample.logprob_check_atol, accelerator))

    def load_state(self, *, stat_tracker=None, extra_modules: dict | None = None,
                   extra_optimizers: dict | None = None) -> TrainState:
        """The resumable state (with the trainer's own extra modules, e.g. a value network), restored from the
        newest checkpoint when resuming; metrics, reward curve and trackers set up; the step callback called once
        with the starting weights."""
        cfg, accelerator = self.cfg, self.accelerator
        ema = None
        if cfg.optim.use_ema:
            from diffusers.training_utils import EMAModel  # deferred: importing a trainer loads torch, not diffusers

            ema = EMAModel(self.params, decay=cfg.optim.ema_decay)
        self.state = TrainState(
            trainer=self.trainer, unet=self.unet, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            rng=setup.trainer_rng(cfg.run.seed, accelerator.process_index), use_lora=not cfg.model.full_finetune,
            ema=ema, stat_tracker=stat_tracker, extra_modules=extra_modules or {},
            extra_optimizers=extra_optimizers or {},
        )
        if self.resume:
            load_checkpoint(resume_path(self.run_dir, cfg.run.resume), self.state, accelerator=accelerator)
            if accelerator.is_main_process:
                print(f"resuming after epoch {self.state.epoch} (optimizer step {self.state.global_step})", flush=True)
        if accelerator.is_main_process:  # records of epochs the checkpoint does not hold are done again
            truncate_metrics(self.run_dir, self.state.epoch)
            self.history = read_metrics(self.run_dir)
            if cfg.log.tracker == "tensorboard" and not tensorboard_installed():
                print(TENSORBOARD_MISSING, flush=True)
        self._logger = MetricsLogger(self.run_dir, accelerator) if accelerator.is_main_process else None
        self._curve = CurvePlotter(self.run_dir)
        if accelerator.log_with:
            accelerator.init_trackers(self.run_dir.name, config={"trainer": self.trainer, **self.derived})
        self.nan_guard = NanStepGuard(cfg.run.max_nan_steps)
        self._callback(self.state.epoch)  # once before any update, so callers see the starting weights
        return self.state

    # -----------------------------------------------------------------------------------------------------------
    # the epoch
    # -----------------------------------------------------------------------------------------------------------

    def epochs(self):
        """Yield `(epoch, record)` for every epoch still to run. The record starts with the evaluation of the
        policy about to sample this epoch (every `run.eval_every` epochs) and the epoch's start time."""
        cfg = self.cfg
        self._console = RunConsole(self.run_dir, trainer=self.trainer, num_epochs=cfg.run.num_epochs,
                                   max_train_minutes=cfg.run.max_train_minutes, history=self.history,
                                   train_s=self.state.train_wall_s, samples_seen=self.state.samples_seen,
                                   enabled=self.accelerator.is_main_process)
        if cfg.run.eval_every_minutes:  # periods a resumed run has already evaluated
            self._clock_evals = int(self.state.train_wall_s // (60.0 * cfg.run.eval_every_minutes))
        for epoch in range(self.state.epoch + 1, cfg.run.num_epochs):
            if self._out_of_time():
                self._end_early(epoch)
                break
            record = {"epoch": epoch, "_start": (time.perf_counter(), time.process_time())}
            if (cfg.run.eval_every and epoch % cfg.run.eval_every == 0) or self._eval_due_by_clock(epoch):
                record.update(self.evaluate(epoch))
            self._record = record
            yield epoch, record
        self._console.close()

    def _eval_due_by_clock(self, epoch: int) -> bool:
        """`run.eval_every_minutes`: the first epoch after each multiple of it (epoch 0 included), by the training
        clock; the main process's clock decides for all."""
        every = 60.0 * self.cfg.run.eval_every_minutes
        if not every:
            return False
        due = self._main_decides(epoch == 0 or int(self.state.train_wall_s // every) > self._clock_evals)
        if due:
            self._clock_evals = int(self.state.train_wall_s // every)
        return bool(due)

    def _out_of_time(self) -> bool:
        """`run.max_train_minutes` spent; the main process's clock decides so every process stops at one epoch."""
        limit = self.cfg.run.max_train_minutes
        if not limit:
            return False
        # stop before an epoch that would overrun the budget, judged by the last epoch's cost (0 right after a resume)
        return bool(self._main_decides(self.state.train_wall_s + self._last_epoch_s > 60.0 * limit))

    def _main_decides(self, value):
        """The main process's `value` on every process (clocks and files differ between processes)."""
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list  # deferred: importing a trainer loads torch, not accelerate

        return broadcast_object_list([value], from_process=0)[0]

    def _end_early(self, epoch: int) -> None:
        """Checkpoint the last finished epoch unless end_epoch just did; finish() then evaluates it as the end."""
        cfg = self.cfg
        newest = latest_checkpoint(self.run_dir)
        if newest is None or newest.name != f"step-{self.state.global_step}":
            save_checkpoint(self.run_dir, self.state, pipe=self.pipe, accelerator=self.accelerator,
                            keep=cfg.run.keep_checkpoints)
        self._console.line(f"run.max_train_minutes={cfg.run.max_train_minutes:g} reached after epoch {epoch - 1} "
                           f"({self.state.train_wall_s:.0f} s of training)")

    def rollout(self, *, group_size: int = 1, shared_start_noise: bool = False,
                eta: tuple[float, ...] | None = None, reward=None) -> Rollout:
        """Sample this epoch's trajectories with the current weights and score them; stop the run when every
        reward is NaN/inf. `reward` replaces the run's reward for scoring (a trainer that keeps more of the reward's
        output than its scores passes a wrapper around `self.reward`: PXPO's per-pixel maps)."""
        self.unet.eval()
        reward = self.reward if reward is None else reward
        rollout = collect_rollouts(pipe=self.pipe, sampler=self.sampler, reward=reward,
                                   prompts=self.train_prompts, sample_cfg=self.cfg.sample, group_size=group_size,
                                   rng=self.rng, accelerator=self.accelerator, keep_images=self.grid_images_per_process,
                                   shared_start_noise=shared_start_noise, eta=eta)
        return self.count(rollout)

    def count(self, rollout: Rollout) -> Rollout:
        """Count an epoch's samples (every process's) and NaN rewards; stop the run when every reward is NaN/inf."""
        if not rollout.finite.any():
            self.stop(f"all {len(rollout.all_rewards)} rewards of the epoch are NaN/inf; check the reward")
        self.state.samples_seen += len(rollout.all_rewards)
        self.state.nan_rewards_total += int((~rollout.finite).sum())
        return rollout

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Backward of one micro-batch's (already divided) loss; `last` marks the optimizer step's last one."""
        policy_backward(loss, self.accelerator, last=last)

    def optimizer_step(self, losses_finite: bool) -> tuple[bool, float, bool]:
        """Cross-process gradient mean, clipping to `optim.max_grad_norm`, AdamW, LR schedule, EMA, the NaN guard
        and the step callback. Returns `(stepped, grad_norm, stop)`; on `stop` the trainer calls `stop_nan()`."""
        stepped, grad_norm, stop = optimizer_step(self.params, self.state, accelerator=self.accelerator,
                                                  max_grad_norm=self.cfg.optim.max_grad_norm,
                                                  nan_guard=self.nan_guard, losses_finite=losses_finite)
        if stepped:
            self._callback(self._record.get("epoch", self.state.epoch))
        return stepped, grad_norm, stop

    def policy_update(self, *, losses_per_micro_batch: int, ratio_check: str | None = None) -> PolicyUpdate:
        """The shared update loop of a PPO-family epoch (`diffrl.training.update.PolicyUpdate`): accumulation,
        the NaN guard, skipped steps and the first-step ratio check."""
        return PolicyUpdate(self, losses_per_micro_batch=losses_per_micro_batch, ratio_check=ratio_check)

    def accumulate(self, loss: torch.Tensor, index: int, diag) -> None:
        """Backward of micro-batch `index`'s loss divided by `optim.gradient_accumulation_steps`; after every that
        many, the optimizer step (its grad norm and skip recorded in `diag`, a `RunningMean`). A NaN/inf loss makes
        its optimizer step a skipped one; too many in a row stop the run."""
        accumulation = self.cfg.optim.gradient_accumulation_steps
        self._losses_finite = self._losses_finite and bool(torch.isfinite(loss.detach()))
        last = (index + 1) % accumulation == 0
        self.backward(loss / accumulation, last=last)
        if last:
            stepped, grad_norm, stop = self.optimizer_step(self._losses_finite)
            diag.add({"grad_norm": grad_norm, "nan_losses": float(not stepped)})
            self._losses_finite = True
            if stop:
                self.stop_nan()

    def stop(self, reason: str) -> None:
        """Checkpoint the current (still good) weights and end the run with a one-line error."""
        stop_run(self.run_dir, self.state, pipe=self.pipe, accelerator=self.accelerator,
                 keep=self.cfg.run.keep_checkpoints, reason=reason)

    def stop_nan(self, hint: str = "lower optim.learning_rate, check the reward's scale") -> None:
        self.stop(f"{self.nan_guard.consecutive} optimizer steps in a row had a NaN/inf loss or gradient ({hint})")

    def end_epoch(self, record: dict, rollout: Rollout | None, stats: dict, *, train_s: float, show: str = "loss",
                  grid: tuple | None = None) -> None:
        """Log the epoch (metrics.jsonl, trackers, grid, reward curve, the progress) and checkpoint when due.

        An offline trainer (no rollout: it trains on a dataset) passes `rollout=None`, counts its own
        `state.samples_seen`, and may pass `grid=(images [k, 3, H, W] in [0, 1], captions)` of this process's
        training data for `images/epoch-N.png`; its reward fields are null (it samples only to evaluate)."""
        cfg, state, accelerator = self.cfg, self.state, self.accelerator
        epoch = record["epoch"]
        state.epoch = epoch
        if rollout is not None:
            sampled = {**reward_summary(rollout), "rollout_s": rollout.rollout_s, "reward_s": rollout.reward_s}
        else:
            sampled = {"reward_mean": None, "reward_std": None, "nan_rewards": 0, "rollout_s": 0.0, "reward_s": 0.0}
        record.update(samples_seen=state.samples_seen, global_step=state.global_step, **sampled, **stats,
                      lr=state.lr_scheduler.get_last_lr()[0], train_s=train_s)
        if state.stat_tracker is not None:
            record["stat_tracker_prompts"] = state.stat_tracker.stats()["num_prompts"]
        keep_images = cfg.log.image_every and cfg.log.grid_images
        if not keep_images:
            grid = None
        elif rollout is not None:
            grid = training_grid(accelerator, rollout, cfg.log.grid_images)
        elif grid is not None:
            grid = data_grid(accelerator, *grid, cfg.log.grid_images)
        if accelerator.is_main_process:
            write_epoch_images(cfg, self.run_dir, self._curve, self.history, _public(record), grid, epoch)
        wall_start, cpu_start = record.pop("_start")
        record["wall_s"] = time.perf_counter() - wall_start  # everything of the epoch but its checkpoint
        self._last_epoch_s = record["wall_s"] - record.get("eval_s", 0.0)
        state.train_wall_s += self._last_epoch_s
        record["cpu_s"] = time.process_time() - cpu_start  # this process's CPU time (all its threads)
        # the record before the checkpoint: a checkpoint always has its epochs' records, and a kill between the two
        # leaves a record that resume drops and writes again
        if accelerator.is_main_process:
            self._logger.log(record)
            self.history.append(record)
            self._console.epoch(record, train_s=state.train_wall_s, show=show)
        if epoch == cfg.run.num_epochs - 1 or (cfg.run.save_every and (epoch + 1) % cfg.run.save_every == 0):
            save_checkpoint(self.run_dir, state, pipe=self.pipe, accelerator=accelerator,
                            keep=cfg.run.keep_checkpoints)

    # -----------------------------------------------------------------------------------------------------------
    # evaluation and finish
    # -----------------------------------------------------------------------------------------------------------

    def evaluate(self, epoch: int, *, final: bool = False) -> dict:
        """Held-out evaluation (EMA weights when EMA is on) with the training and gold rewards; with `run.keep_best`
        the weights go to best/ when their held-out score is the best so far. The main process prints one line."""
        metrics = run_evaluation(self.cfg, self.state, pipe=self.pipe, sampler=self.sampler, reward=self.reward,
                                 gold=self.gold, prompts=self.eval_prompts, accelerator=self.accelerator,
                                 run_dir=self.run_dir, epoch=epoch, final=final)
        note = ""
        if self.cfg.run.keep_best:
            key = "eval_gold_mean" if "eval_gold_mean" in metrics else "eval_reward_mean"
            best = self._main_decides(read_best(self.run_dir) if self.accelerator.is_main_process else None)
            score = metrics[key]
            if best is None or score > best["score"]:
                note = "" if best is None else f"best so far, saved to {BEST_DIR}/"
                best = {"epoch": epoch, "global_step": self.state.global_step, "samples_seen": self.state.samples_seen,
                        "metric": key, "score": score}
                save_best(self.run_dir, self.state, pipe=self.pipe, accelerator=self.accelerator, record=best)
            metrics = {**metrics, "best_epoch": best["epoch"], "best_score": best["score"]}
        if self._console is not None:
            self._console.evaluation(metrics, epoch=epoch, train_s=self.state.train_wall_s, final=final, note=note)
        return metrics

    def finish(self) -> dict:
        """The finished model evaluated like every other epoch (the record of "epoch num_epochs"), the final reward
        curve; returns the last epoch's metrics plus the final evaluation."""
        cfg, accelerator = self.cfg, self.accelerator
        final = _public(self._record)
        if cfg.run.eval_every or cfg.run.eval_every_minutes:
            end = self.state.epoch + 1  # run.num_epochs, or earlier when run.max_train_minutes ended the run
            final_eval = self.evaluate(end, final=True)
            final.update(final_eval)
            if accelerator.is_main_process:
                self._logger.log({"epoch": end, "samples_seen": self.state.samples_seen,
                                  "global_step": self.state.global_step, "final": True, **final_eval})
        if accelerator.is_main_process:
            self._curve.wait()
            plot_reward_curve(self.run_dir)  # with the final evaluation
            save_before_after(self.run_dir / "images")
        accelerator.end_training()
        return final

    def _callback(self, epoch: int) -> None:
        if self.step_callback is not None:
            self.step_callback({"global_step": self.state.global_step, "epoch": epoch, "params": self.params,
                                "unet": self.unet, "pipe": self.pipe, "accelerator": self.accelerator})


def _public(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("_")}
