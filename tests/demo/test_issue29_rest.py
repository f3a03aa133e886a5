"""Issue 29's last items: Generate's LoRA only from the runs folder, downloads of results, no misleading queue
estimate, the page before the models load, and the terminal pointing to `diffrl demo --share`."""

import json
import socket
import threading
import time
import zipfile

import numpy as np
import pytest
from demo_helpers import demo_module, make_lora_run, require_gradio
from test_endpoints import generate_args, pixels

require_gradio()

from gradio_client import Client
from gradio_client.exceptions import AppError
from gradio_client.utils import Status


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_generate_loads_only_loras_under_the_runs_folder(client, demo_app, demo_dirs, tmp_path):
    engine = demo_app[1]
    outside = make_lora_run(tmp_path / "elsewhere")  # a real run dir with a LoRA, outside --runs-dir
    for typed in (str(outside), f"{demo_dirs['runs']}/../{outside.name}", "/etc", "~", str(demo_dirs["runs"])):
        with pytest.raises(AppError, match="is not a run dir under .* the Generate page reads only those"):
            client.predict(*generate_args(engine, lora=typed, steps=1, num_images=1), api_name="/generate")
    link = demo_dirs["runs"] / "lora-link-out"
    link.symlink_to(outside)
    try:
        with pytest.raises(AppError, match="the Generate page reads only those"):
            client.predict(*generate_args(engine, lora=str(link), steps=1, num_images=1), api_name="/generate")
    finally:
        link.unlink()
    with pytest.raises(AppError, match="LoRA .*no-such-run does not exist"):
        client.predict(*generate_args(engine, lora=str(demo_dirs["runs"] / "no-such-run"), steps=1, num_images=1),
                       api_name="/generate")
    # a run under the folder (by its name there) and a LoRA folder inside it load, and the LoRA changes the image
    base, *_ = client.predict(*generate_args(engine, steps=2, num_images=1), api_name="/generate")
    for typed in ("tuned", str(demo_dirs["lora_run"] / "checkpoints" / "step-2")):
        tuned, summary, *_ = client.predict(*generate_args(engine, lora=typed, steps=2, num_images=1),
                                            api_name="/generate")
        assert "NFE 2 " in summary
        assert not np.array_equal(pixels(base[0]["image"]), pixels(tuned[0]["image"]))


def test_generate_offers_its_images_seeds_and_scores_as_a_zip(client, demo_app):
    gallery, _, _, scores, _, _, download = client.predict(*generate_args(demo_app[1], seed=21, num_images=3),
                                                           api_name="/generate")
    with zipfile.ZipFile(download) as archive:
        names = archive.namelist()
        record = json.loads(archive.read("scores.json"))
        images = [np.asarray(_png(archive.read(name))) for name in names if name.endswith(".png")]
    # best first, as the gallery: seeds 21, 22, 23 in reward order
    shown = scores["images"]
    assert sorted(item["seed"] for item in shown) == [21, 22, 23]
    assert names == [f"{rank:02d}-seed{item['seed']}.png" for rank, item in enumerate(shown, 1)] + ["scores.json"]
    assert record["method"] == "plain" and record["nfe"] == scores["nfe"] and record["seed"] == 21
    assert [(r["file"], r["seed"], r["total"], r["shapes_verifier"]) for r in record["images"]] == [
        (names[i], item["seed"], item["total"], item["shapes_verifier"]) for i, item in enumerate(shown)]
    for image, item in zip(images, gallery):  # tiny-shapes' own 32x32 pixels; the page shows them enlarged
        _assert_model_pixels_of(image, pixels(item["image"]))


def test_compare_offers_both_sides_as_a_zip(client, demo_app, demo_dirs):
    weights = [1.0 if label == "shapes_verifier" else 0.0 for label in demo_app[1].reward_table()]
    _, left, right, _, table, download = client.predict(
        str(demo_dirs["lora_run"]), "", "", "a red circle\na green triangle", 2, 5, 2, 5.0, *weights,
        api_name="/compare")
    with zipfile.ZipFile(download) as archive:
        record = json.loads(archive.read("scores.json"))
        for side, shown in (("left", left), ("right", right)):
            files = [r["file"] for r in record[side]]
            assert files == [f"{side}/{k:02d}-seed{seed}.png" for k, seed in enumerate([5, 6, 7, 8], 1)]
            for file, item in zip(files, shown):
                _assert_model_pixels_of(np.asarray(_png(archive.read(file))), pixels(item["image"]))
    headers = table["headers"]
    assert [r["total"] for r in record["right"]] == pytest.approx([row[headers.index("right")]
                                                                   for row in table["data"]], abs=1e-4)
    assert record["right"][0]["prompt"] == "a red circle" and record["right"][2]["prompt"] == "a green triangle"
    assert record["left"][0]["seed"] == record["right"][0]["seed"] == 5 and record["left"] != record["right"]


