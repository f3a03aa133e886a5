"""Shared pieces of the trainer tests: a tiny pipeline on disk, cheap analytic rewards, tiny recipes.

Rewards here are importable as `pg_helpers:<factory>` (pytest puts this folder on `sys.path`; forked and
debug-launcher processes inherit it).
"""

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

DEEPSPEED_INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8"


def require_deepspeed():
    """`import deepspeed` for a test: skip only when DeepSpeed is not installed at all; when it is installed (a
    distribution or a package on the path) but fails to import, the import error fails the test instead of hiding
    behind a skip, as `pytest.importorskip` does for a missing dependency of DeepSpeed."""
    import importlib.metadata
    import importlib.util

    try:
        importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip(f"deepspeed is not installed; install it with: {DEEPSPEED_INSTALL}")
    import deepspeed

    return deepspeed


@dataclass
class _Reward:
    name: str
    fn: object
    differentiable: bool = False
    higher_is_better: bool = True

    def __call__(self, images, prompts, metadata=None):
        from rewards.base import RewardOutput

        scores = self.fn(images, prompts).float()
        return RewardOutput(scores=scores, info={"brightness": images.mean(dim=(1, 2, 3)).float()})


def brightness():
    """Mean pixel value in [0, 1]: an easy, smooth target for the policy."""
    return _Reward("brightness", lambda images, prompts: images.mean(dim=(1, 2, 3)))


def smooth_brightness():
    """Brightness with its graph kept: a differentiable reward (pathwise gradients, `bench gradient --pathwise`)."""
    return _Reward("smooth_brightness", lambda images, prompts: images.mean(dim=(1, 2, 3)), differentiable=True)


def redness():
    """Red minus the mean of green and blue: a second, different reward (used as a "gold" reward in tests)."""
    def fn(images, prompts):
        return images[:, 0].mean(dim=(1, 2)) - images[:, 1:].mean(dim=(1, 2, 3))

    return _Reward("redness", fn)


def nan_for_dog():
    """Brightness, but NaN for every prompt that mentions a dog (to test the NaN guard)."""

    def fn(images, prompts):
        scores = images.mean(dim=(1, 2, 3)).clone()
        for i, p in enumerate(prompts):
            if "dog" in p:
                scores[i] = float("nan")
        return scores

    return _Reward("nan_for_dog", fn)


def constant():
    """0.5 for every image: no sample is better than another."""
    return _Reward("constant", lambda images, prompts: torch.full((images.shape[0],), 0.5))


def all_nan():
    return _Reward("all_nan", lambda images, prompts: torch.full((images.shape[0],), float("nan")))


def kill_after_checkpoint(run_dir: str, step: int):
    """Brightness, except that the first call after `run_dir/checkpoints/step-<step>` exists SIGKILLs this process
    (once: a marker file remembers it), the way a preempted job dies mid-epoch right after a checkpoint."""
    marker = Path(run_dir) / "killed.marker"

    def fn(images, prompts):
        if (Path(run_dir) / "checkpoints" / f"step-{step}").is_dir() and not marker.exists():
            marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return images.mean(dim=(1, 2, 3))

    return _Reward("kill_after_checkpoint", fn, differentiable=True)  # mean brightness keeps its graph (DRaFT)


def tiny_pipeline_dir(root: Path) -> Path:
    """Save the samplers' tiny random SD pipeline (DDIM, 16x16 images, 8x8 latents) to `root/tiny-sd` once."""
    path = Path(root) / "tiny-sd"
    if not (path / "model_index.json").is_file():
        from samplers.testing import tiny_sd_pipeline

        tiny_sd_pipeline(path)
    return path


def tiny_flow_pipeline_dir(root: Path) -> Path:
    """Save the samplers' tiny random SD3 pipeline (flow matching, 16x16 images) to `root/tiny-sd3` once."""
    path = Path(root) / "tiny-sd3"
    if not (path / "model_index.json").is_file():
        from samplers.testing import tiny_sd3_pipeline

        tiny_sd3_pipeline(path)
    return path


# trainers of flow-matching models: their tiny recipes run on the tiny SD3 pipeline instead of the tiny SD one
FLOW_TRAINERS = ("flow_grpo", "diffusion_nft", "awm", "adjoint_matching")

PROMPTS = ["a red circle", "a blue square", "a green dog", "a yellow star"]

# The contract tests' tiny settings of each registered trainer (groups merged over `tiny_recipe`'s): a trainer in
# `diffrl.trainers.TRAINERS` without an entry here fails `test_contract.py::test_every_registered_trainer_has_a_tiny_recipe`.
DPOK_TINY = {"trainer": "dpok", "optim": {"learning_rate": 1e-2, "gradient_accumulation_steps": 1},
             "train": {"batch_size": 2, "policy_steps": 2, "value_batch_size": 4, "value_steps": 1,
                       "reward_weight": 1.0}}
