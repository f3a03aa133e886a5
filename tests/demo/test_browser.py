"""The demo in a real headless browser: Debian's chromium driven by playwright, on the app launched in-process.

Each test works one page the way a person would (type, click, press keys), waits for the result, checks that the
images shown are not blank and saves a screenshot to $DIFFRL_DEMO_SCREENSHOTS (default: a pytest temp folder).
Without a chromium binary (`apt-get install chromium`) or the playwright package the tests skip with that reason;
`playwright install` is not needed: the system browser is used (conftest's `browser`, one for the session).
"""

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from demo_helpers import make_pairs, require_gradio

require_gradio()

TIMEOUT_MS = 180_000  # a loaded 2-core CPU; the tiny model itself answers in a second or two


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory):
    folder = os.environ.get("DIFFRL_DEMO_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def page(browser, demo_app):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(demo_app[0])
    page.wait_for_selector("#prompt textarea")
    yield page
    context.close()


def image_is_not_blank(locator) -> float:
    """Standard deviation of an on-page image's pixels, from a screenshot of the element."""
    import io

    from PIL import Image

    picture = Image.open(io.BytesIO(locator.screenshot())).convert("RGB")
    return float(np.asarray(picture).astype(float).std())


def fill(page, selector: str, text: str) -> None:
    box = page.locator(selector).locator("textarea, input").first
    box.fill(text)
    box.press("Tab")  # a dropdown takes a typed value when it loses focus
    if box.get_attribute("role") == "combobox":  # gradio leaves its list of choices open over the fields below
        box.click()
        box.press("Escape")


def open_advanced(page) -> None:
    """Open the Generate page's "Advanced options" accordion (pipeline, LoRA, seed, steps, settings)."""
    if not page.locator("#generate-steps").is_visible():
        page.get_by_text("Advanced options", exact=True).click()
        page.locator("#generate-steps").wait_for(state="visible")


def test_generate_page(page, screenshots, capsys):
    fill(page, "#prompt", "a blue square below a yellow circle")
    open_advanced(page)
    fill(page, "#generate-steps", "8")
    started = time.monotonic()
    page.click("#generate-btn")
    first = page.locator("#gallery img").first
    first.wait_for(state="visible")
    seconds = time.monotonic() - started
    page.wait_for_function("document.querySelectorAll('#gallery img').length >= 4")
    page.wait_for_selector("#generate-summary :text('NFE')")
    assert image_is_not_blank(first) > 5
    page.screenshot(path=str(screenshots / "generate.png"), full_page=True)
    with capsys.disabled():
        print(f"\nfirst image in the browser {seconds:.1f} s after clicking Generate (8 steps, 4 images; the first "
              "request of a session loads the pipeline and rewards)")

    # bad input: a message in the page, and the next request works
    fill(page, "#generate-pipeline", "tiny-shape")
    page.click("#generate-btn")
    page.get_by_text("unknown pipeline 'tiny-shape'").first.wait_for(state="visible")
    page.screenshot(path=str(screenshots / "generate-error.png"))
    fill(page, "#generate-pipeline", "tiny-shapes")
    fill(page, "#prompt", "a green triangle")
    page.click("#generate-btn")
    page.wait_for_selector("#gallery [aria-label*='green triangle'], #generate-summary :text('NFE')")
    page.wait_for_function("document.querySelectorAll('#gallery img').length >= 4")


# the galleries that hold more images than fit their box: (selector, its scroll height, its visible height)
GALLERY_SCROLLS_JS = """(selector) => [...document.querySelectorAll(selector + ' .grid-wrap')]
  .filter(wrap => wrap.scrollHeight > wrap.clientHeight + 1)
  .map(wrap => [selector, wrap.scrollHeight, wrap.clientHeight])"""


def test_compare_page(page, demo_dirs, screenshots):
    """4 prompts × 2 images: each side's 8 images all in view, none behind a scroll bar inside the gallery."""
    page.get_by_role("tab", name="Compare").click()
    fill(page, "#compare-run", str(demo_dirs["lora_run"]))
    fill(page, "#compare-prompts", "a red circle\na green triangle\nthree blue squares\na yellow square")
    fill(page, "#compare-steps", "8")
    page.click("#compare-btn")
    page.wait_for_selector("#compare-summary :text('mean reward')")
    for side in ("#compare-left", "#compare-right"):
        page.wait_for_function(f"document.querySelectorAll('{side} img').length >= 8")
        assert image_is_not_blank(page.locator(f"{side} img").first) > 5
        assert page.evaluate(GALLERY_SCROLLS_JS, side) == [], f"{side} scrolls inside itself"
        assert page.evaluate(CLIPPED_JS, side) == []
        thumbnails = page.locator(f"{side} .thumbnail-item")
        assert thumbnails.count() == 8
        for k in range(8):
            assert in_view(page, f"{side} .thumbnail-item >> nth={k}"), f"{side} image {k + 1} is out of view"
    page.screenshot(path=str(screenshots / "compare.png"), full_page=True)


def test_label_page_with_keyboard(page, tmp_path, screenshots):
    folder = make_pairs(tmp_path / "pairs", n=3)
    page.get_by_role("tab", name="Label").click()
    fill(page, "#pairs-dir", str(folder))
    page.click("#label-load")
    page.wait_for_selector("#label-status :text('0 of 3 pairs labelled')")
    for side in ("#label-image-first img", "#label-image-second img"):
        page.locator(side).wait_for(state="visible")
        assert image_is_not_blank(page.locator(side)) > 5
    page.screenshot(path=str(screenshots / "label.png"), full_page=True)
    page.locator("#label-prompt").click()  # focus out of the text box, so keys go to the shortcuts
    page.keyboard.press("2")
    page.wait_for_selector("#label-status :text('1 of 3 pairs labelled')")
    page.keyboard.press("t")
    page.wait_for_selector("#label-status :text('2 of 3 pairs labelled')")
    page.get_by_role("button", name="First is better (1, ←)").click()
    page.wait_for_selector("#label-status :text('All done')")
    choices = [json.loads(line)["choice"] for line in (folder / "pairs.jsonl").read_text().splitlines()]
    assert choices == [1, "tie", 0]


def test_score_page(page, tmp_path, screenshots):
    from PIL import Image

    from diffrl.shapes.world import Scene, render

    Image.fromarray(render(Scene((("purple", "triangle", 3),), kind="count"), seed=1)).save(tmp_path / "three.png")
    Image.fromarray(render(Scene((("red", "circle", 1),)), seed=2)).save(tmp_path / "circle.png")
    page.get_by_role("tab", name="Score").click()
    page.locator("#score-files input[type=file]").set_input_files([str(tmp_path / "three.png"),
                                                                   str(tmp_path / "circle.png")])
    fill(page, "#score-prompt", "three purple triangles")
    page.click("#score-btn")
    page.wait_for_function("document.querySelector('#score-table').innerText.includes('three.png')")
    # the table fills before the event ends; gradio dims its outputs (class pending) until then
    page.wait_for_function("document.querySelectorAll('.pending').length === 0")
    page.screenshot(path=str(screenshots / "score.png"), full_page=True)


def test_runs_page(page, demo_dirs, screenshots):
    page.get_by_role("tab", name="Runs").click()
    fill(page, "#run-dir", str(demo_dirs["metrics_run"]))
    page.click("#run-btn")
    page.wait_for_selector("#run-summary :text('12 metric records')")
    page.wait_for_function("document.querySelectorAll('#run-grids img').length >= 2")
    page.screenshot(path=str(screenshots / "runs.png"), full_page=True)


# -- issue 29: the bugs a person saw, and the page as a person sees it ----------------------------------------------


def toast_text(page) -> str:
    toast = page.locator("[data-testid='toast-body']").first
    toast.wait_for(state="visible")
    return toast.inner_text()


def test_bug2_the_error_toast_shows_the_whole_message(page, screenshots):
    page.get_by_role("tab", name="Runs").click()
    page.click("#run-btn")  # no run dir typed
    text = toast_text(page)
    page.screenshot(path=str(screenshots / "runs-error.png"))
    assert "(runs/<name>)" in text and "diffrl run" in text and "`" not in text  # was cut at "(runs/"
    assert page.locator("[data-testid='toast-body'] code", has_text="diffrl run").count() >= 1


def test_bug3_run_lists_are_read_when_the_page_loads(page, demo_dirs):

    from demo_helpers import make_lora_run

    run = make_lora_run(demo_dirs["runs"] / "made-after-start")
    try:
        page.reload()
        page.wait_for_selector("#prompt textarea")
        page.get_by_role("tab", name="Compare").click()
        # the newest run with a checkpoint is preset, without "Refresh list"
        page.wait_for_function(f"document.querySelector('#compare-run input').value === {json.dumps(str(run))}")
        page.get_by_role("tab", name="Runs").click()
        page.locator("#run-dir input").click()
        page.get_by_role("option", name=str(run)).wait_for(state="visible")
    finally:
        shutil.rmtree(run)


def work_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "diffrl-demo-work" and t.is_alive()]


