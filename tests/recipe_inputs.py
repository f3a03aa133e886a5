"""Input files that shipped recipes name (relative to the working directory), made in a temp working directory before
a recipe-validation test loads such a recipe; and a synthetic D3PO label file for the label-file tests."""

from pathlib import Path

import torch


def write_label_file(folder: Path, *, num_steps: int, guidance_scale: float, eta: float, choices=(0,),
                     latent_shape=(4, 8, 8), image_size: int = 16) -> Path:
    """A synthetic D3PO label file (`folder/pairs.jsonl`): one pair per choice, random images and chains saved as
    `diffrl pairs sample` saves them (without sampling anything). Returns the file."""
    import json

    import numpy as np
    from PIL import Image
    from safetensors.torch import save_file

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "latents").mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    lines = []
    for i, choice in enumerate(choices):
        names = [f"images/{i:05d}-{k}.png" for k in range(2)]
        for name in names:
            pixels = (torch.rand(image_size, image_size, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(np.asarray(pixels)).save(folder / name)
        meta = {"num_steps": str(num_steps), "guidance_scale": str(float(guidance_scale)), "eta": str(float(eta)),
                "negative_prompt": "", "pipeline": "", "lora": "", "sample_seeds": json.dumps([2 * i, 2 * i + 1])}
        save_file({"latents": torch.randn(2, num_steps + 1, *latent_shape, generator=g),
                   "timesteps": ddim_timesteps(num_steps),
                   "log_probs": torch.zeros(2, num_steps)}, str(folder / f"latents/{i:05d}.safetensors"), metadata=meta)
        lines.append({"prompt": f"prompt {i}", "seed": i, "images": names, "choice": choice,
                      "latents": f"latents/{i:05d}.safetensors"})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def ddim_timesteps(num_steps: int) -> torch.Tensor:
    """The timesteps the ddim sampler takes for `num_steps` on the tiny test pipelines and tiny-shapes (DDIM, 1000
    training steps, "leading" spacing, steps_offset 1): what a label file's chains hold to fit them."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
    scheduler.set_timesteps(num_steps)
    return scheduler.timesteps.long()


def _labels_for_recipe(workdir: Path) -> None:
    write_label_file(Path(workdir) / "labels", num_steps=10, guidance_scale=5.0, eta=1.0)


# Input files a shipped recipe names (relative to the working directory), made in a temp working directory before the
# recipe-validation test loads it: recipe name -> function(workdir).
RECIPE_INPUTS = {"d3po/tiny_shapes_labels": _labels_for_recipe}
