"""CADS (condition-annealed sampling) on the Generate page, through gradio_client: plain sampling gives the pixels
`diffrl sample --cads` writes for the same seeds, a steered image the score `steer(cads=...)` returns, and a bad
setting is a message."""

import json

import numpy as np
import pytest
from demo_helpers import PROMPT, require_gradio
from test_endpoints import STEPS, generate_args, pixels, shown_at_model_size

require_gradio()

from gradio_client.exceptions import AppError


def test_plain_sampling_with_cads_gives_what_diffrl_sample_cads_writes(client, demo_app, tmp_path):
    from diffrl.cli import main

    engine = demo_app[1]
    out = tmp_path / "sample"
    assert main(["sample", "--pipeline", "tiny-shapes", "--prompt", PROMPT, "-n", "2", "--steps", str(STEPS),
                 "--guidance-scale", "5", "--seed", "7", "--cads", "tau1=0.3,tau2=0.95", "--reward",
                 "shapes_verifier", "--out", str(out)]) == 0
    expected = {r["seed"]: r for r in json.loads((out / "scores.json").read_text())}

    gallery, summary, _, scores, _, _, _ = client.predict(
        *generate_args(engine, seed=7, num_images=2, cads="tau1=0.3,tau2=0.95"), api_name="/generate")
    plain, _, _, plain_scores, _, _, _ = client.predict(*generate_args(engine, seed=7, num_images=2),
                                                        api_name="/generate")
    assert "CADS" in summary and scores["cads"] == {"tau1": 0.3, "tau2": 0.95, "noise_scale": 0.25, "mix": 1.0,
                                                    "seed": 0}
    for item, shown in zip(scores["images"], gallery):
        image = shown_at_model_size(shown["image"])
        assert np.abs(image - pixels(out / expected[item["seed"]]["file"])).max() <= 1
    with_cads, without = _by_seed(gallery, scores), _by_seed(plain, plain_scores)
    assert any(not np.array_equal(with_cads[s], without[s]) for s in (7, 8))  # CADS changed the images


def _by_seed(gallery, scores) -> dict:
    return {item["seed"]: shown_at_model_size(shown["image"]) for item, shown in zip(scores["images"], gallery)}


def test_steering_with_cads_matches_steer(client, demo_app):
    import torch

    from diffrl.steering import steer

    engine = demo_app[1]
    _, summary, _, scores, _, _, _ = client.predict(
        *generate_args(engine, method="best-of-n", seed=3, num_images=1, budget=3, cads="on"), api_name="/generate")
    with torch.no_grad():
        _, expected, info = steer(engine.pipeline("tiny-shapes"), [PROMPT], "shapes_verifier", "best-of-n",
                                  num_steps=STEPS, guidance_scale=5.0, seed=3, num_samples=3, cads="on")
    assert info["cads"] is not None and scores["cads"] == info["cads"]
    assert scores["images"][0]["total"] == pytest.approx(float(expected[0]))
    assert "CADS" in summary and "NFE 12 " in summary


@pytest.mark.parametrize("cads, message", [
    ("tau3=1", "'tau3=1' is not one of tau1=, tau2="),
    ("tau1=x", "tau1='x' is not a number"),
])
def test_a_bad_cads_setting_is_a_message(client, demo_app, cads, message):
    with pytest.raises(AppError, match=message):
        client.predict(*generate_args(demo_app[1], cads=cads, steps=1, num_images=1), api_name="/generate")


def test_cads_is_off_by_default_and_its_help_says_what_it_does(client):
    info = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/generate"]
    defaults = {p["parameter_name"]: p["parameter_default"] for p in info["parameters"]}
    assert defaults["cads"] == "off"
    (box,) = [c for c in client.config["components"] if c.get("props", {}).get("elem_id") == "generate-cads"]
    help_text = box["props"]["info"]
    assert "condition" in help_text and "every method" in help_text and "tau1=0.6" in help_text