def test_bug4_stop_ends_a_long_request_and_frees_the_model(page, screenshots):
    # 16 images, each steered alone for 100 steps of 16 candidates: short steps, minutes in all unless stopped
    page.get_by_text("best-of-n", exact=True).click()
    fill(page, "#generate-images", "16")
    fill(page, "#generate-budget", "16")
    open_advanced(page)
    fill(page, "#generate-steps", "100")
    page.click("#generate-btn")
    page.wait_for_function("document.querySelector('#generate-summary').innerText.includes('image 1/16')")
    assert work_threads()
    page.click("#generate-stop")
    stopped = time.monotonic()
    while work_threads() and time.monotonic() - stopped < 30:  # the model thread stops at its next step
        time.sleep(0.1)
    assert not work_threads(), "the model thread ran on after Stop"
    page.wait_for_selector("#generate-summary :text('Stopped.')")
    page.screenshot(path=str(screenshots / "generate-stopped.png"))
    assert page.locator("#gallery img").count() == 0  # it did not finish unseen
    # the model is free: a small request completes at once
    fill(page, "#generate-images", "1")
    fill(page, "#generate-budget", "2")
    fill(page, "#generate-steps", "2")
    page.click("#generate-btn")
    page.wait_for_selector("#generate-summary :text('NFE 4 ')")


