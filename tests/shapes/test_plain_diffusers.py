"""The shipped tiny-shapes folder and a run's LoRA load in plain diffusers, with no dtype given, and generate.

Only the LoRA is made with diffrl (`diffrl run`, one optimizer step); loading and sampling use diffusers' own
`StableDiffusionPipeline.from_pretrained` and `load_lora_weights`, as a user without diffrl would.
"""

from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline

from diffrl.cli import main

FOLDER = Path(__file__).resolve().parents[2] / "diffrl" / "shapes" / "assets" / "tiny-shapes"


def _generate(pipe, **kwargs):
    generator = torch.Generator().manual_seed(0)
    return pipe("a red circle", num_inference_steps=3, guidance_scale=5.0, generator=generator, output_type="pt",
                **kwargs).images


def test_tiny_shapes_and_a_run_lora_load_in_plain_diffusers(tmp_path):
    # the LoRA of a one-step run on tiny-shapes (a high learning rate, so one AdamW step visibly moves it)
    assert main(["run", "ddpo/tiny_shapes_verifier", f"run.output_dir={tmp_path}", "run.name=r", "run.num_epochs=1",
                 "run.eval_every=0", "reward.name=jpeg_compressibility", "sample.num_steps=2", "sample.batch_size=2", "sample.num_batches_per_epoch=1",
                 "train.batch_size=2", "optim.gradient_accumulation_steps=1", "optim.learning_rate=0.05",
                 "advantage.mode=batch", "advantage.group_size=1", "log.tracker=none", "log.image_every=0"]) == 0
    (checkpoint,) = (tmp_path / "r" / "checkpoints").iterdir()

    pipe = StableDiffusionPipeline.from_pretrained(FOLDER)  # no dtype: every component must come up in fp32
    pipe.set_progress_bar_config(disable=True)
    assert {pipe.unet.dtype, pipe.vae.dtype, pipe.text_encoder.dtype} == {torch.float32}
    before = _generate(pipe)
    assert before.shape == (1, 3, 32, 32) and torch.isfinite(before).all()

    pipe.load_lora_weights(checkpoint)
    after = _generate(pipe)
    assert torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-3  # the adapter is loaded and active

    # the same images as diffrl's own loader gives for the run dir (LoRA scale alpha/rank read the same way)
    from diffrl.pipelines import load_pipeline

    ours = load_pipeline("tiny-shapes", lora=tmp_path / "r")
    torch.testing.assert_close(_generate(ours), after)


def test_tiny_shapes_flow_loads_in_plain_diffusers_with_its_one_text_tower():
    # the folder stores its CLIP tower once (SD3's second tower is the same one) and has no T5: plain diffusers
    # is given those, and the T5 length the model was trained with (0), as the README says
    import pytest
    from diffusers import StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    from diffrl.embedded import is_built
    from diffrl.pipelines import load_pipeline

    if not is_built("tiny-shapes-flow"):
        pytest.skip("tiny-shapes-flow is not built")
    folder = FOLDER.parent / "tiny-shapes-flow"
    tower = CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_2=tower, tokenizer_2=tokenizer,
                                                    text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    assert {pipe.transformer.dtype, pipe.vae.dtype, pipe.text_encoder.dtype} == {torch.float32}
    images = _generate(pipe, max_sequence_length=0)
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()
    torch.testing.assert_close(_generate(load_pipeline("tiny-shapes-flow"), max_sequence_length=0), images)
