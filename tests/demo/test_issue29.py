"""Issue 29's bugs (and issue 30's Compare item), each through the endpoint a page calls, with gradio_client on the
session's app (CPU, tiny-shapes). The bugs that are only visible in the page (toast text, lists on reload, Stop,
ReNO's switch back, the API page's snippet, galleries and captions) are in test_browser.py.
"""

import time
from pathlib import Path

import numpy as np
import pytest
from demo_helpers import PROMPT, make_lora_run, require_gradio
from test_endpoints import generate_args, pixels

require_gradio()

from gradio_client import handle_file
from gradio_client.exceptions import AppError

MAX_SEED = 2**64 - 1


@pytest.mark.parametrize("seed, num_images, message", [
    (1e30, 1, f"seed must be a whole number from 0 to {MAX_SEED} .* got 1e\\+30"),
    (2**64, 1, f"seed must be a whole number from 0 to {MAX_SEED} .* got {2**64}"),
    (-1, 1, "less than minimum value 0"),  # the number box's own bound
])
def test_bug1_a_seed_beyond_torch_is_a_message(client, demo_app, seed, num_images, message):
    with pytest.raises(AppError, match=message):
        client.predict(*generate_args(demo_app[1], seed=seed, num_images=num_images), api_name="/generate")
    # a seed that large works (the page's number box carries a float: 2**63 arrives exactly, 2**64 - 1 does not)
    *_, used, _, _ = client.predict(*generate_args(demo_app[1], seed=2**63, num_images=2, steps=1),
                                 api_name="/generate")
    assert used == 2**63


def test_bug1_seeds_of_every_image_must_fit(demo_app):
    from diffrl.errors import UserError

    with pytest.raises(UserError, match=f"seed {MAX_SEED} \\+ 1 \\(one seed per image or batch\\) is more than"):
        demo_app[1].generate(pipeline="tiny-shapes", lora=None, prompt=PROMPT, negative_prompt=None, seed=MAX_SEED,
                             steps=1, guidance_scale=5.0, num_images=2, method="plain", budget=1, settings="",
                             weights={"shapes_verifier": 1.0})


def test_bug2_error_messages_are_escaped_for_the_toast(client):
    # the toast renders HTML: `<name>` must arrive escaped (it was swallowed as a tag) and `code` as <code>
    with pytest.raises(AppError) as caught:
        client.predict("", api_name="/run")
    message = str(caught.value)
    assert "(runs/&lt;name&gt;)" in message and "<code>diffrl run</code>" in message and "`" not in message


def test_bug4_a_budget_beyond_the_bound_is_refused_at_once(client, demo_app):
    started = time.monotonic()
    with pytest.raises(AppError, match="best-of-n's num_samples must be 1 to 4096 \\(per prompt\\), got 100000000"):
        client.predict(*generate_args(demo_app[1], method="best-of-n", budget=100_000_000), api_name="/generate")
    assert time.monotonic() - started < 30  # refused before sampling (it took 24 s to fail allocating ~400 GB)


def test_bug5_generate_by_parameter_names_with_the_pages_defaults(client, demo_app):
    info = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/generate"]
    names = [p["parameter_name"] for p in info["parameters"]]
    weight_names = [n for n in names if n.startswith("weight_")]
    assert weight_names == ["weight_shapes_verifier", "weight_clip_score_tiny_shapes_clip",
                            "weight_pickscore_tiny_shapes_pickscore", "weight_jpeg_compressibility"][:len(weight_names)]
    assert not any(n.startswith("param_") for n in names)
    # every parameter has the page's default (no "Hello!!" placeholders): only what differs is named
    assert all(p["parameter_has_default"] for p in info["parameters"])
    defaults = {p["parameter_name"]: p["parameter_default"] for p in info["parameters"]}
    assert defaults["lora"] == "" and defaults["settings"] == "" and defaults["negative"] == ""
    _, _, _, scores, seed, _, _ = client.predict(prompt="a green triangle", steps=2, num_images=1,
                                                    api_name="/generate")
    assert seed == 0 and len(scores["images"]) == 1 and scores["images"][0]["prompt"] == "a green triangle"


def test_bug7_each_steered_image_has_its_own_seed(client, demo_app):
    engine = demo_app[1]
    gallery, _, _, scores, _, _, _ = client.predict(
        *generate_args(engine, method="best-of-n", budget=2, seed=11, num_images=3, steps=2), api_name="/generate")
    assert sorted(item["seed"] for item in scores["images"]) == [11, 12, 13]
    assert sorted(g["caption"].split("seed ")[1] for g in gallery) == ["11", "12", "13"]
    # the image captioned seed 12 is what that seed gives on its own
    shown = {item["seed"]: g["image"] for item, g in zip(scores["images"], gallery)}
    alone, *_ = client.predict(*generate_args(engine, method="best-of-n", budget=2, seed=12, num_images=1, steps=2),
                               api_name="/generate")
    assert np.array_equal(pixels(alone[0]["image"]), pixels(shown[12]))


