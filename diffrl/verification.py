"""How far each shipped recipe is verified: the evidence, as data, behind `diffrl ls recipes` and docs/parity.md.

Four levels per recipe, each ✓ (shown), ✗ (not shown yet) or — (does not apply):

- parity: its trainer's update equals the reference code's on the same inputs, in a parity test
  (`tests/trainers/test_<trainer>_parity.py`, golden numbers from the reference at a named commit): `PARITY`;
- direction: a test trains it on r and on −r and it moves the opposite ways (`DIRECTION`, `STEER_DIRECTION`);
- gold: its row in docs/benchmarks.md's `diffrl bench learn` table raised ShapesWorld's held-out verifier by at least
  two standard errors (`GOLD`; — for recipes on real models);
- real: it was run on real (hub) weights (`REAL_WEIGHTS`).

A recipe's trainer here is its folder, `recipes/<trainer>/...`: AlignProp (the `draft` trainer with random truncation)
and RLCM (`ddpo` over the LCM sampler) have their own reference code and parity tests. This module is data: it imports
no trainer and reads no test (tests are not installed); `tests/test_verification.py` checks every claim against the
files it names, and that docs/parity.md shows what `parity_table()` and `levels_table()` render from it.
"""

from __future__ import annotations

from dataclasses import dataclass

YES, NO, NOT_APPLICABLE, UNKNOWN = "✓", "✗", "—", "?"
LEVELS = ("parity", "direction", "gold", "real")
LEGEND = ("✓ yes ✗ not yet — n/a; parity: the reference code's numbers, direction: an r/−r test, gold: held-out "
          "verifier +2 se, real: real weights (docs/parity.md)")


@dataclass(frozen=True)
class Parity:
    """A trainer's parity evidence against its reference code."""

    repo: str | None  # GitHub owner/name of the reference code (None: no public code)
    commit: str | None  # the commit(s) its parity test's numbers come from, comma-separated; None: no test yet (✗)
    checks: str  # what the parity test compares (markdown)
    result: str  # "equal", or the documented differences from the reference (settings, on purpose; markdown)

    @property
    def verified(self) -> bool:
        return self.commit is not None


