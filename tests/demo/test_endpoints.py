"""Every endpoint of the demo, called with gradio_client on an app launched in-process (CPU, tiny-shapes, few steps).

Expected values come from elsewhere: plain generation must give the pixels `diffrl sample` writes for the same seeds,
steering the scores `steer()` returns for the same settings, the verifier 1.0 on a ShapesWorld render of its caption,
the JPEG reward minus the JPEG size PIL writes.
"""

import io
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from demo_helpers import PROMPT, demo_module, make_pairs, require_gradio

require_gradio()

from gradio_client import handle_file
from gradio_client.exceptions import AppError

STEPS = 4


def generate_args(engine, weights=None, **changes):
    values = {"pipeline": "tiny-shapes", "lora": "", "prompt": PROMPT, "negative": "", "seed": 0, "randomise": False,
              "steps": STEPS, "guidance": 5.0, "num_images": 2, "method": "plain", "budget": 2, "settings": "",
              "cads": "off"}
    values.update(changes)
    weights = weights or {"shapes_verifier": 1.0}
    return [*values.values(), *(weights.get(label, 0.0) for label in engine.reward_table())]


def pixels(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB")).astype(int)


def shown_at_model_size(path, size: int = 32) -> np.ndarray:
    """A gallery image (enlarged by nearest neighbour) back at the model's resolution."""
    array = pixels(path)
    factor = array.shape[0] // size
    return array[::factor, ::factor]


def test_plain_generation_gives_what_diffrl_sample_writes(client, demo_app, tmp_path):
    from diffrl.cli import main

    engine = demo_app[1]
    out = tmp_path / "sample"
    assert main(["sample", "--pipeline", "tiny-shapes", "--prompt", PROMPT, "-n", "3", "--steps", str(STEPS),
                 "--guidance-scale", "5", "--seed", "7", "--reward", "shapes_verifier", "--out", str(out)]) == 0
    expected = {r["seed"]: r for r in json.loads((out / "scores.json").read_text())}

    gallery, summary, _, scores, seed, breakdown, _ = client.predict(*generate_args(engine, seed=7, num_images=3),
                                                                  api_name="/generate")
    # the per-reward breakdown is on the page, one row per image in gallery order, rounded
    assert breakdown["headers"][:3] == ["rank", "seed", "total"]
    assert [row[1] for row in breakdown["data"]] == [str(item["seed"]) for item in scores["images"]]
    assert [row[2] for row in breakdown["data"]] == [round(item["total"], 4) for item in scores["images"]]
    assert seed == 7
    assert f"NFE {STEPS * 3} " in summary  # one model evaluation per image and step (a CFG pair counts once)
    assert scores["nfe"] == STEPS * 3
    totals = [item["total"] for item in scores["images"]]
    assert totals == sorted(totals, reverse=True)  # best reward first
    assert sorted(item["seed"] for item in scores["images"]) == [7, 8, 9]
    for item, shown in zip(scores["images"], gallery):
        assert shown["caption"] == f"{item['total']:.3f} · seed {item['seed']}"  # the reward first, uncut
        reference = expected[item["seed"]]
        assert item["shapes_verifier"] == pytest.approx(reference["shapes_verifier"])
        image = shown_at_model_size(shown["image"])
        assert image.std() > 5  # not blank
        assert np.abs(image - pixels(out / reference["file"])).max() <= 1


def test_fk_streams_particle_populations_and_matches_steer(client, demo_app):
    import torch

    from diffrl.steering import steer

    engine = demo_app[1]
    job = client.submit(*generate_args(engine, method="fk", seed=3, num_images=2, budget=3, settings="interval=1"),
                        api_name="/generate")
    gallery, summary, _, scores, _, _, _ = job.result()
    previews = [output[2] for output in job.outputs()[:-1] if output[2]]
    assert previews, "no intermediate populations reached the client"
    # 2 prompts × 3 particles × 4 steps: FK evaluates every particle once per step
    assert scores["nfe"] == 2 * 3 * STEPS and "NFE 24 " in summary
    pipe = engine.pipeline("tiny-shapes")
    expected = {}
    for seed in (3, 4):  # image i is steered on its own from seed + i, as `diffrl steer --prompts-per-call 1`
        with torch.no_grad():
            _, scores_i, info = steer(pipe, [PROMPT], "shapes_verifier", "fk", num_steps=STEPS, guidance_scale=5.0,
                                      seed=seed, num_particles=3, interval=1)
        assert info["nfe"] == 12
        expected[seed] = float(scores_i[0])
    assert {item["seed"]: item["total"] for item in scores["images"]} == pytest.approx(expected)
    assert [g["caption"] for g in gallery] == [f"{item['total']:.3f} · seed {item['seed']}"
                                               for item in scores["images"]]
    assert len(gallery) == 2


def test_reno_optimises_the_lcm_noise(client, demo_app, monkeypatch):
    engine = demo_app[1]
    from diffrl.embedded import is_built

    if not is_built("tiny-shapes-lcm"):
        pytest.skip("the embedded tiny-shapes-lcm pipeline is not built")
    # every report reaches the page: the throttle (tested in test_the_stream_is_throttled_but_keeps_the_last_report)
    # would otherwise decide by timing whether three quick iterations get their own preview
    monkeypatch.setattr(demo_module("app"), "STREAM_INTERVAL_S", 0.0)
    job = client.submit(*generate_args(engine, {"clip_score (tiny-shapes-clip)": 1.0}, pipeline="tiny-shapes-lcm",
                                       method="reno", steps=1, num_images=1, budget=3, guidance=5.0),
                        api_name="/generate")
    _, _, _, scores, _, _, _ = job.result()
    assert scores["nfe"] == 3  # one one-step generation per iteration
    iterations = [o[1] for o in job.outputs()[:-1] if "iteration" in (o[1] or "")]
    assert iterations, "ReNO's iterations were not streamed"


@pytest.mark.parametrize("changes, message", [
    ({"pipeline": "tiny-shape"}, "unknown pipeline 'tiny-shape'"),
    ({"pipeline": "someone/not-cached"}, "is not in the local Hugging Face cache and the demo downloads nothing"),
    ({"method": "guidance"}, "guidance needs a differentiable reward"),
    ({"method": "fk", "settings": "lmbdaa=3"}, "did you mean 'lmbda'"),
    ({"prompt": "  "}, "the prompt is empty"),
    ({"lora": "/no/such/run"}, "is not a run dir under .* the Generate page reads only those"),
    ({"weights": {"shapes_verifier": 0.0}}, "every reward weight is 0"),
])
def test_bad_input_is_a_message_and_the_next_request_works(client, demo_app, changes, message):
    engine = demo_app[1]
    weights = changes.pop("weights", None)
    with pytest.raises(AppError, match=message):
        client.predict(*generate_args(engine, weights, **changes), api_name="/generate")
    _, _, _, scores, _, _, _ = client.predict(*generate_args(engine, num_images=1, steps=2), api_name="/generate")
    assert len(scores["images"]) == 1


def test_twenty_concurrent_requests_all_complete_and_do_not_mix(client, demo_app):
    engine = demo_app[1]
    seeds = [s % 10 for s in range(20)]  # every seed twice: the two answers must be identical

    def run(seed):
        gallery, _, _, scores, used, _, _ = client.predict(*generate_args(engine, seed=seed, num_images=1, steps=1),
                                                     api_name="/generate")
        return used, scores["images"][0]["seed"], pixels(gallery[0]["image"])

    def bad():
        with pytest.raises(AppError, match="unknown pipeline"):
            client.predict(*generate_args(engine, pipeline="nope/nope/nope"), api_name="/generate")
        return "refused"

    with ThreadPoolExecutor(max_workers=21) as pool:
        futures = [pool.submit(run, s) for s in seeds[:10]] + [pool.submit(bad)]
        futures += [pool.submit(run, s) for s in seeds[10:]]
        results = [f.result(timeout=300) for f in futures]
    assert results[10] == "refused"
    answers = results[:10] + results[11:]
    assert [used for used, _, _ in answers] == seeds and [seed for _, seed, _ in answers] == seeds
    for k in range(10):
        assert np.array_equal(answers[k][2], answers[k + 10][2])
    assert not np.array_equal(answers[0][2], answers[1][2])


def test_compare_base_and_fine_tuned_on_the_same_seeds(client, demo_app, demo_dirs):
    engine = demo_app[1]
    weights = [1.0 if label == "shapes_verifier" else 0.0 for label in engine.reward_table()]
    prompts = f"{PROMPT}\na green triangle"
    summary, left, right, slider, table, _ = client.predict(
        str(demo_dirs["lora_run"]), "", "", prompts, 2, 5, STEPS, 5.0, *weights, api_name="/compare")
    rows = table["data"]
    headers = table["headers"]
    assert len(rows) == len(left) == len(right) == 4
    seeds = [row[headers.index("seed")] for row in rows]
    assert seeds == [5, 6, 7, 8]  # prompt i, image k: seed + i·n + k, as `diffrl sample --prompts`
    left_mean = np.mean([row[headers.index("left")] for row in rows])
    right_mean = np.mean([row[headers.index("right")] for row in rows])
    # the table and the summary each show 4 decimals (rounding ≤ 5e-5 each), so their means agree within 1e-4
    shown = [float(x) for x in re.findall(r"\*\* (\d+\.\d{4})", summary)]
    assert len(shown) == 2
    assert abs(shown[0] - left_mean) <= 1e-4 and abs(shown[1] - right_mean) <= 1e-4
    # the base side is plain tiny-shapes: the same pixels as the Generate page gives for that prompt and seed
    gallery, *_ = client.predict(*generate_args(engine, seed=5, num_images=1), api_name="/generate")
    assert np.array_equal(pixels(left[0]["image"]), pixels(gallery[0]["image"]))
    # the LoRA changes the images
    assert any(not np.array_equal(pixels(a["image"]), pixels(b["image"])) for a, b in zip(left, right))
    assert len(slider) == 2 and all(Path(p).is_file() for p in slider)


def test_compare_a_run_without_checkpoints_is_a_message(client, demo_app, demo_dirs):
    weights = [1.0 if label == "shapes_verifier" else 0.0 for label in demo_app[1].reward_table()]
    with pytest.raises(AppError, match="has no checkpoints yet"):
        client.predict(str(demo_dirs["empty_run"]), "", "", PROMPT, 1, 0, 2, 5.0, *weights, api_name="/compare")


def test_score_uploaded_images_with_every_reward(client, demo_app, tmp_path):
    from PIL import Image

    from diffrl.shapes.world import Scene, render

    array = render(Scene((("purple", "triangle", 3),), kind="count"), seed=1)
    Image.fromarray(array).save(tmp_path / "three.png")
    Image.fromarray(np.zeros_like(array)).save(tmp_path / "black.png")
    labels = list(demo_app[1].reward_table())
    table, verdicts, details, scores_file = client.predict(
        [handle_file(str(tmp_path / "three.png")), handle_file(str(tmp_path / "black.png"))],
        "three purple triangles", labels, api_name="/score")
    headers, rows = table["headers"], table["data"]
    assert headers == ["file", *labels] and len(rows) == 2
    verifier = headers.index("shapes_verifier")
    assert rows[0][verifier] == 1.0 and rows[1][verifier] == 0.0
    assert details[0]["clauses"][0]["found"] == 3 and details[0]["clauses"][0]["ok"] is True
    assert "- ✓ exactly 3 purple triangle (found 3)" in verdicts and "- ✗ exactly 3 purple triangle (found 0)" in verdicts
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95)
    assert rows[0][headers.index("jpeg_compressibility")] == pytest.approx(-buffer.tell() / 1000)
    written = json.loads(Path(scores_file).read_text())
    assert [r["shapes_verifier"] for r in written] == [1.0, 0.0] and written[0]["prompt"] == "three purple triangles"


