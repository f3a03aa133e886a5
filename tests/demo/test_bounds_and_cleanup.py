"""What one demo request may ask for, what the Runs and Label pages may touch, and what a stopped demo leaves behind
(issue 30). The engine's and pages' functions are called directly: no browser, and no model loads before a refusal.

- Sizes: the bounds of `diffrl/steering/bounds.py`, the same as `diffrl steer`'s, each named in the message.
- Score uploads: bytes, pixels (from the header, before decoding: a 97 KB PNG of 10000 × 10000 pixels would decode
  to 7.2 GB) and the number of files.
- Runs page: only run dirs under the runs folder, and no link out of one.
- Label page: a symlinked pairs.jsonl is written through (the label file it points to gets the labels).
- Temporary files: the demo's own folder (downloads and gradio's uploads) goes when it stops.
"""

import json
import os
import struct
import zlib
from pathlib import Path

import pytest
from demo_helpers import make_metrics_run, make_pairs, require_tiny_shapes

from diffrl.demo_loader import demo_module
from diffrl.errors import UserError
from diffrl.steering.bounds import (
    MAX_DEMO_IMAGES,
    MAX_LATENT_ROWS,
    MAX_NUM_STEPS,
    MAX_ROWS_PER_CALL,
    MAX_UPLOAD_BYTES,
    MAX_UPLOAD_FILES,
    MAX_UPLOAD_PIXELS,
)


@pytest.fixture(scope="module")
def engine_module():
    return demo_module("engine")


@pytest.fixture(scope="module")
def engine(engine_module):
    require_tiny_shapes()
    return engine_module.Engine(device="cpu")


def generate(engine, **changes):
    values = {"pipeline": "tiny-shapes", "lora": None, "prompt": "a red circle", "negative_prompt": None, "seed": 0,
              "steps": 2, "guidance_scale": 5.0, "num_images": 2, "method": "best-of-n", "budget": 2, "settings": "",
              "weights": {"jpeg_compressibility": 1.0}}
    values.update(changes)
    return engine.generate(**values)


@pytest.mark.parametrize("changes, message", [
    ({"budget": 100_000_000}, f"best-of-n's num_samples must be 1 to {MAX_LATENT_ROWS} (per prompt), got 100000000"),
    ({"method": "fk", "budget": 200_000}, f"fk's num_particles must be 1 to {MAX_LATENT_ROWS}"),
    ({"method": "svdd", "budget": 10**8}, f"svdd's num_candidates must be 1 to {MAX_LATENT_ROWS}"),
    ({"method": "svdd", "budget": 20, "settings": "num_samples=300"}, "svdd would hold 6000 latents per prompt"),
    ({"method": "reno", "budget": 10**7}, "reno's iterations must be 1 to 10000"),
    ({"num_images": 16, "budget": 1000},
     (f"best-of-n would hold 16 prompts × 1000 latents = 16000 latents at once, more than {MAX_ROWS_PER_CALL}; "
      "use fewer images")),
    ({"num_images": 100_000, "method": "plain"}, f"images must be 1 to {MAX_DEMO_IMAGES}, got 100000"),
    ({"steps": 10**6, "method": "plain"}, f"steps must be 1 to {MAX_NUM_STEPS}, got 1000000"),
])
def test_generate_refuses_sizes_beyond_the_bounds_before_loading(engine, changes, message):
    loaded = dict(engine._pipes)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        generate(engine, **changes)
    assert dict(engine._pipes) == loaded  # refused before any pipeline loaded


def test_generate_steps_beyond_the_pipelines_scheduler(engine):
    """Within the shared bound, the pipeline's own (LCM picks its steps among 50) as `diffrl sample --steps`."""
    from diffrl.embedded import is_built

    if not is_built("tiny-shapes-lcm"):
        pytest.skip("the embedded tiny-shapes-lcm pipeline is not built")
    with pytest.raises(UserError, match="steps is 51, more than the 50 steps LCM picks from"):
        generate(engine, pipeline="tiny-shapes-lcm", method="plain", steps=51, num_images=1)