def test_bug5_the_api_pages_generate_snippet_runs_as_copied(page, demo_app, tmp_path):
    import subprocess
    import sys

    page.get_by_text("Use via API").click()
    page.wait_for_function("[...document.querySelectorAll('code')].some(c => c.innerText.includes('api_name=\"/generate\"'))")
    snippet = page.evaluate("""() => [...document.querySelectorAll('code')].map(c => c.innerText)
                               .find(t => t.includes('from gradio_client') && t.includes('api_name="/generate"'))""")
    assert "Hello!!" not in snippet and "param_" not in snippet and "weight_shapes_verifier=1.0" in snippet
    script = tmp_path / "snippet.py"
    script.write_text(snippet.replace("print(result)", "assert 'NFE 80' in result[1], result[1]\nprint('ok')"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False,
                          timeout=TIMEOUT_MS / 1000)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def slider_value(page, selector: str) -> str:
    return page.locator(f"{selector} input[type=number]").input_value()


def test_bug6_leaving_reno_restores_the_pipeline_and_settings(page):
    from diffrl.embedded import is_built

    if not is_built("tiny-shapes-lcm"):
        pytest.skip("the embedded tiny-shapes-lcm pipeline is not built")
    open_advanced(page)
    fill(page, "#generate-steps", "12")
    fill(page, "#generate-budget", "3")
    page.get_by_text("reno", exact=True).click()
    page.wait_for_function("document.querySelector('#generate-pipeline input').value === 'tiny-shapes-lcm'")
    assert slider_value(page, "#generate-steps") == "1" and page.locator("#generate-budget input").input_value() == "10"
    assert slider_value(page, "#weight-0") == "0" and slider_value(page, "#weight-1") == "1"  # a differentiable reward
    page.get_by_text("plain", exact=True).click()
    page.wait_for_function("document.querySelector('#generate-pipeline input').value === 'tiny-shapes'")
    assert slider_value(page, "#generate-steps") == "12" and page.locator("#generate-budget input").input_value() == "3"
    assert slider_value(page, "#weight-0") == "1" and slider_value(page, "#weight-1") == "0"
    assert "Plain sampling" in page.locator("#method-help").inner_text()


def test_guidance_sets_its_reward_and_budget_and_leaving_restores_them(page):
    fill(page, "#generate-budget", "3")
    page.get_by_text("guidance", exact=True).click()
    page.wait_for_function("document.querySelector('#generate-budget input').value === '1'")
    assert slider_value(page, "#weight-0") == "0" and slider_value(page, "#weight-1") == "1"  # the embedded CLIP
    assert "last 15%" in page.locator("#method-help").inner_text()
    page.get_by_text("plain", exact=True).click()
    page.wait_for_function("document.querySelector('#generate-budget input').value === '3'")
    assert slider_value(page, "#weight-0") == "1" and slider_value(page, "#weight-1") == "0"


SIZES = {"wide": (1400, 1000), "short": (1400, 900), "narrow": (900, 900), "phone": (390, 844)}

CLIPPED_JS = """(selector) => [...document.querySelectorAll(selector)].flatMap(gallery => {
  const box = gallery.getBoundingClientRect();
  return [...gallery.querySelectorAll('.thumbnail-item')].filter(item => {
    const r = item.getBoundingClientRect();
    return r.left < box.left - 1 || r.right > box.right + 1;
  }).map(item => item.getAttribute('aria-label'));
})"""
CAPTIONS_CUT_JS = """(selector) => [...document.querySelectorAll(selector + ' .caption-label')]
  .filter(c => c.scrollWidth > c.clientWidth + 1).map(c => c.innerText)"""
# a caption that wraps to a second line covers too much of a small thumbnail (a third of it at phone width, four
# columns): list the captions taller than a quarter of their image
CAPTIONS_COVER_JS = """(selector) => [...document.querySelectorAll(selector + ' .thumbnail-item')]
  .filter(t => { const c = t.querySelector('.caption-label'); return c && c.offsetHeight > 0.25 * t.offsetHeight; })
  .map(t => t.querySelector('.caption-label').innerText)"""


def in_view(page, selector: str) -> bool:
    box = page.locator(selector).first.bounding_box()
    height = page.viewport_size["height"]
    return box is not None and box["y"] >= -2 and box["y"] + min(box["height"], 40) <= height


@pytest.mark.parametrize("size", list(SIZES))
def test_generate_as_a_person_sees_it(browser, demo_app, screenshots, size):
    width, height = SIZES[size]
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(demo_app[0])
        page.wait_for_selector("#prompt textarea")
        assert in_view(page, "#generate-btn"), "the Generate button is below the fold"
        page.screenshot(path=str(screenshots / f"generate-{size}-start.png"))
        page.click("#generate-btn")
        page.wait_for_selector("#generate-summary :text('NFE')")
        page.wait_for_function("document.querySelectorAll('#gallery img').length >= 4")
        time.sleep(0.5)  # the scroll to the results
        assert in_view(page, "#generate-summary"), "the results landed out of view"
        for gallery in ("#gallery", "#previews"):
            assert page.evaluate(CLIPPED_JS, gallery) == [], f"{gallery} clips a column at {width} px"
        assert page.evaluate(CAPTIONS_CUT_JS, "#gallery") == []
        assert page.evaluate(CAPTIONS_COVER_JS, "#gallery") == [], f"captions cover their images at {width} px"
        captions = page.locator("#gallery .caption-label").all_inner_texts()
        assert captions and all(" · seed " in c and c.split(" · ")[0].replace(".", "").isdigit() for c in captions)
        assert page.locator("#generate-breakdown").is_visible()  # per-reward breakdown without a click
        page.screenshot(path=str(screenshots / f"generate-{size}.png"), full_page=True)
    finally:
        context.close()


TABS = ["Generate / steer", "Compare", "Score", "Runs", "Label"]


def open_tab(page, name: str) -> None:
    """Click the tab `name`: one tap at every size (the tab bar wraps; gradio's default hid the tabs that did not fit
    behind a "More tabs" menu)."""
    page.get_by_role("tab", name=name).click()


@pytest.mark.parametrize("size", ["phone", "narrow"])
def test_every_tab_is_one_tap_away(browser, demo_app, screenshots, size):
    width, height = SIZES[size]
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(demo_app[0])
        page.wait_for_selector("#prompt textarea")
        assert not page.get_by_role("button", name="More tabs").is_visible()
        for name, shows in zip(TABS, ["#prompt", "#compare-btn", "#score-btn", "#run-btn", "#label-load"]):
            tab = page.get_by_role("tab", name=name)
            box = tab.bounding_box()
            assert tab.is_visible() and box["x"] >= 0 and box["x"] + box["width"] <= width, f"tab {name} is hidden"
            tab.click()
            page.locator(shows).wait_for(state="visible")
    finally:
        context.close()


@pytest.mark.parametrize("size", ["short", "narrow", "phone"])
def test_every_page_at_every_size(browser, demo_app, demo_dirs, screenshots, tmp_path, size):
    """Compare, Score, Runs and Label with content at each size (Generate: the test above): no gallery clips a
    column, and a screenshot of each."""
    width, height = SIZES[size]
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(demo_app[0])
        page.wait_for_selector("#prompt textarea")
        open_tab(page, "Compare")
        fill(page, "#compare-run", str(demo_dirs["lora_run"]))
        fill(page, "#compare-steps", "4")
        page.click("#compare-btn")
        page.wait_for_selector("#compare-summary :text('mean reward')")
        page.wait_for_function("document.querySelectorAll('#compare-right img').length >= 4")
        for gallery in ("#compare-left", "#compare-right"):
            assert page.evaluate(CLIPPED_JS, gallery) == [], f"{gallery} clips a column at {width} px"
            assert page.evaluate(CAPTIONS_CUT_JS, gallery) == []
        page.screenshot(path=str(screenshots / f"compare-{size}.png"), full_page=True)

        open_tab(page, "Runs")
        fill(page, "#run-dir", str(demo_dirs["metrics_run"]))
        page.click("#run-btn")
        page.wait_for_selector("#run-summary :text('held-out gold reward')")
        page.wait_for_function("document.querySelectorAll('#run-grids img').length >= 2")
        assert page.evaluate(CLIPPED_JS, "#run-grids") == []
        page.screenshot(path=str(screenshots / f"runs-{size}.png"), full_page=True)

        open_tab(page, "Score")
        page.screenshot(path=str(screenshots / f"score-{size}.png"), full_page=True)

        folder = make_pairs(tmp_path / "pairs", n=2)
        open_tab(page, "Label")
        fill(page, "#pairs-dir", str(folder))
        page.click("#label-load")
        page.wait_for_selector("#label-status :text('0 of 2 pairs labelled')")
        page.screenshot(path=str(screenshots / f"label-{size}.png"), full_page=True)
    finally:
        context.close()


@pytest.mark.slow
def test_journey_train_a_tiny_run_then_runs_and_compare_show_what_it_did(page, client, demo_dirs, screenshots):
    """A person's path: train a tiny run (DDPO on JPEG size, the verifier as held-out gold; about a minute on a CPU),
    then the Runs page shows its gold reward on an axis of its own, and Compare, with the defaults the run gives it
    (its held-out prompts, steps and reward), shows a non-zero difference."""

    from diffrl.cli import main
    from diffrl.shapes.prompts import get_prompt_set

    runs = demo_dirs["runs"]
    run = runs / "journey"
    assert main(["run", "ddpo/tiny_shapes_jpeg", f"run.output_dir={runs}", "run.name=journey", "run.num_epochs=2",
                 "run.eval_every=1", "run.save_every=1", "sample.batch_size=8", "sample.num_batches_per_epoch=1",
                 "train.batch_size=8", "sample.num_steps=4", "sample.eval_num_steps=4", "sample.eval_num_images=8",
                 "log.tracker=none", "optim.learning_rate=3.0e-3"]) == 0
    try:
        summary, curve, _, _, _, _, gold = client.predict(str(run), api_name="/run")
        assert len(gold["data"]) >= 2 and {row[2] for row in gold["data"]} == {"eval_gold_mean"}
        assert "eval_gold_mean" not in {row[2] for row in curve["data"]}  # not flattened on the proxy's axis
        assert "held-out gold reward (eval_gold_mean): **" in summary

        page.reload()
        page.wait_for_selector("#prompt textarea")
        page.get_by_role("tab", name="Runs").click()
        fill(page, "#run-dir", str(run))
        page.click("#run-btn")
        page.wait_for_selector("#run-summary :text('held-out gold reward')")
        page.locator("#run-gold-curve").scroll_into_view_if_needed()
        page.screenshot(path=str(screenshots / "journey-runs.png"), full_page=True)

        page.get_by_role("tab", name="Compare").click()
        # the defaults: the newest run with a checkpoint, its held-out prompts and its reward
        page.wait_for_function(f"document.querySelector('#compare-run input').value === {json.dumps(str(run))}")
        heldout = list(get_prompt_set("heldout"))
        page.wait_for_function(
            f"document.querySelector('#compare-prompts textarea').value.startsWith({json.dumps(heldout[0])})")
        page.click("#compare-btn")
        page.wait_for_selector("#compare-summary :text('difference')")
        text = page.locator("#compare-summary").inner_text()
        page.screenshot(path=str(screenshots / "journey-compare.png"), full_page=True)
        difference = float(text.split("difference ")[1].split(",")[0])
        assert difference != 0.0, text
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_downloads_and_a_queued_request_without_a_time_estimate(browser, demo_app, screenshots):
    """After Generate the page offers the zip of its results; a request queued behind another shows its place and
    the time so far, not gradio's estimate (`queue: 1/1 | 2.1s`, never `2.1/17.0s`)."""
    import re
    import zipfile

    contexts = [browser.new_context(viewport={"width": 1400, "height": 1000}) for _ in range(2)]
    try:
        first, second = (context.new_page() for context in contexts)
        for page in (first, second):  # both pages load at once
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(demo_app[0], wait_until="commit")
        for page in (first, second):
            page.wait_for_selector("#prompt textarea")
        # a first request, so that gradio has a past duration to estimate from: 2 steps (the page's 20 with their
        # streamed previews took ~8 s of the test on one core)
        open_advanced(first)
        fill(first, "#generate-steps", "2")
        first.click("#generate-btn")
        first.wait_for_selector("#generate-summary :text('NFE 8 ')")
        first.wait_for_selector("#generate-download a")
        with first.expect_download() as download:
            first.locator("#generate-download a").first.click()
        with zipfile.ZipFile(download.value.path()) as archive:
            names = archive.namelist()
        assert "scores.json" in names and sum(name.endswith(".png") for name in names) == 4
        fill(first, "#generate-steps", "100")
        first.click("#generate-btn")
        first.get_by_text(re.compile(r"step \d+/100")).first.wait_for(state="visible")
        second.click("#generate-btn")
        status = second.get_by_text(re.compile(r"queue: 1/1")).first
        status.wait_for(state="visible")
        second.wait_for_timeout(1500)  # gradio sends its estimate while the request waits
        text = status.locator("xpath=..").inner_text()
        second.screenshot(path=str(screenshots / "generate-queued.png"))
        assert re.search(r"queue: 1/1 \|\s*[\d.]+s", text), text
        assert not re.search(r"[\d.]+/[\d.]+s", text), f"a time estimate is shown: {text}"
        first.click("#generate-stop")
        second.click("#generate-stop")  # else the queued request runs on after the test, holding the next one's model
        second.wait_for_selector("#generate-summary :text('Stopped.')")
    finally:
        for context in contexts:
            context.close()
