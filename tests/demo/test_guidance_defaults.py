"""Reward guidance as the Generate page runs it: the reward gradient on the last 15 % of the steps at scale 2 unless
the settings box says otherwise (measured in docs/demo.md: `diffrl steer`'s scale 1 on every step degraded the
images), through gradio_client against `steer()` with those settings written out by hand."""

import pytest
from demo_helpers import PROMPT, demo_module, require_gradio
from test_endpoints import generate_args

require_gradio()

CLIP = "clip_score (tiny-shapes-clip)"


def test_the_pages_guidance_settings_by_hand():
    engine = demo_module("engine")
    assert engine.page_defaults("guidance", 20) == {"scale": 2.0, "start": 17}  # steps 17, 18, 19
    assert engine.page_defaults("guidance", 50) == {"scale": 2.0, "start": 42}  # the last 8 (15 % is 7.5)
    assert engine.page_defaults("guidance", 2) == {"scale": 2.0, "start": 1}  # at least the last step
    assert engine.page_defaults("fk", 20) == {}  # the other methods take `diffrl steer`'s
    help_text = demo_module("app").method_help_text("guidance")
    assert "`scale=2.0`" in help_text and "17 at 20 steps" in help_text and "last 15%" in help_text


@pytest.mark.parametrize("settings, by_hand", [
    ("", {"scale": 2.0, "start": 7}),  # 8 steps: 8 − round(1.2) = 7, the last step only
    ("scale=0.5, start=2", {"scale": 0.5, "start": 2}),  # typed settings win
])
def test_guidance_runs_with_the_pages_settings(client, demo_app, settings, by_hand):
    from diffrl.steering import steer

    engine = demo_app[1]
    if CLIP not in engine.reward_table():
        pytest.skip("the embedded tiny-shapes-clip is not built")
    _, _, _, scores, _, _, _ = client.predict(
        *generate_args(engine, {CLIP: 1.0}, method="guidance", budget=1, steps=8, seed=5, num_images=1,
                       settings=settings), api_name="/generate")
    _, expected, info = steer(engine.pipeline("tiny-shapes"), [PROMPT], engine.reward({CLIP: 1.0})[0], "guidance",
                              num_steps=8, guidance_scale=5.0, seed=5, num_samples=1, **by_hand)
    assert info["guided_steps"] == list(range(by_hand["start"], 8))
    assert scores["images"][0]["total"] == pytest.approx(float(expected[0]), abs=1e-4)