# To mark a trainer's parity as shown once `tests/trainers/test_<trainer>_parity.py` exists: set its `commit=` to the
# commit its docstring names (that one line), check `checks` says what the test compares, and regenerate
# docs/parity.md with `python tests/test_verification.py --write`.
PARITY: dict[str, Parity] = {
    "ddpo": Parity(
        repo="kvablack/ddpo-pytorch",
        commit="1958463",
        checks="`ddim_step_with_logprob` (sample, mean, σ_t, log-prob; ε and v prediction, η 1 and 0.5) and the "
               "schedule; the PPO lines of `train.py` (loss, approx-KL, clip fraction, gradient w.r.t. the model "
               "output); `PerPromptStatTracker` over three epochs",
        result="equal (samples and means bit-identical)",
    ),
    "dpok": Parity(
        repo="google-research/google-research",  # its dpok/ folder
        commit="1d49f2c, 10270a5, 4c42994",
        checks="rollout and training step log-probs; A = r − V; `_train_policy_func`'s loss and gradient w.r.t. the "
               "guided ε; the KL; `_train_value_func`'s MSE and gradient",
        result="the KL is the closed-form Gaussian KL: the reference's mean((ε_θ − ε_ref)²) = it · 2σ_t²/c_t² (8–10× "
               "on 50 steps), tested as that conversion; pairs from the current epoch only, no replay buffer",
    ),
    "d3po": Parity(
        repo="yk7333/d3po",
        commit="40d3175",
        checks="`compare` (one reward and Pareto over several, with ties and NaN); the per-step DPO loss of "
               "`train_d3po.py` and its gradient w.r.t. the log-probs",
        result="ties and unlabelled pairs dropped from the mean (the reference keeps them at zero gradient: its loss "
               "= (n·ours + (P − n)·log 2)/P, tested as that conversion); reference = adapter-off UNet",
    ),
    "rlcm": Parity(
        repo="Owen-Oertell/rlcm",
        commit="b8330ed",
        checks="`LCMScheduler.set_timesteps` and `.step` (sample, x̂0, mean, σ, log-prob); the PPO lines of "
               "`ppo_training_loop.py` (loss, approx-KL, clip fraction, gradient)",
        result="equal with `sample.sampler: lcm_rlcm` (the reference's timesteps; `lcm` = diffusers' spacing); the "
               "last step returns x̂0 with log-prob 0 (the reference scores a re-noised copy it never decodes); "
               "constant learning rate (the reference decays it to 2/3)",
    ),
    "alignprop": Parity(
        repo="mihirp1998/AlignProp",
        commit="b22918a",
        checks="`pipeline_step_with_grad` (which steps carry the gradient for a cut-off, x0, loss, gradients w.r.t. "
               "the weights and each step's output); the N(42, 5) cut-off's distribution against 100k reference draws",
        result="equal with `train.truncation: normal_cutoff` (the published recipes); `random_last` (K uniform, the "
               "paper's) one setting away; maximises the aesthetic score instead of pulling it toward 10",
    ),
    "draft": Parity(
        repo=None,
        commit="closed forms",
        checks="DRaFT-LV's re-noising, one-step denoising, loss and gradient (ε and v) and DRaFT-1's gradient "
               "through a DDIM step, against values worked out by hand",
        result="no public code (Clark et al. 2023): the paper's Algorithms 1–2; DRaFT-LV averages its n rewards "
               "(Algorithm 2 adds the n gradients)",
    ),
    "raft": Parity(
        repo="OptimalScale/LMFlow",  # experimental/RAFT-diffusion
        commit="f3597db",
        checks="`add_noise`, the ε/v target, the MSE loss and its gradient (`train_text_to_image_lora.py`); the "
               "notebook's selection (each prompt's best, then the best of the winners)",
        result="equal; selection per prompt or global (LMFlow: both, one after the other); sampled latents trained "
               "directly (no decode/encode); the prompt dropped with probability `uncond_fraction` (0.1)",
    ),
    "diffusion_dpo": Parity(
        repo="SalesforceAIResearch/DiffusionDPO",
        commit="5233e75",
        checks="`train.py --train_method dpo`: shared t and noise per pair, `add_noise`, per-image MSEs, the loss, "
               "implicit accuracy, gradient w.r.t. the model output",
        result="equal; LoRA with the adapter-off reference instead of a full fine-tune beside a frozen copy; latents "
               "cached as the posterior's mean and std; AdamW on SDXL (the reference: Adafactor)",
    ),
    "diffusion_nft": Parity(
        repo="NVlabs/DiffusionNFT",
        commit="24af555",
        checks="the loss with adaptive weighting and KL and its gradient w.r.t. v_θ; the implicit policies v±; r from "
               "the stat tracker; `return_decay` types 0–2; per-sample σ selection",
        result="equal at the defaults; `weighting: velocity` (the paper's plain objective) as the documented "
               "conversion; rollouts with any flow sampler (the reference's: a 2nd-order DPM solver)",
    ),
    "awm": Parity(
        repo="scxue/advantage_weighted_matching",
        commit="be51372",
        checks="`compute_log_prob_awm` (the five weightings) and the loss lines of `train_sd3_awm.py` (per-t ratio, "
               "PPO clip on- and off-policy, KL to the reference and to the EMA policy) and its gradient w.r.t. v_θ; "
               "the `discrete` and `discrete_wo_init` t strata",
        result="equal; rollouts with any flow sampler (the reference's: an SA-solver ODE); the EMA KL counted "
               "without needing β_KL > 0; no skipped first epochs",
    ),
    "flow_grpo": Parity(
        repo="yifan123/flow_grpo",
        commit="ac4c86e, 54809b5",
        checks="the SDE and CPS steps (sample, mean, σ_t, log-prob), the KL of `train_sd3.py`, group and batch "
               "advantages (`PerPromptStatTracker`, grouped by prompt across draws), the loop's step choice, "
               "zero-advantage filter and CFG gradient",
        result="equal at the defaults `train.kl_convention: reference`, `train.cps_log_prob: reference`, "
               "`advantage.std_eps: 1e-4`, `advantage.group_by: prompt`; `exact` (= reference / \\|Δt\\|) and "
               "`gaussian` checked as the documented conversions",
    ),
    "prdp": Parity(
        repo=None,
        commit=None,  # no parity test: the paper's appendix-G loss is worked by hand in tests/trainers/test_prdp.py
        checks="—",
        result="no public code (Deng et al. 2024); follows the paper's appendix-G loss (r̂ the mean of the per-step "
               "log-ratios, each unordered pair once, ties left out); LoRA with the adapter-off reference",
    ),
    "adjoint_matching": Parity(
        repo=None,
        commit=None,  # no parity test: the schedule, lean adjoint and loss are worked by hand and against closed
        # forms in tests/trainers/test_adjoint_matching.py
        checks="—",
        result="no reference code compared (Domingo-Enrich et al. 2025); the memoryless schedule, the lean adjoint "
               "(a linear velocity's closed form) and the loss by hand; a linear-Gaussian toy ends at its "
               "closed-form tilted Gaussian; LoRA with the adapter-off base",
    ),
    "pxpo": Parity(
        repo=None,
        commit=None,  # no parity test: the per-position loss and advantages are worked by hand in test_pxpo.py
        checks="—",
        result="no public code found (Kordzanganeh et al. 2024); the paper's per-pixel gradient with DDPO's PPO clip "
               "per latent position, the map area-averaged to the latent grid, DDPO-normalised advantages",
    ),
    "seppo": Parity(
        repo=None,
        commit=None,  # no parity test: the loss, the flipper and the pool are worked by hand in test_seppo.py
        checks="—",
        result="no training code public (DwanZhang-AI/SePPO@101b711 holds evaluation scripts only; Zhang et al. "
               "2024); the loss and the flipper's direction as the paper's public reviews restate Eq. 7/8; LoRA "
               "checkpoints in the pool; β and the reference samples' sampler settings are Diffusion-DPO's / the run's",
    ),
}