def _assert_model_pixels_of(saved, shown):
    """`saved` is the model's own 32x32 image (tiny-shapes' output size), and the page's image is it enlarged by
    nearest neighbour: each saved pixel repeated k x k times."""
    assert saved.shape == (32, 32, 3)
    k = shown.shape[0] // 32
    assert k > 1 and np.array_equal(saved.repeat(k, axis=0).repeat(k, axis=1), shown)


def _png(data: bytes):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def test_the_queue_shows_no_time_estimate(client, demo_app):
    """gradio estimated a request's time as the mean of the event's past runs (it said 17 s for a 47 s wait): after
    a first run, a queued and a running request get no estimate (the page then shows the position and time so
    far)."""
    engine = demo_app[1]
    client.predict(*generate_args(engine, steps=1, num_images=1), api_name="/generate")  # a past duration exists
    first = client.submit(*generate_args(engine, steps=20, num_images=4), api_name="/generate")
    second = client.submit(*generate_args(engine, steps=1, num_images=1), api_name="/generate")
    seen = []
    while not second.done():
        for job in (first, second):
            status = job.status()
            seen.append((status.code, status.rank, status.eta))
        time.sleep(0.05)
    second.result()
    assert any(code == Status.IN_QUEUE and rank == 0 for code, rank, _ in seen), f"none seen queued: {seen}"
    assert [eta for *_, eta in seen if eta is not None] == []


def test_launch_prints_the_share_flag_not_gradios_hint(tmp_path, capsys):
    app_module = demo_module("app")
    port = free_port()
    app, url = app_module.launch(port=port, block=False, preload=None, runs_root=str(tmp_path))
    try:
        out = capsys.readouterr().out
    finally:
        app.close()
        app.diffrl_temp.cleanup()
    assert f"diffrl demo on {url}" in out
    assert "diffrl demo --share" in out and "share=True" not in out and "launch()" not in out


def test_the_page_renders_before_the_model_loads_and_a_request_waits_for_it(browser, tmp_path, monkeypatch):
    """The preload starts only once a page has rendered (loading torch and the weights beside the server held up
    the page), and a request made while it loads waits for it, saying "loading"."""
    app_module = demo_module("app")
    started, release = threading.Event(), threading.Event()

    class SlowEngine(app_module.Engine):  # a model that takes until `release` to load
        def pipeline(self, name, lora=None):
            started.set()
            assert release.wait(120)
            return super().pipeline(name, lora)

    monkeypatch.setattr(app_module, "Engine", SlowEngine)
    app, url = app_module.launch(port=free_port(), block=False, quiet=True, runs_root=str(tmp_path), device="cpu")
    try:
        assert not started.is_set()  # nothing loads before a page is open
        _open_page_until_generate_is_visible(browser, url, then=lambda: started.wait(60))
        assert started.is_set(), "the first page did not start the preload"
        client = Client(url, verbose=False)
        job = client.submit(*generate_args(app_module.Engine(device="cpu"), steps=1, num_images=1),
                            api_name="/generate")
        deadline = time.monotonic() + 60
        while not any("loading tiny-shapes" in (output[1] or "") for output in job.outputs()):
            assert time.monotonic() < deadline and not job.done(), job.outputs()
            time.sleep(0.1)
        assert not job.done()  # it waits for the model
        release.set()
        gallery, summary, *_ = job.result(timeout=120)
        assert len(gallery) == 1 and "NFE 1 " in summary
    finally:
        release.set()
        app.close()
        app.diffrl_temp.cleanup()


def _open_page_until_generate_is_visible(browser, url: str, then) -> None:
    """Open `url` in a context of the session's chromium, wait until the Generate button is visible, then call
    `then()` with the page open."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = context.new_page()
        page.goto(url)
        page.locator("#generate-btn").wait_for(state="visible", timeout=60_000)
        then()
    finally:
        context.close()