def test_score_a_file_that_is_not_an_image(client, tmp_path):
    (tmp_path / "notes.png").write_text("this is not a picture")
    with pytest.raises(AppError, match="cannot read image"):
        client.predict([handle_file(str(tmp_path / "notes.png"))], PROMPT, ["shapes_verifier"], api_name="/score")


def test_runs_page(client, demo_dirs):
    run = demo_dirs["metrics_run"]
    summary, curve, curve_png, grids, metrics, config, gold = client.predict(str(run), api_name="/run")
    assert len(curve["data"]) == 12 + 1  # the proxy reward every epoch and the evaluation's proxy once
    assert [row[1] for row in gold["data"]] == [0.58]  # the gold reward on an axis of its own
    assert "held-out gold reward (eval_gold_mean): **0.5800 (epoch 10)**" in summary
    assert "12 metric records" in summary and "checkpoints: none yet" in summary
    assert len(metrics["data"]) == 12
    assert [g["caption"] for g in grids] == ["epoch-2", "epoch-10"]
    assert config.strip() == (run / "config.yaml").read_text().strip()
    assert Path(curve_png).is_file()
    summary, *_ = client.predict(str(demo_dirs["lora_run"]), api_name="/run")
    assert "step-2" in summary
    with pytest.raises(AppError, match="is not a run dir under .* the Runs page reads only those"):
        client.predict(str(demo_dirs["root"]), api_name="/run")  # a folder outside the runs folder
    (demo_dirs["runs"] / "not-a-run").mkdir(exist_ok=True)
    with pytest.raises(AppError, match="has no config.yaml"):
        client.predict(str(demo_dirs["runs"] / "not-a-run"), api_name="/run")


