"""`diffrl demo`: its defaults (127.0.0.1, no share link, no analytics), and diffrl without gradio."""

import os
import socket
import subprocess
import sys

import pytest
from demo_helpers import demo_module

from diffrl.cli import main


def test_the_verb_binds_localhost_without_a_share_link_by_default(monkeypatch):
    app_module = demo_module("app")
    calls = []
    monkeypatch.setattr(app_module, "launch", lambda **kwargs: calls.append(kwargs))
    # the defaults are what is asserted, not that ports 7860/8000 are free on the machine running the tests
    monkeypatch.setattr("diffrl.cli._check_bindable", lambda host, port: None)
    assert main(["demo"]) == 0
    assert calls[0]["host"] == "127.0.0.1" and calls[0]["port"] == 7860 and calls[0]["share"] is False
    assert main(["demo", "--host", "0.0.0.0", "--port", "8000", "--share", "--concurrency", "2"]) == 0
    assert calls[1]["host"] == "0.0.0.0" and calls[1]["port"] == 8000 and calls[1]["share"] is True
    assert calls[1]["concurrency"] == 2


def test_launch_serves_on_localhost_with_analytics_off(tmp_path):
    app_module = demo_module("app")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app, url = app_module.launch(port=port, block=False, preload=None, quiet=True, runs_root=str(tmp_path))
    try:
        assert url == f"http://127.0.0.1:{port}/"
        assert app.share is False and app.analytics_enabled is False
        assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "False"
        assert app.local_url == url
    finally:
        app.close()
        app.diffrl_temp.cleanup()  # as the verb does when the demo stops: its folder and GRADIO_TEMP_DIR go


def test_bad_concurrency_is_a_one_line_error(capsys):
    assert main(["demo", "--concurrency", "0"]) == 2
    assert "must be > 0" in capsys.readouterr().err


def test_without_gradio_the_verb_says_how_to_install_it(monkeypatch, capsys):
    demo_module("app")
    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` now fails as if it were not installed
    monkeypatch.delitem(sys.modules, "diffrl.demo.app")
    assert main(["demo"]) == 2
    assert 'the demo needs gradio, which is not installed; install it with: pip install "diffrl[demo]"' in (
        capsys.readouterr().err)


def test_the_rest_of_diffrl_never_imports_gradio():
    code = ("import sys, diffrl, diffrl.cli, diffrl.steering, rewards, samplers; "
            "from diffrl.cli import build_parser; build_parser().parse_args(['demo', '--port', '1']); "
            "assert 'gradio' not in sys.modules, 'gradio imported'")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("module", ["labels", "runs", "engine"])
def test_demo_modules_other_than_the_app_import_without_gradio(module):
    code = (f"import sys; sys.modules['gradio'] = None; from diffrl.demo_loader import demo_module; "
            f"demo_module('{module}'); assert 'gradio' not in [m for m in sys.modules if sys.modules[m]]")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