DRAFT_TINY = {"trainer": "draft", "reward": {"name": "pg_helpers:smooth_brightness"}, "sample": {"eta": 0.0},
              "optim": {"learning_rate": 1e-2}, "train": {"truncation": "last", "k": 1}}
RAFT_TINY = {"trainer": "raft", "optim": {"learning_rate": 1e-2},
             "train": {"samples_per_prompt": 2, "batch_size": 1}}
D3PO_TINY = {"trainer": "d3po", "optim": {"learning_rate": 1e-2}, "train": {"batch_size": 1}}
# Flow-GRPO's LoRA targets for SD3 (both streams' attention projections) less `attn.add_q_proj`: in the last block
# (`context_pre_only`) the text tokens' queries feed only text outputs that are discarded, so it never gets a gradient
SD3_LORA_TARGETS = ["attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
                    "attn.to_q", "attn.to_v"]
FLOW_GRPO_TINY = {"trainer": "flow_grpo", "optim": {"learning_rate": 1e-2}, "advantage": {"group_size": 2},
                  "model": {"lora": {"rank": 2, "alpha": 2.0, "target_modules": SD3_LORA_TARGETS}},
                  "train": {"batch_size": 2, "clip_range": 0.2}}
NFT_TINY = {"trainer": "diffusion_nft", "optim": {"learning_rate": 1e-2},
            "model": {"lora": {"rank": 2, "alpha": 2.0, "target_modules": SD3_LORA_TARGETS}},
            "sample": {"eta": 0.0, "guidance_scale": 1.0},  # CFG-free ODE rollouts, as the paper
            "advantage": {"group_size": 2}, "train": {"batch_size": 2, "kl_beta": 1e-4}}
# AWM: the same CFG-free ODE rollouts; 2 t values per sample (of the 3-step schedule's first int(3·0.9) = 2), both KL
# terms on; 2 optimizer steps per epoch, so the second micro-batch's ratio is to the epoch-start weights
AWM_TINY = {"trainer": "awm", "optim": {"learning_rate": 1e-2},
            "model": {"lora": {"rank": 2, "alpha": 2.0, "target_modules": SD3_LORA_TARGETS}},
            "sample": {"eta": 0.0, "guidance_scale": 1.0},
            "advantage": {"group_size": 2}, "train": {"batch_size": 2, "train_timesteps": 2, "kl_beta": 1e-4}}
# Adjoint Matching: the memoryless SDE (a = √2), a differentiable reward, every step of the 3-step schedule trained
ADJOINT_TINY = {"trainer": "adjoint_matching", "reward": {"name": "pg_helpers:smooth_brightness"},
                "optim": {"learning_rate": 1e-2},
                "model": {"lora": {"rank": 2, "alpha": 2.0, "target_modules": SD3_LORA_TARGETS}},
                "sample": {"eta": 2**0.5}, "train": {"batch_size": 2}}
# Diffusion-DPO trains offline on a label file: 6 pairs of 16x16 noise images of random brightness (4 labelled, one
# tie, one unlabelled: both skipped), made once with numpy and committed; 2 optimizer steps of 2 pairs per epoch.
TINY_PAIRS = str(Path(__file__).parent / "data" / "pairs" / "pairs.jsonl")
DPO_TINY = {"trainer": "diffusion_dpo",
            "optim": {"learning_rate": 1e-2, "gradient_accumulation_steps": 1, "lr_scheduler": "constant",
                      "lr_warmup_steps": 0},
            "train": {"pairs": TINY_PAIRS, "batch_size": 2, "steps_per_epoch": 2}}
# PRDP: 2 prompts x 2 chains per process and epoch, one prompt's pair per micro-batch: 2 optimizer steps per epoch;
# a wide clip (ε = 1): at lr 1e-2 the first step moves the step log-probs past a small ε, which zeroes the second
# step's gradient (as it should), and a fresh LoRA's A matrices get their first gradient only in that second step
PRDP_TINY = {"trainer": "prdp", "optim": {"learning_rate": 1e-2},
             "train": {"group_size": 2, "batch_size": 1, "num_inner_epochs": 1, "beta": 1e-3, "clip_range": 1.0}}
# PXPO: DDPO's tiny settings (a reward without maps: each image's score as its constant map)
PXPO_TINY = {"trainer": "pxpo", "optim": {"learning_rate": 1e-2, "gradient_accumulation_steps": 1},
             "advantage": {"mode": "batch"}, "train": {"batch_size": 2, "clip_range": 0.2}}