def test_compare_refuses_more_images_than_the_bound(engine):
    prompts = "\n".join(f"prompt {i}" for i in range(MAX_DEMO_IMAGES // 8 + 1))
    with pytest.raises(UserError, match=f"prompts × images per prompt .* must be 1 to {MAX_DEMO_IMAGES}"):
        engine.compare(run_dir="runs/x", other_run_dir=None, pipeline="tiny-shapes", prompts=prompts,
                       images_per_prompt=8, seed=0, steps=2, guidance_scale=5.0, weights={"jpeg_compressibility": 1})
    with pytest.raises(UserError, match=f"steps must be 1 to {MAX_NUM_STEPS}"):
        engine.compare(run_dir="runs/x", other_run_dir=None, pipeline="tiny-shapes", prompts="x",
                       images_per_prompt=1, seed=0, steps=5000, guidance_scale=5.0, weights={"jpeg_compressibility": 1})


def bomb_png(width: int, height: int) -> bytes:
    """A PNG of a few hundred bytes whose header declares `width` x `height` RGB pixels (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * (3 * width + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("width, height, message", [
    (10_000, 10_000, f"is 10000x10000 = 100000000 pixels, more than the bound of {MAX_UPLOAD_PIXELS}"),
    (5_000, 5_000, f"is 5000x5000 = 25000000 pixels, more than the bound of {MAX_UPLOAD_PIXELS}"),  # under PIL's
    (20_000, 20_000, "more than 178956970 pixels, twice PIL's bound"),  # PIL refuses on open: `score`'s message
])
def test_score_refuses_a_decompression_bomb_from_its_header(engine, tmp_path, width, height, message):
    (tmp_path / "ok.png").write_bytes(bomb_png(16, 16))
    (tmp_path / "bomb.png").write_bytes(bomb_png(width, height))
    with pytest.raises(UserError, match=message):
        engine.score([str(tmp_path / "ok.png"), str(tmp_path / "bomb.png")], "a red circle", ["jpeg_compressibility"])


def test_score_refuses_too_many_files_and_too_many_bytes(engine, engine_module, tmp_path, monkeypatch):
    image = tmp_path / "a.png"
    image.write_bytes(bomb_png(16, 16))
    with pytest.raises(UserError, match=f"{MAX_UPLOAD_FILES + 1} images uploaded; score at most {MAX_UPLOAD_FILES}"):
        engine.score([str(image)] * (MAX_UPLOAD_FILES + 1), "x", ["jpeg_compressibility"])
    big = tmp_path / "big.png"
    with open(big, "wb") as f:  # a sparse file: the size is what is checked, before reading
        f.write(bomb_png(16, 16))
        f.truncate(MAX_UPLOAD_BYTES + 1)
    with pytest.raises(UserError, match=f"image big.png is {MAX_UPLOAD_BYTES + 1} bytes, more than the bound"):
        engine.score([str(big)], "x", ["jpeg_compressibility"])
    rows, _, _ = engine.score([str(image), str(image)], "x", ["jpeg_compressibility"])
    assert len(rows) == 2 and rows[0]["jpeg_compressibility"] == rows[1]["jpeg_compressibility"]


# -- Runs page ---------------------------------------------------------------------------------------------------


@pytest.fixture
def runs_root(tmp_path):
    root = tmp_path / "runs"
    make_metrics_run(root / "r1")
    elsewhere = tmp_path / "elsewhere"
    make_metrics_run(elsewhere / "r2")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "config.yaml").write_text("token: do-not-show\n")
    return root


@pytest.mark.parametrize("typed", ["{tmp}/secret", "{tmp}/elsewhere/r2", "{root}/../secret", "{root}", "/etc"])
def test_runs_page_reads_only_run_dirs_under_the_runs_folder(runs_root, tmp_path, typed):
    runs = demo_module("runs")
    with pytest.raises(UserError, match="is not a run dir under .* the Runs page reads only those"):
        runs.read_run(typed.format(tmp=tmp_path, root=runs_root), runs_root)
    assert runs.read_run(str(runs_root / "r1"), runs_root).config.startswith("trainer: ddpo")
    assert runs.read_run("r1", runs_root).run_dir == runs_root / "r1"  # a name under the runs folder


def test_runs_page_follows_no_link_out(runs_root, tmp_path):
    runs = demo_module("runs")
    (runs_root / "linked").symlink_to(tmp_path / "elsewhere" / "r2")  # a run dir that is a link to another place
    with pytest.raises(UserError, match="is not a run dir under"):
        runs.read_run(str(runs_root / "linked"), runs_root)
    for name in ("config.yaml", "metrics.jsonl", "reward_curve.png", "images/epoch-2.png"):
        run = make_metrics_run(runs_root / f"link-{name.replace('/', '-')}")
        (run / name).unlink()
        (run / name).symlink_to(tmp_path / "secret" / "config.yaml")
        with pytest.raises(UserError, match=f"{name} links out of the run dir"):
            runs.read_run(str(run), runs_root)
    inside = make_metrics_run(runs_root / "link-inside")  # a link that stays inside the run dir is read
    (inside / "config.yaml").rename(inside / "config.original.yaml")
    (inside / "config.yaml").symlink_to("config.original.yaml")
    assert runs.read_run(str(inside), runs_root).config.startswith("trainer: ddpo")


# -- Label page --------------------------------------------------------------------------------------------------


def test_label_writes_through_a_symlinked_pairs_file(tmp_path):
    labels = demo_module("labels")
    folder = make_pairs(tmp_path / "pairs", n=2)
    real = tmp_path / "labels" / "real_pairs.jsonl"
    real.parent.mkdir()
    (folder / "pairs.jsonl").rename(real)
    (folder / "pairs.jsonl").symlink_to(real)
    path = labels.pairs_path(str(folder))
    labels.set_choice(path, 1, "tie")
    assert (folder / "pairs.jsonl").is_symlink()  # the link stays a link
    assert [json.loads(line)["choice"] for line in real.read_text().splitlines()] == [None, "tie"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["real_pairs.jsonl"]  # no temporary file left
    assert labels.next_unlabelled(labels.read_pairs(path)) == 0


# -- temporary files ---------------------------------------------------------------------------------------------


def test_temp_folder_is_removed_and_the_upload_folder_restored(monkeypatch):
    app_module = demo_module("app")
    monkeypatch.delenv("GRADIO_TEMP_DIR", raising=False)
    folder = app_module.TempFolder(uploads=True)
    assert folder.files.is_dir() and os.environ["GRADIO_TEMP_DIR"] == str(folder.path / "uploads")
    (folder.path / "uploads").mkdir()
    (folder.path / "uploads" / "upload.png").write_bytes(b"an uploaded image")
    folder.cleanup()
    assert not folder.path.exists() and "GRADIO_TEMP_DIR" not in os.environ
    monkeypatch.setenv("GRADIO_TEMP_DIR", "/somewhere/of/the/users")  # set by the user: left alone
    folder = app_module.TempFolder(uploads=True)
    assert os.environ["GRADIO_TEMP_DIR"] == "/somewhere/of/the/users"
    folder.cleanup()
    assert os.environ["GRADIO_TEMP_DIR"] == "/somewhere/of/the/users"


def test_launch_keeps_uploads_in_its_folder_bounds_them_and_removes_it(tmp_path, monkeypatch):
    import socket

    from gradio_client import Client, handle_file

    app_module = demo_module("app")
    monkeypatch.delenv("GRADIO_TEMP_DIR", raising=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app, url = app_module.launch(port=port, block=False, preload=None, quiet=True, runs_root=str(tmp_path))
    folder = app.diffrl_temp
    try:
        assert app.max_file_size == MAX_UPLOAD_BYTES
        image = tmp_path / "a.png"
        image.write_bytes(bomb_png(16, 16))
        Client(url, verbose=False).predict([handle_file(str(image))], "x", ["jpeg_compressibility"],
                                                      api_name="/score")
        uploads = [p for p in (folder.path / "uploads").rglob("*") if p.is_file()]
        assert "a.png" in [p.name for p in uploads]  # the upload is in the demo's own folder, not /tmp/gradio
    finally:
        app.close()
        folder.cleanup()
    assert not folder.path.exists()
    assert "GRADIO_TEMP_DIR" not in os.environ


def test_build_app_without_a_folder_removes_its_own(tmp_path):
    import gc

    app_module = demo_module("app")
    engine_module = demo_module("engine")
    require_tiny_shapes()
    app = app_module.build_app(engine_module.Engine(device="cpu"), runs_root=str(tmp_path))
    path = Path(app.diffrl_temp.path)
    assert path.is_dir()
    app.diffrl_temp.cleanup()
    assert not path.exists()
    del app
    gc.collect()
