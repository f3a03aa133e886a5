"""Training throughput: a trainer's epoch wall time split into rollout, reward and training, next to the floor.

The trainer runs a few epochs of the recipe (evaluation and checkpoints off, everything else as in the recipe) and
its own per-epoch timings are read back from metrics.jsonl; the first epoch is warm-up and not counted, the rest
are summarised by their median. The floor is what that epoch's model and reward passes cost with nothing around
them, timed on the trainer's own networks (LoRA included), batch shapes, dtype and device, between its epochs' work
(at the first optimizer step of each epoch; that time is taken off the epoch, see `InterleavedFloor`), so that the
machine's drift over the run affects both sides alike:

- rollout: per sampling batch, the text encoder, T guided UNet forwards (2B rows under CFG) and the VAE decode
  (on a flow-matching pipeline the transformer's guided velocity call and its text towers, as `samplers.flow`);
- reward: the reward on those images;
- training: DDPO — per trained (minibatch, timestep) one guided UNet forward + backward (2b rows), per optimizer
  step one AdamW step; DPOK — per policy microbatch one guided forward + backward and one no-grad reference forward
  (adapter off), per optimizer step one AdamW step, plus the value network's steps; any other trainer — its own
  count of those passes (`epoch_passes` of the trainer contract: Flow-GRPO's trained steps, which with an SDE window
  (MixGRPO) are the window's W of T, DiffusionNFT's, ...).

`ratio` = epoch wall time / floor (target ≤ 1.05: the trainer's bookkeeping — trajectories, log-probs, advantages,
gathers, logging — should cost nothing next to the networks); `cpu_ratio` is the same with the process's CPU time
(the trainer logs it per epoch as cpu_s), the steadier number when other jobs share the CPU. Peak memory: the
process's peak RSS, and CUDA's max allocated on a GPU (both include the floor's second reward instance and its
copies of the trainable tensors). A lever's cost per epoch shows here with `--set`
(train.timestep_fraction, train.group_size, train.advantage, sample.num_steps); what it buys in held-out score per
sample and per second is `diffrl bench learn --sweep`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from diffrl.bench.common import (
    NO_EVALUATION,
    add_common_arguments,
    load_bench_recipe,
    peak_memory,
    run_trainer,
    temp_workdir,
)
from diffrl.config import trainer_module
from diffrl.errors import UserError
from diffrl.files import write_json
from diffrl.models import model_family
from diffrl.models.base import Conditioning, module_dtype
from diffrl.prompts import draw_prompts, load_prompts
from diffrl.training import setup
from diffrl.training.metrics import read_metrics
from diffrl.training.rollout import sync_device
from diffrl.training.weights import adapter_disabled

TARGET_RATIO = 1.05


def add_arguments(parser) -> None:
    add_common_arguments(parser, "ddpo/tiny_shapes_verifier")
    parser.add_argument("--epochs", type=int, default=6, help="epochs to run; the first is warm-up (default 6)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed calls of each floor pass per epoch, between the trainer's (default 2)")


def run_train_bench(args) -> int:
    """`diffrl bench train`: print the table and the target; write JSON with `--out`. Exit code 0."""
    result = train_bench(args, log=lambda line: print(line, file=sys.stderr))
    print(format_result(result))
    if args.out:
        write_json(args.out, result)
    return 0


def train_bench(args, log=print) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.epochs < 2:
        raise UserError("--epochs must be >= 2 (the first epoch is warm-up)")
    if args.repeats < 1:
        raise UserError("--repeats must be >= 1 (timed calls of each floor pass per epoch)")
    with temp_workdir() as work:
        overrides = list(args.overrides) + [
            f"run.num_epochs={args.epochs}", *NO_EVALUATION, "run.save_every=0", "log.tracker=none", "run.name=bench",
            f"run.output_dir={work}",
        ]
        cfg, label = load_bench_recipe(args.recipe, overrides, args.pipeline, Path(work), log=log)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        interleaved = InterleavedFloor(cfg, args.repeats)
        start = time.perf_counter()
        run_trainer(cfg, Path(work) / "bench", step_callback=interleaved)
        total_s = time.perf_counter() - start
        memory = peak_memory()
        every = [r for r in read_metrics(Path(work) / "bench") if not r.get("final")]
        records = every[1:]
    # the floor's own time in an epoch comes off that epoch's wall, CPU and training time (it ran inside training)
    for r in records:
        wall, cpu = interleaved.overhead.get(r["epoch"], (0.0, 0.0))
        r["wall_s"], r["train_s"], r["cpu_s"] = r["wall_s"] - wall, r["train_s"] - wall, r["cpu_s"] - cpu
    epoch = {k: statistics.median(r[k] for r in records)
             for k in ("wall_s", "cpu_s", "rollout_s", "reward_s", "train_s")}
    floor = interleaved.floor()
    floor_total = floor["rollout_s"] + floor["reward_s"] + floor["train_s"]
    return {
        "recipe": str(args.recipe), "trainer": cfg.trainer, "pipeline": label, "overrides": list(args.overrides),
        "device": floor["device"], "threads": torch.get_num_threads(), "epochs_timed": len(records),
        "samples_per_epoch": cfg.sample.batch_size * cfg.sample.num_batches_per_epoch,
        "epoch": epoch, "floor": floor, "floor_s": floor_total, "ratio": epoch["wall_s"] / floor_total,
        # each timed epoch's own numbers (the medians above are theirs): the spread of a comparison between recipes
        "epochs": [{k: r[k] for k in ("epoch", "wall_s", "cpu_s", "rollout_s", "reward_s", "train_s")}
                   for r in records],
        "cpu_ratio": epoch["cpu_s"] / floor["cpu_s"],
        "target_ratio": TARGET_RATIO, "met": epoch["wall_s"] / floor_total <= TARGET_RATIO,
        "met_cpu": epoch["cpu_s"] / floor["cpu_s"] <= TARGET_RATIO,
        "total_s": total_s, **memory,
        # epochs that ran a held-out evaluation (none: the bench turns them off)
        "evaluated_epochs": [r["epoch"] for r in every if any(k.startswith("eval_") for k in r)],
    }


def format_result(result: dict) -> str:
    e, f = result["epoch"], result["floor"]
    other = e["wall_s"] - e["rollout_s"] - e["reward_s"] - e["train_s"]
    header = (f"{result['trainer']} on {result['pipeline']} ({result['device']}, {result['threads']} threads), "
              f"{result['samples_per_epoch']} samples per epoch, median of {result['epochs_timed']} epochs")
    lines = [
        header,
        f"{'':10s} {'epoch s':>9s} {'floor s':>9s} {'ratio':>7s}",
    ]
    for name in ("rollout", "reward", "train"):
        key = f"{name}_s"
        ratio = e[key] / f[key] if f[key] > 0 else float("nan")
        lines.append(f"{name:10s} {e[key]:9.3f} {f[key]:9.3f} {ratio:7.3f}")
    lines.append(f"{'other':10s} {other:9.3f} {0.0:9.3f}")
    lines.append(f"{'total':10s} {e['wall_s']:9.3f} {result['floor_s']:9.3f} {result['ratio']:7.3f}")
    lines.append(f"{'CPU time':10s} {e['cpu_s']:9.3f} {f['cpu_s']:9.3f} {result['cpu_ratio']:7.3f}")
    verdict = "met" if result["met"] else "NOT met"
    verdict_cpu = "met" if result["met_cpu"] else "NOT met"
    mem = f"peak RSS {result['peak_rss_mb']:.0f} MB"
    if "peak_cuda_mb" in result:
        mem += f", peak CUDA {result['peak_cuda_mb']:.0f} MB"
    lines.append(f"epoch time / floor = {result['ratio']:.3f} (CPU time {result['cpu_ratio']:.3f}), target <= "
                 f"{result['target_ratio']}: {verdict} (CPU time: {verdict_cpu}); {mem}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The floor
# ---------------------------------------------------------------------------------------------------------------


class InterleavedFloor:
    """The trainer's `step_callback`: times the floor passes between the trainer's own passes, on its own networks.

    A shared machine's speed drifts by tens of percent over minutes, far more than the 5 % being measured, so the
    floor is not timed before or after the run but inside it: at the first optimizer step of every epoch, each pass
    runs `repeats` times. What this costs is recorded per epoch (`overhead`) and taken off that epoch's timings.
    The passes leave the trainer as they found it: gradients reset to None (the optimizer step has just zeroed
    them), the AdamW step on copies of the trainable tensors, the UNet's train/eval mode and torch's random state
    restored. The reward is a second instance of the recipe's (the trainer does not hand its own out).
    """

    def __init__(self, cfg, repeats: int):
        self.cfg, self.repeats = cfg, repeats
        self.passes: dict = {}  # name -> function, built at the callback before training
        self.wall: dict = {}  # name -> [seconds per call]
        self.cpu: dict = {}  # name -> [process CPU seconds per call]
        self.overhead: dict = {}  # epoch -> (wall s, CPU s) this callback spent in it
        self.device = None

    def __call__(self, info: dict) -> None:
        epoch = info["epoch"]
        if epoch in self.overhead:
            return
        start, cpu_start = time.perf_counter(), time.process_time()
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        unet, was_training = info["unet"], info["unet"].training
        if not self.passes:  # the call before any update: build and warm up, not timed
            self.passes = _floor_passes(self.cfg, info)
            self.device = info["accelerator"].device
            for fn in self.passes.values():
                fn()
        else:
            for name, fn in self.passes.items():
                for _ in range(self.repeats):
                    sync_device(self.device)
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    sync_device(self.device)
                    self.wall.setdefault(name, []).append(time.perf_counter() - t0)
                    self.cpu.setdefault(name, []).append(time.process_time() - c0)
        unet.train(was_training)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        self.overhead[epoch] = (time.perf_counter() - start, time.process_time() - cpu_start)

    def floor(self) -> dict:
        """Seconds per epoch of the bare passes (each pass's median over every timed call), wall and CPU."""
        if not self.wall:
            raise RuntimeError("the floor was never timed: no epoch took an optimizer step")
        wall = {k: statistics.median(v) for k, v in self.wall.items()}
        cpu = {k: statistics.median(v) for k, v in self.cpu.items()}
        out = {"device": str(self.device), **{f"{k}_call_s": v for k, v in wall.items()}}
        out.update(epoch_floor(self.cfg, wall))
        out["cpu_s"] = sum(epoch_floor(self.cfg, cpu).values())
        out["calls_timed"] = len(next(iter(self.wall.values())))
        return out


def epoch_floor(cfg, t: dict) -> dict:
    """An epoch's rollout, reward and training seconds from the seconds of one call of each pass (see module doc)."""
    s = cfg.sample
    batches = s.num_batches_per_epoch
    out = {"rollout_s": batches * (t["text"] + s.num_steps * t["unet"] + t["decode"]),
           "reward_s": batches * t["reward"]}
    counts = _epoch_passes(cfg)
    out["train_s"] = sum(n * t[name] for name, n in counts.items() if n and name not in ("train_batch", "value_batch"))
    return out


def _epoch_passes(cfg) -> dict:
    """The trainer's own count of its training passes per epoch (`epoch_passes` of the trainer contract)."""
    return trainer_module(cfg.trainer).epoch_passes(cfg)


def _floor_passes(cfg, info: dict) -> dict:
    """The passes an epoch of `cfg` consists of, as functions on the trainer's pipeline (`info` of the callback)."""
    pipe, unet, accelerator, params = info["pipe"], info["unet"], info["accelerator"], info["params"]
    device = accelerator.device
    reward = setup.build_reward(cfg)
    sampler = setup.make_sampler(cfg.sample.sampler, pipe)
    s = cfg.sample
    counts = _epoch_passes(cfg)
    prompts = draw_prompts(load_prompts(cfg.prompts.source), s.batch_size, 1, np.random.default_rng(0))
    negative = [s.negative_prompt] * s.batch_size if s.negative_prompt else None
    unet.eval()
    # one real rollout batch: its latents, conditioning and images feed the timed passes (real data, real shapes)
    with torch.no_grad(), accelerator.autocast():
        traj = sampler.sample(pipe, prompts, num_steps=s.num_steps, guidance_scale=s.guidance_scale, eta=s.eta,
                              seeds=list(range(s.batch_size)), negative_prompt=negative)
    middle = s.num_steps // 2
    t = traj.timesteps[middle].to(device)
    family = model_family(pipe)  # `unet` is the family's denoiser: a UNet, or a flow transformer (SD3, FLUX)
    inputs: dict = {}  # n -> (latents, conditioning): built once (with its denoiser kwargs), so passes are the network's

    def unet_forward(n: int, grad: bool):
        if n not in inputs:
            sub = traj.select(list(range(n)) if n <= len(traj) else [i % len(traj) for i in range(n)])
            inputs[n] = (sub.latents[:, middle].to(device), Conditioning.from_trajectory(sub).to(device))
        latents, cond = inputs[n]
        with torch.set_grad_enabled(grad), accelerator.autocast():
            return family.model_output(latents, t, cond, s.guidance_scale, module_dtype(unet))

    def text():
        with torch.no_grad():
            family.encode(prompts, guidance_scale=s.guidance_scale, negative_prompt=negative)

    def forward():
        unet.eval()
        unet_forward(s.batch_size, grad=False)

    def decode():
        with torch.no_grad():
            family.decode(traj.latents[:, -1].to(device))

    def score():
        with torch.no_grad():
            reward(traj.images, prompts, None)

    # AdamW on copies of the trainable tensors: the same work, and the trainer's weights and moments untouched
    copies = [p.detach().clone().float().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(copies, lr=1e-12)

    def adam():
        for p in copies:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_batch = counts["train_batch"]

    def fwd_bwd():
        unet.train()
        accelerator.backward(unet_forward(train_batch, grad=True).float().mean())
        for p in params:
            p.grad = None

    passes = {"text": text, "unet": forward, "decode": decode, "reward": score, "adam": adam, "fwd_bwd": fwd_bwd}
    if counts.get("reference"):

        def reference():
            unet.eval()
            with torch.no_grad(), adapter_disabled(unet):
                unet_forward(train_batch, grad=False)

        passes["reference"] = reference
    if counts.get("value"):  # a value network V(x_t, c, t) fitted beside the policy (DPOK's baseline)
        value_batch = counts["value_batch"]
        value_net = trainer_module(cfg.trainer).ValueNet(unet.config.in_channels, unet.config.cross_attention_dim)
        value_net = value_net.to(device)
        value_opt = torch.optim.AdamW(value_net.parameters(), lr=1e-12)
        rows = torch.arange(value_batch) % s.batch_size
        latents = traj.latents[rows, middle].to(device)
        pooled = traj.prompt_embeds.float().mean(dim=1)[rows.to(traj.prompt_embeds.device)].to(device)
        steps = torch.full((value_batch,), 500, device=device)

        def value():
            value_net(latents, pooled, steps).pow(2).mean().backward()
            value_opt.step()
            value_opt.zero_grad(set_to_none=True)

        passes["value"] = value
    return passes