# SePPO: the label file's preferred images are the winners (its rejected ones are never read), the reference
# checkpoint's 3-step samples the other side; 2 optimizer steps per epoch, every epoch's start a new checkpoint
SEPPO_TINY = {"trainer": "seppo",
              "optim": {"learning_rate": 1e-2, "gradient_accumulation_steps": 1, "lr_scheduler": "constant",
                        "lr_warmup_steps": 0},
              "train": {"pairs": TINY_PAIRS, "batch_size": 2, "steps_per_epoch": 2}}
TINY = {"ddpo": {"trainer": "ddpo"}, "dpok": DPOK_TINY, "draft": DRAFT_TINY, "raft": RAFT_TINY, "d3po": D3PO_TINY,
        "flow_grpo": FLOW_GRPO_TINY, "diffusion_nft": NFT_TINY, "diffusion_dpo": DPO_TINY,
        "awm": AWM_TINY, "adjoint_matching": ADJOINT_TINY, "prdp": PRDP_TINY, "pxpo": PXPO_TINY, "seppo": SEPPO_TINY}
# The direction-of-learning test's changes to TINY (test_contract.py): the first optimizer step sees all 8 samples of
# the epoch at the first of the 2 steps (the last one's tiny σ makes any weight change lower every sample's
# likelihood, which hides the first-order shift), and DPOK's advantage is the batch-normalised reward (its default, the
# raw reward, is about 0.44 for every sample: all likelihoods rise alike) without an untrained value network's guess
DIRECTION = {"ddpo": {"train": {"batch_size": 8, "skip_final_steps": 1}},
             "pxpo": {"train": {"batch_size": 8, "skip_final_steps": 1}},
             "dpok": {"train": {"batch_size": 8, "skip_final_steps": 1, "value_baseline": False},
                      "advantage": {"mode": "batch"}},
             # the flow SDE's std on a few coarse steps is about a·√|Δt|, far above DDIM's σ_t at the same step count,
             # so a weight change moves its log-probs less: at a small noise level a and with every eligible step
             # trained the shift is measured at 2.3e-3 (r) and −2.3e-3 (−r)
             "flow_grpo": {"train": {"batch_size": 8, "skip_final_steps": 1, "timestep_fraction": 1.0},
                           "advantage": {"mode": "batch"}, "sample": {"num_steps": 4, "eta": 0.05}},
             "diffusion_nft": {},  # its direction check is test_diffusion_nft._fit_shift's own small run
             "awm": {},  # its direction check is test_awm._fit_shift's own small run
             # brightness's gradient in the latents is ~1e-3 (a mean over pixels): λ = 1000 lifts the adjoint above a
             # fresh LoRA's drift; 6 steps, as the memoryless SDE's last step on 2 coarse ones adds noise of std ≈ 2 to
             # the final latents; measured +2.4e-4 (r) and −2.4e-4 (−r)
             "adjoint_matching": {"train": {"reward_scale": 1000.0}, "sample": {"num_steps": 6}},
             "draft": {}, "raft": {"sample": {"batch_size": 8}, "optim": {"learning_rate": 1e-3},
                                   "train": {"samples_per_prompt": 4, "batch_size": 4, "finetune_epochs": 8}},
             "d3po": {"sample": {"batch_size": 8, "num_batches_per_epoch": 1},
                      "train": {"batch_size": 4, "skip_final_steps": 1}},
             "diffusion_dpo": {"optim": {"learning_rate": 1e-3},
                               "train": {"steps_per_epoch": 8, "batch_size": 4, "uncond_fraction": 0.0}},
             # PRDP with pairs (group_size 2): samples 2i, 2i+1 are one prompt's chains, all 4 pairs in one step
             "prdp": {"sample": {"batch_size": 8, "num_batches_per_epoch": 1},
                      "train": {"group_size": 2, "batch_size": 4, "skip_final_steps": 1}},
             # SePPO as Diffusion-DPO: the 4 labelled pairs' winners each micro-batch, 8 steps at lr 1e-3
             "seppo": {"optim": {"learning_rate": 1e-3}, "train": {"steps_per_epoch": 8, "batch_size": 4}}}


def policy_gradient_trainers() -> list[str]:
    """The registered trainers that compute advantages (an `advantage:` group)."""
    from diffrl.trainers import get_trainer

    return [t for t in registered_trainers() if get_trainer(t).ADVANTAGE_DEFAULTS is not None]


def offline_trainers() -> list[str]:
    """The registered trainers that learn from a dataset of preference pairs (`train.pairs`) instead of rollouts."""
    return trainers_with_train_field("pairs")


