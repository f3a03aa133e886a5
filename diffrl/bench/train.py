"""Training throughput: DDPO/DPOK epoch wall time split into rollout, reward and training, next to the floor.

The trainer runs a few epochs of the recipe (evaluation and checkpoints off, everything else as in the recipe) and
its own per-epoch timings are read back from metrics.jsonl; the first epoch is warm-up and not counted, the rest
are summarised by their median. The floor is what that epoch's model and reward passes cost with nothing around
them, timed in the same process, on the same architecture (LoRA included), batch shapes, dtype and device:

- rollout: per sampling batch, the text encoder, T guided UNet forwards (2B rows under CFG) and the VAE decode;
- reward: the reward on those images;
- training: DDPO — per trained (minibatch, timestep) one guided UNet forward + backward (2b rows), per optimizer
  step one AdamW step; DPOK — per policy microbatch one guided forward + backward and one no-grad reference forward
  (adapter off), per optimizer step one AdamW step, plus the value network's steps.

`ratio` = epoch wall time / floor (target ≤ 1.05: the trainer's bookkeeping — trajectories, log-probs, advantages,
gathers, logging — should cost nothing next to the networks); `cpu_ratio` is the same with the process's CPU time
(the trainer logs it per epoch as cpu_s), the steadier number when other jobs share the CPU. Peak memory: the
process's peak RSS, and CUDA's max allocated on a GPU. A lever's cost per epoch shows here with `--set`
(train.timestep_fraction, train.group_size, train.advantage, sample.num_steps); what it buys in held-out score per
sample and per second is `diffrl bench learn --sweep`.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

TARGET_RATIO = 1.05


def add_arguments(parser) -> None:
    from diffrl.trainers.common.bench import add_common_arguments

    add_common_arguments(parser, "ddpo/tiny_shapes_verifier")
    parser.add_argument("--epochs", type=int, default=4, help="epochs to run; the first is warm-up (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each floor pass (default 5)")


def run_train_bench(args) -> int:
    """`diffrl bench train`: print the table and the target; write JSON with `--out`. Exit code 0."""
    result = train_bench(args, log=lambda line: print(line, file=sys.stderr))
    print(format_result(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def train_bench(args, log=print) -> dict:
    import torch

    from diffrl.errors import UserError
    from diffrl.trainers.common.bench import load_bench_recipe, peak_memory, run_trainer, temp_workdir
    from diffrl.trainers.common.metrics import read_metrics

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.epochs < 2:
        raise UserError("--epochs must be >= 2 (the first epoch is warm-up)")
    with temp_workdir() as work:
        overrides = list(args.overrides) + [
            f"run.num_epochs={args.epochs}", "run.eval_every=0", "run.save_every=0", "log.tracker=none",
            "run.name=bench", f"run.output_dir={work}",
        ]
        cfg, label = load_bench_recipe(args.recipe, overrides, args.pipeline, Path(work), log=log)
        if cfg.trainer not in ("ddpo", "dpok"):
            raise UserError(f"bench train times the ddpo and dpok trainers; {args.recipe} is a '{cfg.trainer}' recipe")
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        run_trainer(cfg, Path(work) / "bench")
        total_s = time.perf_counter() - start
        memory = peak_memory()
        records = [r for r in read_metrics(Path(work) / "bench") if not r.get("final")][1:]
        epoch = {k: statistics.median(r[k] for r in records)
                 for k in ("wall_s", "cpu_s", "rollout_s", "reward_s", "train_s")}
        log("timing the floor passes ...")
        floor = measure_floor(cfg, repeats=args.repeats)
    floor_total = floor["rollout_s"] + floor["reward_s"] + floor["train_s"]
    return {
        "recipe": str(args.recipe), "trainer": cfg.trainer, "pipeline": label, "overrides": list(args.overrides),
        "device": floor["device"], "threads": torch.get_num_threads(), "epochs_timed": len(records),
        "samples_per_epoch": cfg.sample.batch_size * cfg.sample.num_batches_per_epoch,
        "epoch": epoch, "floor": floor, "floor_s": floor_total, "ratio": epoch["wall_s"] / floor_total,
        "cpu_ratio": epoch["cpu_s"] / floor["cpu_s"],
        "target_ratio": TARGET_RATIO, "met": epoch["wall_s"] / floor_total <= TARGET_RATIO,
        "met_cpu": epoch["cpu_s"] / floor["cpu_s"] <= TARGET_RATIO,
        "total_s": total_s, **memory,
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


def _median_time(fn, repeats: int, device, cpu_times: dict | None = None, key: str = "") -> float:
    """Median wall seconds of `fn` over `repeats` calls (after one warm-up); the median process CPU seconds go to
    `cpu_times[key]`."""
    import torch

    fn()  # warm-up
    times, cpus = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
    if cpu_times is not None:
        cpu_times[key] = statistics.median(cpus)
    return statistics.median(times)


def measure_floor(cfg, *, repeats: int = 5) -> dict:
    """Seconds per epoch of the bare network and reward passes the recipe's epoch consists of (see module doc)."""
    import numpy as np
    import torch
    from accelerate import Accelerator

    from diffrl.trainers.common import setup
    from diffrl.trainers.common.prompts import draw_prompts, load_prompts
    from diffrl.trainers.common.weights import adapter_disabled, setup_policy_weights
    from samplers.conditioning import Conditioning, decode_latents, guided_unet_output

    accelerator = Accelerator(mixed_precision=cfg.model.mixed_precision)
    device = accelerator.device
    pipe = setup.load_policy_pipeline(cfg, accelerator)
    unet = pipe.unet
    use_lora = cfg.trainer == "dpok" or not cfg.model.full_finetune
    params = setup_policy_weights(unet, cfg.model, use_lora=use_lora)
    optimizer = torch.optim.AdamW(params, lr=1e-12)
    reward = setup.build_reward(cfg)
    sampler = setup.make_sampler(cfg.sample.sampler, pipe)
    s, tc = cfg.sample, cfg.train
    prompts = draw_prompts(load_prompts(cfg.prompts.source), s.batch_size, 1, np.random.default_rng(0))
    negative = [s.negative_prompt] * s.batch_size if s.negative_prompt else None
    # one real rollout batch: its latents, conditioning and images feed the timed passes (real data, real shapes)
    with torch.no_grad(), accelerator.autocast():
        traj = sampler.sample(pipe, prompts, num_steps=s.num_steps, guidance_scale=s.guidance_scale, eta=s.eta,
                              seeds=list(range(s.batch_size)), negative_prompt=negative)
    middle = s.num_steps // 2
    t = traj.timesteps[middle].to(device)
    guided = traj.negative_prompt_embeds is not None

    inputs: dict = {}  # n -> (latents, UNet kwargs): built once, so the timed passes are the UNet alone

    def unet_forward(n: int, grad: bool):
        if n not in inputs:
            sub = traj.select(list(range(n)) if n <= len(traj) else [i % len(traj) for i in range(n)])
            kwargs = Conditioning.from_trajectory(sub).to(device).unet_kwargs(unet.dtype)
            inputs[n] = (sub.latents[:, middle].to(device), kwargs)
        latents, kwargs = inputs[n]
        with torch.set_grad_enabled(grad), accelerator.autocast():
            return guided_unet_output(unet, latents, t, kwargs, s.guidance_scale, guided)

    def text():
        with torch.no_grad():
            pipe.encode_prompt(prompts, device, 1, guided, negative)

    def decode():
        with torch.no_grad():
            decode_latents(pipe, traj.latents[:, -1].to(device))

    def score():
        with torch.no_grad():
            reward(traj.images, prompts, None)

    def fwd_bwd(n):
        unet.train()
        accelerator.backward(unet_forward(n, grad=True).float().mean())
        unet.eval()

    def adam_step():
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    unet.eval()
    cpu: dict = {}  # the same passes' median process CPU seconds
    t_text = _median_time(text, repeats, device, cpu, "text")
    t_unet = _median_time(lambda: unet_forward(s.batch_size, grad=False), repeats, device, cpu, "unet")
    t_decode = _median_time(decode, repeats, device, cpu, "decode")
    t_reward = _median_time(score, repeats, device, cpu, "reward")
    t_adam = _median_time(adam_step, repeats, device, cpu, "adam")
    batches = s.num_batches_per_epoch
    n_local = s.batch_size * batches
    out = {"device": str(device), "unet_forward_s": t_unet, "text_s": t_text, "decode_s": t_decode,
           "reward_batch_s": t_reward, "adam_step_s": t_adam}
    out["rollout_s"] = batches * (t_text + s.num_steps * t_unet + t_decode)
    out["reward_s"] = batches * t_reward
    cpu_total = batches * (cpu["text"] + s.num_steps * cpu["unet"] + cpu["decode"] + cpu["reward"])
    if cfg.trainer == "ddpo":
        t_fb = _median_time(lambda: fwd_bwd(tc.batch_size), repeats, device, cpu, "fwd_bwd")
        from diffrl.trainers.ddpo import trained_steps_per_sample

        trained_steps = trained_steps_per_sample(cfg)
        minibatches = tc.num_inner_epochs * math.ceil(n_local / tc.batch_size)
        optimizer_steps = minibatches // tc.gradient_accumulation_steps
        out.update(fwd_bwd_s=t_fb, optimizer_steps=optimizer_steps)
        out["train_s"] = minibatches * trained_steps * t_fb + optimizer_steps * t_adam
        cpu_total += minibatches * trained_steps * cpu["fwd_bwd"] + optimizer_steps * cpu["adam"]
    else:
        from diffrl.trainers.dpok import ValueNet

        t_fb = _median_time(lambda: fwd_bwd(tc.policy_batch_size), repeats, device, cpu, "fwd_bwd")

        def reference():
            with torch.no_grad(), adapter_disabled(unet):
                unet_forward(tc.policy_batch_size, grad=False)

        t_ref = _median_time(reference, repeats, device, cpu, "reference")
        microbatches = tc.policy_steps * tc.gradient_accumulation_steps
        out.update(fwd_bwd_s=t_fb, reference_forward_s=t_ref, optimizer_steps=tc.policy_steps)
        out["train_s"] = microbatches * (t_fb + t_ref) + tc.policy_steps * t_adam
        cpu_total += microbatches * (cpu["fwd_bwd"] + cpu["reference"]) + tc.policy_steps * cpu["adam"]
        if tc.value_baseline:
            value_net = ValueNet(unet.config.in_channels, unet.config.cross_attention_dim).to(device)
            value_opt = torch.optim.AdamW(value_net.parameters(), lr=1e-12)
            rows = torch.arange(tc.value_batch_size) % s.batch_size
            latents = traj.latents[rows, middle].to(device)
            pooled = traj.prompt_embeds.float().mean(dim=1)[rows.to(traj.prompt_embeds.device)].to(device)
            steps = torch.full((tc.value_batch_size,), 500, device=device)

            def value_step():
                value_net(latents, pooled, steps).pow(2).mean().backward()
                value_opt.step()
                value_opt.zero_grad(set_to_none=True)

            t_value = _median_time(value_step, repeats, device, cpu, "value")
            out["value_step_s"] = t_value
            out["train_s"] += tc.value_steps * t_value
            cpu_total += tc.value_steps * cpu["value"]
    out["cpu_s"] = cpu_total
    return out