def test_label_pairs_and_resume(client, tmp_path):
    folder = make_pairs(tmp_path / "pairs", n=3)
    status, prompt, index, first, second = client.predict(str(folder), api_name="/label_load")
    assert index == 0 and "0 of 3 pairs labelled" in status and "prompt 0" in prompt
    assert pixels(first).std() > 5 and not np.array_equal(pixels(first), pixels(second))
    status, prompt, index, *_ = client.predict(str(folder), 0, api_name="/label_second")
    assert index == 1 and "1 of 3" in status
    client.predict(str(folder), 1, api_name="/label_tie")
    lines = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    assert [line["choice"] for line in lines] == [1, "tie", None]
    assert lines[0]["latents"] == "latents/0000.safetensors"
    # a new page resumes at the first unlabelled pair
    _, prompt, index, *_ = client.predict(str(folder), api_name="/label_load")
    assert index == 2 and "prompt 2" in prompt
    _, prompt, index, *_ = client.predict(str(folder), 2, api_name="/label_back")
    assert index == 1 and "labelled: **tie (T)**" in prompt  # the current choice in words, not `'tie'` or `0`
    status, _, index, first, _ = client.predict(str(folder), 2, api_name="/label_first")
    assert index == -1 and "3 of 3 pairs labelled" in status and "All done" in status and first is None
    with pytest.raises(AppError, match="does not exist"):
        client.predict(str(tmp_path / "missing"), api_name="/label_load")


def test_the_stream_is_throttled_but_keeps_the_last_report(monkeypatch):
    """Reports faster than STREAM_INTERVAL_S are dropped except the last one before the end (the page shows the
    newest preview); with no interval every report is streamed."""
    app = demo_module("app")
    engine = demo_module("engine")

    def work(report):
        for i in range(5):
            report(engine.Report(i / 5, f"iteration {i + 1}"))
        return "value"

    def streamed(interval):
        monkeypatch.setattr(app, "STREAM_INTERVAL_S", interval)
        out = list(app._stream(work, lambda fraction, desc: None))
        assert out[-1] == ("done", "value")
        return [item.text for kind, item in out[1:-1]]  # after the first "starting" report

    assert streamed(3600.0) == ["iteration 1", "iteration 5"]
    assert streamed(0.0) == [f"iteration {i}" for i in range(1, 6)]