_CONTRACT = "tests/trainers/test_contract.py::test_training_moves_in_the_direction_of_its_reward"
# The test that trains a recipe's trainer on r and on −r and sees it move opposite ways, per recipe folder.
DIRECTION: dict[str, str] = {
    "ddpo": f"{_CONTRACT}[ddpo]",
    "dpok": f"{_CONTRACT}[dpok]",
    "d3po": f"{_CONTRACT}[d3po]",
    "rlcm": f"{_CONTRACT}[ddpo]",  # the same trainer over DDIM; the LCM sampler's log-probs: test_rlcm.py
    "alignprop": f"{_CONTRACT}[draft]",  # the same trainer, a fixed K instead of a random one
    "draft": f"{_CONTRACT}[draft]",
    "raft": f"{_CONTRACT}[raft]",
    "diffusion_dpo": f"{_CONTRACT}[diffusion_dpo]",
    "diffusion_nft": f"{_CONTRACT}[diffusion_nft]",
    "flow_grpo": f"{_CONTRACT}[flow_grpo]",
    "awm": f"{_CONTRACT}[awm]",
    "adjoint_matching": f"{_CONTRACT}[adjoint_matching]",
    "prdp": f"{_CONTRACT}[prdp]",
    "pxpo": f"{_CONTRACT}[pxpo]",
    "seppo": f"{_CONTRACT}[seppo]",
}
# Steering recipes (`steer/<pipeline>_<reward>_<method>`), per method: the steered reward against plain sampling.
_METHODS = "tests/steering/test_pipeline_methods.py::"
STEER_DIRECTION: dict[str, str] = {
    "best-of-n": f"{_METHODS}test_value_methods_raise_the_reward_and_count_evaluations",
    "fk": f"{_METHODS}test_value_methods_raise_the_reward_and_count_evaluations",
    "svdd": f"{_METHODS}test_value_methods_raise_the_reward_and_count_evaluations",
    "guidance": f"{_METHODS}test_reward_guidance_raises_the_reward_of_the_same_chain",
    "reno": f"{_METHODS}test_reno_raises_the_reward_of_a_one_step_lcm",
}


