"""Several weighted rewards make one total on a common scale: each standardised by its mean and spread on base
tiny-shapes samples (the table in docs/demo.md), so that PickScore (~12, spread ~3) no longer outweighs the verifier
(0 to 1) by its units. Expected totals are worked out here from the documented numbers and the raw scores."""

import pytest
from demo_helpers import demo_module, require_gradio
from test_endpoints import generate_args

require_gradio()

VERIFIER, PICKSCORE, CLIP = "shapes_verifier", "pickscore (tiny-shapes-pickscore)", "clip_score (tiny-shapes-clip)"
# the numbers below are docs/demo.md's: mean ± spread over 128 plain tiny-shapes samples
# (python -m demo.measure_reward_scales): verifier 0.53 ± 0.40, PickScore 11.8 ± 3.1, CLIP 71.1 ± 21.4


def test_the_combination_by_hand():
    combine = demo_module("engine").combine
    both = combine({VERIFIER: 1.0, PICKSCORE: 0.5, CLIP: 0.0})
    assert set(both.weights) == {VERIFIER, PICKSCORE} and both.raw == []
    # a perfect verifier (1) and PickScore 12.5: 1·(1 − 0.53)/0.40 + 0.5·(12.5 − 11.8)/3.1 = 1.175 + 0.112903...
    assert both.term(VERIFIER, 1.0) + both.term(PICKSCORE, 12.5) == pytest.approx(1.175 + 0.35 / 3.1)
    # what the methods steer on: 2.5·verifier + (0.5/3.1)·PickScore, which is the total plus 0.53/0.4 + 5.9/3.1
    assert both.acting_weights == pytest.approx({VERIFIER: 2.5, PICKSCORE: 0.5 / 3.1})
    assert both.offset == pytest.approx(1.325 + 5.9 / 3.1)
    alone = combine({VERIFIER: 0.0, CLIP: 2.0})  # one reward: its raw score × its weight, as `diffrl steer`
    assert alone.term(CLIP, 70.0) == 140.0 and alone.offset == 0.0 and alone.acting_weights == {CLIP: 2.0}
    unmeasured = combine({VERIFIER: 1.0, "imagereward": 2.0})  # a real model's reward has no measured spread
    assert unmeasured.raw == ["imagereward"] and unmeasured.term("imagereward", 0.3) == pytest.approx(0.6)
    assert unmeasured.term(VERIFIER, 0.53) == pytest.approx(0.0)


def test_generate_totals_are_the_standardised_sum(client, demo_app):
    engine = demo_app[1]
    if PICKSCORE not in engine.reward_table():
        pytest.skip("the embedded tiny-shapes-pickscore is not built")
    weights = {VERIFIER: 1.0, PICKSCORE: 0.5}
    _, summary, _, scores, _, breakdown, _ = client.predict(
        *generate_args(engine, weights, seed=4, num_images=3), api_name="/generate")
    for item in scores["images"]:
        by_hand = 1.0 * (item[VERIFIER] - 0.53) / 0.40 + 0.5 * (item[PICKSCORE] - 11.8) / 3.1
        assert item["total"] == pytest.approx(by_hand, abs=1e-5)
    # the raw scores are each reward's own: PickScore alone (weight 1: its score is the total) gives the same numbers
    _, _, _, alone, _, _, _ = client.predict(*generate_args(engine, {PICKSCORE: 1.0}, seed=4, num_images=3),
                                             api_name="/generate")
    assert ({i["seed"]: i[PICKSCORE] for i in scores["images"]}
            == pytest.approx({i["seed"]: i["total"] for i in alone["images"]}))
    headers = breakdown["headers"]
    assert "1 × (shapes_verifier − 0.53) / 0.4" in headers
    assert "0.5 × (pickscore (tiny-shapes-pickscore) − 11.8) / 3.1" in headers
    for row in breakdown["data"]:
        parts = [row[headers.index(h)] for h in headers if h.startswith(("1 × (", "0.5 × ("))]
        assert sum(parts) == pytest.approx(row[headers.index("total")], abs=2e-4)  # each rounded to 4 decimals
    assert "standardised by its mean ± spread" in summary and "shapes_verifier 0.53 ± 0.4" in summary
