"""Fixtures of the demo tests: run dirs, and one app launched in-process per session.

The app serves the embedded `tiny-shapes` pipeline on the CPU on a free port of 127.0.0.1; the endpoint tests call it
with gradio_client and the browser tests load it in Debian's chromium. Both skip with the reason when gradio (the
`demo` extra) or the embedded model is missing.
"""

import os
import shutil
import socket

import pytest
from demo_helpers import demo_module, make_lora_run, make_metrics_run, require_tiny_shapes


@pytest.fixture(scope="session")
def demo_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    require_tiny_shapes()
    runs = root / "runs"
    return {
        "root": root,
        "runs": runs,
        "lora_run": make_lora_run(runs / "tuned"),
        "empty_run": make_lora_run(runs / "no-checkpoint", checkpoint=False),
        "metrics_run": make_metrics_run(runs / "metrics"),
    }


@pytest.fixture(scope="session")
def demo_app(demo_dirs, tmp_path_factory):
    """(url, engine) of one app on 127.0.0.1, shared by the endpoint and browser tests."""
    app_module = demo_module("app")
    engine_module = demo_module("engine")
    engine = engine_module.Engine(device="cpu")
    # gradio's upload folder is the process's GRADIO_TEMP_DIR, read at each request: give this long-lived app one of
    # its own, so a test that launches and removes another demo (which points the variable at its own folder only
    # when it is unset) cannot move this app's uploads away between an upload and its download
    previous = os.environ.get("GRADIO_TEMP_DIR")
    os.environ["GRADIO_TEMP_DIR"] = str(tmp_path_factory.mktemp("gradio-uploads"))
    app = app_module.build_app(engine, runs_root=str(demo_dirs["runs"]), concurrency=1)
    app_module.serve_queue(app, concurrency=1)
    # a free port of our own: gradio's scan from 7860 can hand two xdist workers the same one
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _, url, _ = app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                           theme=app_module._theme(), head=app_module.HEAD, ssr_mode=False)
    yield url, engine
    app.close()
    if previous is None:
        os.environ.pop("GRADIO_TEMP_DIR", None)
    else:
        os.environ["GRADIO_TEMP_DIR"] = previous


@pytest.fixture(scope="session")
def client(demo_app):
    from gradio_client import Client

    return Client(demo_app[0], verbose=False)


def chromium_binary() -> str | None:
    for candidate in (os.environ.get("DIFFRL_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


@pytest.fixture(scope="session")
def browser():
    """Debian's chromium, started once for every browser test of the session (each takes a context of its own)."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium; or set DIFFRL_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright: pip install "
                                   "playwright (the browser itself is the system chromium)")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: CI containers run as root, where chromium's sandbox refuses to start
        browser = playwright.chromium.launch(executable_path=binary, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()