@dataclass(frozen=True)
class BenchRow:
    """A row of docs/benchmarks.md's `diffrl bench learn` table (10 minutes, 256 held-out images)."""

    row: str  # the row's label there
    gain: float  # held-out verifier after − before
    se: float  # standard error of the gain
    note: str = ""

    @property
    def raised(self) -> bool:
        return self.gain >= 2 * self.se


# Every recipe on an embedded ShapesWorld model -> its bench row (None: it has none). Recipes not listed run on
# real models, where the gold level does not apply.
GOLD: dict[str, BenchRow | None] = {
    "adjoint_matching/tiny_shapes_flow_clip": BenchRow("Adjoint Matching", 0.019, 0.032),  # trains on the tiny CLIP
    "awm/tiny_shapes_flow_verifier": None,  # AWM: no bench row run yet
    "alignprop/tiny_shapes_pickscore": BenchRow("AlignProp", 0.078, 0.033),
    "d3po/tiny_shapes_labels": None,
    "d3po/tiny_shapes_pickscore": None,
    "d3po/tiny_shapes_verifier": BenchRow("D3PO", 0.005, 0.032),
    "ddpo/tiny_shapes_jpeg": None,
    "ddpo/tiny_shapes_verifier": BenchRow("DDPO", 0.001, 0.033),
    "diffusion_dpo/tiny_shapes_pairs": BenchRow("Diffusion-DPO", 0.011, 0.033),
    "diffusion_nft/tiny_shapes_flow_verifier": BenchRow("DiffusionNFT", 0.011, 0.032),
    "dpok/tiny_shapes_clip": BenchRow("DPOK", -0.011, 0.033),
    "draft/tiny_shapes_clip": None,
    "draft/tiny_shapes_pickscore": BenchRow("DRaFT-LV, n = 2", 0.135, 0.032),
    "flow_grpo/tiny_shapes_flow_guard": None,  # GRPO-Guard: no bench row run yet
    "flow_grpo/tiny_shapes_flow_mixgrpo": None,  # MixGRPO: no bench row run yet
    "flow_grpo/tiny_shapes_flow_verifier": BenchRow("Flow-GRPO", -0.011, 0.033),
    "prdp/tiny_shapes_verifier": None,  # PRDP: no bench row run yet
    "pxpo/tiny_shapes_verifier_map": None,  # PXPO: no bench row run yet
    "raft/tiny_shapes_verifier": BenchRow("RAFT", -0.017, 0.033),
    "rlcm/tiny_shapes_lcm_verifier": BenchRow("RLCM", 0.035, 0.032,
                                              note="given 25 minutes: +0.069 ± 0.032, in the text below the table"),
    "seppo/tiny_shapes_verifier": None,  # SePPO: its 2026-11-26 row used 64 held-out images, not this table's 256
    "steer/tiny-shapes-lcm_clip_reno": None,
    "steer/tiny-shapes_clip_guidance": None,
    "steer/tiny-shapes_verifier_best-of-n": None,
    "steer/tiny-shapes_verifier_fk": None,
    "steer/tiny-shapes_verifier_svdd": None,
}

# Recipe -> where it was run on real weights. Empty: the machines that built and tested diffrl had no GPU with hub
# weights (docs/real-models.md's H100 timings used random weights of SD 1.5's shapes).
REAL_WEIGHTS: dict[str, str] = {}