def trainers_with_train_field(name: str) -> list[str]:
    """The registered trainers whose `train:` group has a field `name` (a capability: `skip_final_steps`,
    `sde_window`, `clip_range` for a ratio of recomputed to rollout log-probs, ...)."""
    import dataclasses

    from diffrl.trainers import get_trainer

    return [t for t in registered_trainers()
            if name in {f.name for f in dataclasses.fields(get_trainer(t).TrainConfig)}]


def registered_trainers() -> list[str]:
    """Every trainer of the registry: parametrising a test over this enrols each new trainer automatically."""
    from diffrl.trainers import TRAINERS

    return sorted(TRAINERS)


def tiny_recipe(pipeline_dir: Path, output_dir: Path, **groups) -> dict:
    """A raw recipe dict for a seconds-long DDPO run on the tiny pipeline; `groups` update its groups."""
    recipe = {
        "trainer": "ddpo",
        "run": {"name": "t", "output_dir": str(output_dir), "seed": 0, "num_epochs": 2, "save_every": 1,
                "eval_every": 0},
        "model": {"pipeline": str(pipeline_dir), "lora": {"rank": 2, "alpha": 2.0}},
        "sample": {"num_steps": 3, "guidance_scale": 3.0, "eta": 1.0, "batch_size": 2, "num_batches_per_epoch": 2,
                   "eval_num_images": 4},
        "reward": {"name": "pg_helpers:brightness"},
        "prompts": {"source": PROMPTS},
        "log": {"tracker": "none", "image_every": 1, "grid_images": 4},
        "optim": {"learning_rate": 1e-2, "gradient_accumulation_steps": 1},
        "advantage": {"mode": "batch"},
        "train": {"batch_size": 2, "clip_range": 0.2},
    }
    if groups.get("trainer") in FLOW_TRAINERS and Path(pipeline_dir).is_dir():  # not for an embedded model's name
        recipe["model"]["pipeline"] = str(tiny_flow_pipeline_dir(Path(pipeline_dir).parent))
    if groups.get("trainer", "ddpo") != "ddpo":
        recipe["train"], recipe["optim"] = {}, {}  # the fields above are DDPO's
        del recipe["advantage"]
    for group, values in groups.items():
        if isinstance(values, dict) and isinstance(recipe.get(group), dict):
            recipe[group] = {**recipe[group], **values}
        else:
            recipe[group] = values
    return recipe


def load_cfg(recipe: dict, overrides=()):
    from diffrl.config import config_from_dict

    return config_from_dict(recipe, list(overrides))


def trainable_params(unet) -> dict:
    return {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}


@dataclass
class StepLog:
    """A `step_callback` that records each optimizer step's weight fingerprint."""

    steps: list = field(default_factory=list)

    def __call__(self, info: dict) -> None:
        from diffrl.training.distributed import weights_fingerprint

        self.steps.append((info["global_step"], weights_fingerprint(info["params"])))


def route(**values) -> dict:
    """Keyword options as recipe groups: keys of the shared `optim:` / `advantage:` groups go there, the rest to
    `train:` (so a test can say `learning_rate=1.0, clip_range=0.2` in one call)."""
    import dataclasses

    from diffrl.config import AdvantageGroup, OptimGroup

    groups: dict = {"train": {}, "optim": {}, "advantage": {}}
    for key, value in values.items():
        for name, cls in (("optim", OptimGroup), ("advantage", AdvantageGroup)):
            if key in {f.name for f in dataclasses.fields(cls)}:
                groups[name][key] = value
                break
        else:
            groups["train"][key] = value
    return {name: group for name, group in groups.items() if group}


def with_trainer(groups: dict, trainer: str) -> dict:
    """`groups` with the trainer's contract-test settings (`TINY[trainer]`) merged in, group by group."""
    out = dict(groups)
    for group, values in TINY[trainer].items():
        out[group] = {**out.get(group, {}), **values} if isinstance(values, dict) else values
    return out


def signed_brightness(sign: float = 1.0):
    """sign × mean pixel value, with its graph kept: the contract tests' trivially learnable reward (r and −r)."""
    return _Reward("signed_brightness", lambda images, prompts: sign * images.mean(dim=(1, 2, 3)), differentiable=True)


def launch(function, args=(), num_processes: int = 2) -> None:
    """accelerate's `debug_launcher` (CPU processes over gloo), one at a time on this machine: its processes meet at
    the fixed port 29500, so two launches at once (two pytest-xdist workers) would join each other's group.

    The processes are forked from this one, so accelerate's state singletons are reset first: a trainer test that ran
    earlier in this pytest process leaves them initialised as one process, and every fork would inherit that and
    believe it is the main (and only) process."""
    import fcntl
    import tempfile

    from accelerate import debug_launcher
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)

    with open(Path(tempfile.gettempdir()) / "diffrl-tests-debug-launcher.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            debug_launcher(function, args=args, num_processes=num_processes)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
