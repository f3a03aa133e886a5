"""Gradient signal: how many samples DDPO's policy gradient needs before it points at the expected gradient.

A learning run (`diffrl bench learn`) takes minutes and its outcome is one noisy number. This bench measures the
cause directly, in about a minute per setting on tiny-shapes: it draws `--samples` trajectories with the recipe's
sampler and reward, turns rewards into the recipe's advantages, and computes the policy gradient of PPO's surrogate
at ratio 1 (∇ of −mean(Â · log π) over the trained (sample, step) pairs, exactly the trainer's first gradient) on
`m` disjoint chunks of `--chunk` samples each (groups stay whole). With g_i the chunk gradients,

    |s|²  = mean over pairs i ≠ j of g_i · g_j        (independent chunks: E[g_i · g_j] = |E g|²)
    v     = chunk · (mean_i |g_i|² − |s|²)            (the noise of ONE sample's gradient, Σ of its variances)

so a gradient averaged over n samples has expected cosine √(|s|² / (|s|² + v / n)) with the true one, and
**n₁ = v / |s|²** samples give a gradient as much signal as noise. It is reported for all trained steps together
and for each denoising step alone, so a lever (`--sweep train.sde_window=3`, `advantage.group_size`, `sample.num_steps`,
`train.skip_final_steps`, `advantage.shared_start_noise`, ...) is judged by what it does to n₁ and to the cost per
sample. |s|² comes with a jackknife standard error (leave one chunk out); below two of them the signal is not
resolved by this many samples and n₁ is printed as a lower bound, "> v / (|s|² + 2 se)".

Starts from the recipe's initial weights (LoRA B = 0, so only B gets gradient, as in the first real step).

`--pathwise` (a differentiable reward only) measures the same objective's pathwise gradient next to it: each chunk's
prompts and seeds are sampled again in differentiable mode (every step keeps its graph; `--pathwise-last K`: only
the last K, DRaFT-K's truncated gradient) and −mean(reward) is backpropagated to the weights. It reports that
estimator's n₁ on the same scale, and, as a check that the score-function estimator points the right way, the
projection of each policy-gradient chunk on the pathwise direction u (mean over chunks, its standard error and
t = mean / se; positive means they agree).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

from diffrl.bench.common import add_common_arguments, load_bench_recipe, temp_workdir
from diffrl.bench.learn import lever_overrides, parse_sweep
from diffrl.errors import UserError
from diffrl.files import write_json
from diffrl.models import model_family
from diffrl.prompts import load_prompts
from diffrl.training import setup
from diffrl.training.advantages import make_stat_tracker
from diffrl.training.rollout import collect_rollouts, epoch_advantages
from diffrl.training.sde_window import check_sampler, sde_window_etas, trainable_steps
from diffrl.training.weights import setup_policy_weights
from samplers.base import GradPolicy

DEFAULT_RECIPE = "ddpo/tiny_shapes_verifier"


def add_arguments(parser) -> None:
    add_common_arguments(parser, DEFAULT_RECIPE)
    add = parser.add_argument
    add("--samples", type=int, default=512, help="trajectories drawn per setting (default 512)")
    add("--chunk", type=int, default=32, help="samples per chunk gradient (default 32; a multiple of the group size)")
    add("--seed", type=int, default=0, help="seed of prompts and noise (default 0)")
    add("--pathwise", action="store_true",
        help="also measure the pathwise gradient of the same objective (differentiable rewards only)")
    add("--pathwise-last", type=int, default=0, metavar="K",
        help="with --pathwise: keep the graph of the last K steps only (DRaFT-K; a truncated, biased gradient); "
             "default 0 = every step (the exact gradient)")
    add("--sweep", action="append", default=[], metavar="LEVER=V1,V2,...",
        help="vary one recipe key (or a `bench learn` lever) over values; the recipe runs once as the baseline")


def signal_and_noise(grads, chunk: int) -> dict:
    """|s|², its jackknife standard error and the per-sample noise v from `m` chunk gradients `[m, P]`.

    Returns `{"signal", "signal_se", "noise", "samples_for_snr1", "samples_for_snr1_at_least"}`: `samples_for_snr1`
    is None when the signal is not above two standard errors (not resolved); the lower bound `noise / (signal +
    2 se)` (the signal at most two standard errors above its estimate) is always given (0 when there is no noise).
    """
    g = grads.double()
    m = g.shape[0]
    if m < 3:
        raise ValueError("need at least 3 chunk gradients")
    gram = g @ g.T
    diag = gram.diagonal()
    total_off = gram.sum() - diag.sum()
    signal = float(total_off / (m * (m - 1)))
    # leave chunk k out: drop its row and column of the Gram matrix
    row = gram.sum(dim=1) - diag
    loo = (total_off - 2 * row) / ((m - 1) * (m - 2))
    se = float(torch.sqrt((m - 1) / m * ((loo - loo.mean()) ** 2).sum()))
    noise = float(chunk * (diag.mean() - signal))
    resolved = signal > 2 * se and signal > 0
    upper = max(signal, 0.0) + 2 * se
    return {"signal": signal, "signal_se": se, "noise": noise,
            "samples_for_snr1": noise / signal if resolved else None,
            "samples_for_snr1_at_least": noise / upper if upper > 0 else (0.0 if noise <= 0 else math.inf)}


def expected_cosine(signal: float, noise: float, n: int) -> float:
    """Expected cosine between an n-sample gradient and the expected gradient."""
    if signal <= 0:
        return 0.0
    return math.sqrt(signal / (signal + noise / n))


def projection(grads, direction) -> dict:
    """Mean, standard error and t of the projections of chunk gradients `[m, P]` on the unit vector of `direction`."""
    u = direction.double() / direction.double().norm().clamp_min(1e-300)
    d = grads.double() @ u
    mean, se = float(d.mean()), float(d.std() / math.sqrt(len(d)))
    t = mean / se if se > 0 else (math.copysign(math.inf, mean) if mean else 0.0)
    return {"mean": mean, "se": se, "t": t}


def measure(cfg, *, samples: int, chunk: int, seed: int, pathwise: bool = False, pathwise_last: int = 0,
            log=print) -> dict:
    """Draw `samples` trajectories of the recipe `cfg` (DDPO), compute chunk gradients per trained step, return the
    statistics for all trained steps and for each step (and with `pathwise`, the pathwise estimator's)."""
    if cfg.advantage is None:
        raise UserError(f"bench gradient measures a policy gradient with advantages; trainer {cfg.trainer} has none")
    tc, s, adv_cfg = cfg.train, cfg.sample, cfg.advantage
    if chunk % adv_cfg.group_size:
        raise UserError(f"--chunk {chunk} must be a multiple of advantage.group_size ({adv_cfg.group_size}), so "
                        "every group's advantages stay in one chunk")
    if samples % chunk or samples // chunk < 3:
        raise UserError(f"--samples {samples} must be a multiple of --chunk {chunk}, at least 3 chunks")
    setup.seed_everything(seed, 0)
    accelerator = Accelerator(mixed_precision=cfg.model.mixed_precision)
    pipe = setup.load_policy_pipeline(cfg, accelerator)
    sampler = setup.make_sampler(s.sampler, pipe)
    check_sampler(cfg, sampler, cfg.trainer)
    # Flow-GRPO's CPS log-prob convention and the CFG branches its gradient flows through, as its trainer sets them
    for setting in ("cps_log_prob", "cfg_gradient"):
        if hasattr(tc, setting):
            setattr(sampler, setting, getattr(tc, setting))
    reward = setup.build_reward(cfg)
    if pathwise and not reward.differentiable:
        raise UserError(f"--pathwise needs a differentiable reward; '{cfg.reward.name}' is not (try "
                        "reward.name=clip_score with reward.kwargs={model: tiny-shapes-clip})")
    unet = model_family(pipe).denoiser  # the UNet, or a flow pipeline's transformer
    params = setup_policy_weights(unet, cfg.model, use_lora=not cfg.model.full_finetune)
    rng = np.random.default_rng(seed)
    batches_needed = math.ceil(samples / s.batch_size)
    sample_cfg = dataclasses.replace(s, num_batches_per_epoch=batches_needed)
    start = time.perf_counter()
    unet.eval()
    rollout = collect_rollouts(pipe=pipe, sampler=sampler, reward=reward, prompts=load_prompts(cfg.prompts.source),
                               sample_cfg=sample_cfg, group_size=adv_cfg.group_size, rng=rng, accelerator=accelerator,
                               keep_images=0, shared_start_noise=adv_cfg.shared_start_noise,
                               eta=sde_window_etas(cfg, rng))
    rollout_s = time.perf_counter() - start
    adv = epoch_advantages(rollout, adv_cfg, make_stat_tracker(adv_cfg))
    adv = torch.as_tensor(adv, dtype=torch.float32)[:samples]
    traj = rollout.traj.select(list(range(samples))).to(accelerator.device)
    adv = adv.to(accelerator.device)
    steps = trainable_steps(traj, tc.skip_final_steps)
    if getattr(tc, "timestep_selection", "random") == "first":  # Flow-GRPO trains the first n steps, always
        steps = steps[: setup.num_train_timesteps(len(steps), tc.timestep_fraction)]
    steps = steps.tolist()
    m = samples // chunk
    n_params = sum(p.numel() for p in params)
    total = torch.zeros(m, n_params, dtype=torch.float64)
    per_step = {}
    start = time.perf_counter()
    unet.train()
    for j in steps:
        g_step = torch.zeros(m, n_params, dtype=torch.float64)
        for c in range(m):
            idx = torch.arange(c * chunk, (c + 1) * chunk)
            for p in params:
                p.grad = None
            with accelerator.autocast():
                log_probs = sampler.log_prob(pipe, traj, j, indices=idx)
            # the PPO surrogate's gradient at ratio 1, one step's share of a minibatch's mean over its steps
            accelerator.backward(-(adv[idx] * log_probs.float()).mean() / len(steps))
            g_step[c] = torch.cat([p.grad.detach().reshape(-1).double().cpu() for p in params])
        total += g_step
        per_step[j] = signal_and_noise(g_step, chunk)
    unet.eval()
    grad_s = time.perf_counter() - start
    rewards = rollout.all_rewards[:samples]
    n_opt = tc.batch_size * cfg.optim.gradient_accumulation_steps
    result = {"all": signal_and_noise(total, chunk), "steps": per_step, "samples": samples, "chunk": chunk,
              "trained_steps": steps, "reward_mean": float(np.nanmean(rewards)),
              "zero_advantage": float((adv == 0).double().mean()), "samples_per_optimizer_step": n_opt,
              "rollout_s": rollout_s, "gradient_s": grad_s,
              "seconds_per_sample": (rollout_s + grad_s) / samples, "trainable_params": n_params}
    result["cosine_per_optimizer_step"] = expected_cosine(result["all"]["signal"], result["all"]["noise"], n_opt)
    if pathwise:
        start = time.perf_counter()
        pw = pathwise_chunks(pipe, sampler, reward, traj, s, params, chunk=chunk, accelerator=accelerator,
                             last=pathwise_last)
        result["pathwise"] = {**signal_and_noise(pw, chunk), "last": pathwise_last, "seconds_per_sample": (time.perf_counter() - start) / samples,
                              "projection": projection(total, pw.mean(dim=0))}
    return result


def pathwise_chunks(pipe, sampler, reward, traj, sample_cfg, params, *, chunk: int, accelerator, last: int = 0):
    """Gradients `[m, P]` of −mean(reward) over each chunk of `traj`'s prompts and seeds, sampled again with every
    step's graph kept, or the last `last` steps' (the trajectory's own η, per step when it has one per step)."""
    if traj.seeds is None:
        raise UserError("--pathwise re-draws each trajectory from its seed; this rollout has no per-sample seeds")
    m = len(traj) // chunk
    out = torch.zeros(m, sum(p.numel() for p in params), dtype=torch.float64)
    model_family(pipe).denoiser.train()
    for c in range(m):
        rows = list(range(c * chunk, (c + 1) * chunk))
        prompts = [traj.prompts[i] for i in rows]
        negative = [sample_cfg.negative_prompt] * chunk if sample_cfg.negative_prompt else None
        for p in params:
            p.grad = None
        with accelerator.autocast():
            again = sampler.sample(pipe, prompts, num_steps=traj.num_steps, guidance_scale=traj.guidance_scale,
                                   eta=traj.eta, seeds=[traj.seeds[i] for i in rows], negative_prompt=negative,
                                   grad=GradPolicy(keep="last", k=last) if last else GradPolicy(keep="all"))
            scores = reward(again.images, prompts).scores
        accelerator.backward(-scores.float().mean())
        out[c] = torch.cat([p.grad.detach().reshape(-1).double().cpu() for p in params])
    model_family(pipe).denoiser.eval()
    return out


def run_gradient_bench(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = [("baseline", "", [])] + [(n, v, lever_overrides(n, v)) for spec in args.sweep
                                      for n, values in [parse_sweep(spec)] for v in values]
    rows = []
    with temp_workdir() as tmp:
        configs = [(lever, value, load_bench_recipe(args.recipe, list(args.overrides) + extra, args.pipeline,
                                                    Path(tmp), log=lambda line: print(line, file=sys.stderr)))
                   for lever, value, extra in plan]  # every setting loads (and fails) before any sampling
        for lever, value, (cfg, pipeline) in configs:
            label = "baseline" if lever == "baseline" else f"{lever}={value}"
            print(f"[{label}] {args.samples} samples on {pipeline} ...", file=sys.stderr, flush=True)
            rows.append({"lever": lever, "value": value, "pipeline": pipeline,
                         **measure(cfg, samples=args.samples, chunk=args.chunk, seed=args.seed,
                                   pathwise=args.pathwise, pathwise_last=args.pathwise_last)})
    print(format_result(rows))
    if args.out:
        write_json(args.out, rows, default=str)
    return 0


def _n1(stats: dict, samples: int) -> str:
    if stats["samples_for_snr1"] is None:
        return f"> {stats['samples_for_snr1_at_least']:.0f}"
    return f"{stats['samples_for_snr1']:.0f}"


def format_result(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        label = "baseline" if r["lever"] == "baseline" else f"{r['lever']}={r['value']}"
        a = r["all"]
        lines.append(
            f"== {label}: reward {r['reward_mean']:.3f}, zero advantage {r['zero_advantage']:.2f}, "
            f"{r['seconds_per_sample']:.3f} s/sample (rollout + gradient of {len(r['trained_steps'])} steps)\n"
            f"   all trained steps: samples for SNR 1 = {_n1(a, r['samples'])} (|s|² {a['signal']:.3g} ± "
            f"{a['signal_se']:.2g}, v {a['noise']:.3g}); expected cosine of one optimizer step "
            f"({r['samples_per_optimizer_step']} samples) = {r['cosine_per_optimizer_step']:.3f}")
        lines.append(f"   {'step':>4s} {'samples for SNR 1':>18s} {'|s|²':>10s} {'± se':>9s} {'v':>10s}")
        for j, st in r["steps"].items():
            lines.append(f"   {j:>4d} {_n1(st, r['samples']):>18s} {st['signal']:>10.3g} {st['signal_se']:>9.2g} "
                         f"{st['noise']:>10.3g}")
        if "pathwise" in r:
            pw, pr = r["pathwise"], r["pathwise"]["projection"]
            kept = f"last {pw['last']} steps" if pw["last"] else "all steps"
            lines.append(f"   pathwise ({kept} differentiable): samples for SNR 1 = {_n1(pw, r['samples'])} "
                         f"(|s|² {pw['signal']:.3g} ± {pw['signal_se']:.2g}, v {pw['noise']:.3g}), "
                         f"{pw['seconds_per_sample']:.3f} s/sample")
            lines.append(f"   policy gradient along the pathwise direction: {pr['mean']:.3g} ± {pr['se']:.2g} per chunk "
                         f"(t = {pr['t']:.2f}; > 0: same direction)")
    return "\n".join(lines)