def compare_args(engine, run, **changes):
    values = {"run_a": run, "run_b": "", "base": "", "prompts": PROMPT, "n": 1, "seed": 0, "steps": 2,
              "guidance": 5.0}
    values.update(changes)
    return [*values.values(), *(1.0 if label == "shapes_verifier" else 0.0 for label in engine.reward_table())]


def test_bug8_compare_says_a_missing_run_does_not_exist_first(client, demo_app, demo_dirs):
    missing = str(demo_dirs["runs"] / "no-such-run")
    with pytest.raises(AppError, match=f"run dir {missing} does not exist"):
        client.predict(*compare_args(demo_app[1], missing), api_name="/compare")
    with pytest.raises(AppError, match=f"run dir {missing} does not exist"):  # a pipeline given changes nothing
        client.predict(*compare_args(demo_app[1], missing, base="tiny-shapes"), api_name="/compare")
    with pytest.raises(AppError, match="second run dir .*no-such-run does not exist"):
        client.predict(*compare_args(demo_app[1], str(demo_dirs["lora_run"]), run_b=missing), api_name="/compare")


def test_issue30_compare_loads_only_run_dirs_under_the_runs_folder(client, demo_app, demo_dirs, tmp_path):
    outside = make_lora_run(tmp_path / "elsewhere")  # a real run dir, with a LoRA, outside --runs-dir
    for typed in (str(outside), f"{demo_dirs['runs']}/../{outside.name}", "/etc", "~"):
        with pytest.raises(AppError, match="is not a run dir under .* the Compare page reads only those"):
            client.predict(*compare_args(demo_app[1], typed), api_name="/compare")
    link = demo_dirs["runs"] / "link-out"
    link.symlink_to(outside)
    try:
        with pytest.raises(AppError, match="the Compare page reads only those"):
            client.predict(*compare_args(demo_app[1], str(link)), api_name="/compare")
        with pytest.raises(AppError, match="the Compare page reads only those"):  # as the second run too
            client.predict(*compare_args(demo_app[1], str(demo_dirs["lora_run"]), run_b=str(outside)),
                           api_name="/compare")
    finally:
        link.unlink()
    # a run under the folder, by its path or by its name there
    summary, *_ = client.predict(*compare_args(demo_app[1], "tuned"), api_name="/compare")
    assert "mean reward" in summary


def test_bug9_score_names_uploads_by_their_own_name(client, tmp_path):
    (tmp_path / "fake.png").write_text("not a picture")
    with pytest.raises(AppError) as caught:
        client.predict([handle_file(str(tmp_path / "fake.png"))], PROMPT, ["shapes_verifier"], api_name="/score")
    message = str(caught.value)
    assert "cannot read image 'fake.png'" in message and "/" not in message  # not gradio's /tmp/gradio/<hash>/


def test_bug9_score_scores_what_can_read_the_prompt_and_says_what_cannot(client, demo_app, tmp_path):
    from PIL import Image

    from diffrl.shapes.world import Scene, render

    Image.fromarray(render(Scene((("red", "circle", 1),)), seed=1)).save(tmp_path / "circle.png")
    labels = list(demo_app[1].reward_table())
    table, verdicts, _, scores_file = client.predict([handle_file(str(tmp_path / "circle.png"))],
                                                     "a cat wearing sunglasses", labels, api_name="/score")
    headers, (row,) = table["headers"], table["data"]
    assert headers == ["file", *labels] and row[0] == "circle.png"
    verifier = headers.index("shapes_verifier")
    assert row[verifier] in (None, "", "NaN") or (isinstance(row[verifier], float) and np.isnan(row[verifier]))
    others = [v for h, v in zip(headers[1:], row[1:]) if h != "shapes_verifier"]
    assert others and all(isinstance(v, float) and np.isfinite(v) for v in others)
    assert "shapes_verifier did not score:" in verdicts
    # only the verifier chosen: nothing can score, and the message says why
    with pytest.raises(AppError, match="shapes_verifier"):
        client.predict([handle_file(str(tmp_path / "circle.png"))], "a cat wearing sunglasses", ["shapes_verifier"],
                       api_name="/score")
    assert Path(scores_file).is_file()


def test_compare_defaults_come_from_the_runs_held_out_prompts(tmp_path):
    from diffrl.demo_loader import demo_module
    from diffrl.shapes.prompts import get_prompt_set

    runs = demo_module("runs")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(
        "prompts: {source: shapes:train, eval_source: shapes:heldout}\n"
        "sample: {num_steps: 10, eval_num_steps: 20, guidance_scale: 4.5}\nreward: {name: shapes_verifier}\n")
    found = runs.compare_defaults("run", tmp_path)
    assert found == {"prompts": list(get_prompt_set("heldout"))[:runs.COMPARE_PROMPTS], "steps": 20,
                     "guidance": 4.5, "reward": "shapes_verifier"}
    # a prompt source that would import a module (or read a file) is not followed from a run's config
    (tmp_path / "hostile").mkdir()
    (tmp_path / "hostile" / "config.yaml").write_text("prompts: {eval_source: 'os:getcwd'}\n")
    assert runs.compare_defaults("hostile", tmp_path) == {}
    assert runs.compare_defaults("/etc", tmp_path) == {}  # outside the runs folder: nothing read