@dataclass(frozen=True)
class Level:
    mark: str  # YES, NO, NOT_APPLICABLE or UNKNOWN (a recipe this module has no entry for)
    evidence: str  # the test, bench row or reason (markdown)


def _signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def recipe_levels(name: str) -> dict[str, Level]:
    """The four verification levels of shipped recipe `name` (`ddpo/tiny_shapes_verifier`), keyed by `LEVELS`."""
    trainer, _, rest = name.partition("/")
    if trainer == "steer":
        parity = Level(NO, "no parity test against the methods' reference code")
        test = STEER_DIRECTION.get(rest.rpartition("_")[2])
    elif trainer in PARITY:
        p = PARITY[trainer]
        where = f"`{p.repo}`@{p.commit}" if p.repo else p.commit
        parity = Level(YES, where) if p.verified else Level(NO, "no parity test yet")
        test = DIRECTION.get(trainer)
    else:
        parity, test = Level(UNKNOWN, "no entry"), None
    direction = Level(YES, f"`{test}`") if test else Level(UNKNOWN, "no entry")
    if name not in GOLD:
        gold = Level(NOT_APPLICABLE, "a real model")
    elif GOLD[name] is None:
        gold = Level(NO, "no bench row with a standard error")
    else:
        row = GOLD[name]
        text = f"{row.row}: {_signed(row.gain)} ± {row.se:.3f}" + (f" ({row.note})" if row.note else "")
        gold = Level(YES if row.raised else NO, text)
    real = Level(YES, REAL_WEIGHTS[name]) if name in REAL_WEIGHTS else Level(NO, "not run")
    return {"parity": parity, "direction": direction, "gold": gold, "real": real}


def recipe_marks(name: str) -> str:
    """The four marks of recipe `name` in columns under `MARKS_HEADER` (for `diffrl ls recipes`)."""
    levels = recipe_levels(name)
    return " ".join(f"{levels[level].mark:^{len(level)}}" for level in LEVELS)


MARKS_HEADER = " ".join(LEVELS)


def parity_table() -> str:
    """The markdown table of `PARITY`: trainer | reference | parity test | what is checked | equal / differences."""
    lines = ["| trainer | reference repo@commit | parity test | what is checked | equal / documented difference |",
             "|---|---|---|---|---|"]
    for trainer, p in sorted(PARITY.items()):
        repo = f"`{p.repo}`" if p.repo else "no public code: the paper's"
        reference = f"{repo}@{p.commit}" if p.verified else repo
        test = f"`tests/trainers/test_{trainer}_parity.py`"
        test, checks = (f"{YES} {test}", p.checks) if p.verified else (f"{NO} not yet", "—")
        lines.append(f"| `{trainer}` | {reference} | {test} | {checks} | {p.result} |")
    return "\n".join(lines) + "\n"


def direction_table() -> str:
    """The markdown table of `DIRECTION` and `STEER_DIRECTION`: recipe folder (or steering method) | test."""
    lines = ["| recipes | direction test |", "|---|---|"]
    lines += [f"| `{trainer}/*` | `{test}` |" for trainer, test in sorted(DIRECTION.items())]
    lines += [f"| `steer/*_{method}` | `{test}` |" for method, test in STEER_DIRECTION.items()]
    return "\n".join(lines) + "\n"


def levels_table(names: list[str]) -> str:
    """The markdown table of `recipe_levels` for recipes `names`: the four marks, and the gold level's bench row."""
    lines = ["| recipe | parity | direction | gold on ShapesWorld | real weights |", "|---|---|---|---|---|"]
    for name in names:
        levels = recipe_levels(name)
        gold = levels["gold"].mark + (f" {levels['gold'].evidence}" if levels["gold"].mark != NOT_APPLICABLE else "")
        marks = [levels["parity"].mark, levels["direction"].mark, gold, levels["real"].mark]
        lines.append(f"| `{name}` | " + " | ".join(marks) + " |")
    return "\n".join(lines) + "\n"
