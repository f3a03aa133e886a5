"""Checks of what a config names — the pipeline, the rewards and the prompts — without loading any weights.

`diffrl validate`, `diffrl run` and `diffrl resume` run them before a run dir exists, and `diffrl pairs sample`
before it samples. They sit a layer above `diffrl.config`, beside what they look up (`diffrl.pipelines`,
`diffrl.prompts`, `rewards.registry`), so that config imports none of those: config checks a recipe's keys, types
and ranges; this module checks that what the recipe names exists and fits.
"""

from diffrl.checks import check_num_steps
from diffrl.config import EVAL_SIZE_KEYS, RunConfig, check_prompt_length
from diffrl.errors import UserError
from diffrl.pipelines import check_lora_targets, check_pipeline, check_sampling_size, read_scheduler_config
from diffrl.prompts import load_prompts
from rewards.registry import check_reward_options, get_reward_factory


def check_references(cfg: RunConfig) -> None:
    """Check that the pipeline (its configs, a UNet, modules matching the LoRA targets), the rewards (and their
    options) and the prompts a config names exist, without loading any weights.

    Raises:
        `UserError`: the first thing that does not resolve.
    """
    try:
        unet_config = check_pipeline(cfg.model.pipeline, revision=cfg.model.revision or None)
    except UserError as e:
        raise UserError(f"model.pipeline: {e}") from None
    if unet_config is not None and not cfg.model.full_finetune:
        check_lora_targets(unet_config, cfg.model.lora.target_modules, cfg.model.pipeline)
    scheduler_config = read_scheduler_config(cfg.model.pipeline, revision=cfg.model.revision or None)
    for key in ("sample.num_steps", "sample.eval_num_steps"):
        check_num_steps(key, getattr(cfg.sample, key.split(".")[1]), scheduler_config)
    s = cfg.sample
    check_sampling_size(cfg.model.pipeline, height=s.height, width=s.width, num_frames=s.num_frames,
                        revision=cfg.model.revision or None)
    if s.eval_height or s.eval_width or s.eval_num_frames:  # evaluation's size: each side 0 = the training one
        check_sampling_size(cfg.model.pipeline, height=s.eval_height or s.height, width=s.eval_width or s.width,
                            num_frames=s.eval_num_frames or s.num_frames, revision=cfg.model.revision or None,
                            keys=EVAL_SIZE_KEYS)
    names = [("reward.name", cfg.reward.name, "reward.kwargs", cfg.reward.kwargs)] if cfg.reward.name else []
    names += [(f"reward.components.{i}.name", c.name, f"reward.components.{i}.kwargs", c.kwargs)
              for i, c in enumerate(cfg.reward.components)]
    if cfg.reward.gold:
        names.append(("reward.gold", cfg.reward.gold, "reward.gold_kwargs", cfg.reward.gold_kwargs))
    for key, name, kwargs_key, kwargs in names:
        try:
            get_reward_factory(name)
        except UserError as e:
            raise UserError(f"{key}: {e}") from None
        try:
            check_reward_options(name, kwargs)
        except UserError as e:
            raise UserError(f"{kwargs_key}: {e}") from None
    for key, source in (("prompts.source", cfg.prompts.source), ("prompts.eval_source", cfg.prompts.eval_source)):
        if source in ("", []):
            continue
        try:
            prompts = load_prompts(source)
        except UserError as e:
            raise UserError(f"{key}: {e}") from None
        for i, prompt in enumerate(prompts):
            check_prompt_length(prompt, f"{key}: prompt {i + 1}")
