"""The diffrl CLI: verbs end to end on tiny models, and bad input as one line on stderr with exit code 2.

Most cases call `main([...])` in-process (fast); a few run the real `python -m diffrl.cli` as a subprocess to
check what a user's terminal sees (exit code, a single stderr line, no traceback).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import diffrl.bench
from diffrl.cli import main

REPO = Path(__file__).resolve().parent.parent

DUMMY_TRAINER = '''
"""A trainer for CLI tests: records each call and writes one checkpoint."""
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainConfig:
    batch_size: int = 2  # per process


OPTIM_DEFAULTS = {"learning_rate": 3e-4}
ADVANTAGE_DEFAULTS = None


def check(cfg):
    pass


def derived(cfg, num_processes):
    from diffrl.config import minibatch_numbers

    return minibatch_numbers(cfg, num_processes, batch_size=cfg.train.batch_size)


def epoch_passes(cfg):
    return {}


def train(cfg, run_dir, *, resume=False, accelerator=None, step_callback=None):
    run_dir = Path(run_dir)
    with open(run_dir / "calls.jsonl", "a") as f:
        record = {"resume": cfg.run.resume, "resume_arg": resume, "learning_rate": cfg.optim.learning_rate}
        f.write(json.dumps(record) + "\\n")
    (run_dir / "checkpoints" / "step-1").mkdir(parents=True, exist_ok=True)
    return {"reward_mean": 1.5}
'''


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory with a dummy trainer package, a pipeline-like folder, a prompt file and a recipe."""
    pkg = tmp_path / "cli_test_trainers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "dummy.py").write_text(DUMMY_TRAINER)
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    (tmp_path / "prompts.txt").write_text("a red circle\ntwo blue squares\n")
    (tmp_path / "recipe.yaml").write_text(textwrap.dedent(f"""\
        trainer: cli_test_trainers.dummy
        run: {{output_dir: {tmp_path / "runs"}}}
        model: {{pipeline: {tmp_path / "pipe"}}}
        sample: {{batch_size: 2, num_batches_per_epoch: 2}}
        reward: {{name: jpeg_compressibility}}
        prompts: {{source: {tmp_path / "prompts.txt"}}}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_cli(args, cwd, extra_path=None):
    path = [str(REPO), str(extra_path or ""), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    return subprocess.run([sys.executable, "-m", "diffrl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          check=False, text=True, timeout=120)


def assert_one_line_error(capsys, argv, expected):
    capsys.readouterr()  # drop earlier output
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert expected in err, err
    return err


# ---------------------------------------------------------------------------------------------------------------
# run / resume / validate


def test_run_writes_config_then_trains(work, capsys):
    assert main(["run", "recipe.yaml", "optim.learning_rate=1e-5", "run.name=first"]) == 0
    out, err = capsys.readouterr()
    run_dir = work / "runs" / "first"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["optim"]["learning_rate"] == 1e-5
    assert saved["run"]["name"] == "first"
    # 2 images × 2 batches × 1 process; optimizer steps = 4 / (2 × 1)
    assert saved["derived"]["samples_per_epoch"] == 4
    assert saved["derived"]["optimizer_steps_per_epoch"] == 2
    assert {"python", "torch", "diffusers", "diffrl"} <= set(saved["versions"])
    status, _, summary = out.partition("\n")
    assert status == f"run dir: {run_dir}"  # status on stdout: stderr is for an error only
    assert summary.startswith("done in ")  # the run's summary, no JSON dump (metrics.jsonl has the metrics)
    assert err == ""
    calls = [json.loads(line) for line in (run_dir / "calls.jsonl").read_text().splitlines()]
    assert calls == [{"resume": "", "resume_arg": False, "learning_rate": 1e-5}]


def test_run_default_name_and_existing_run_dir(work, capsys):
    assert main(["run", "recipe.yaml"]) == 0
    (run_dir,) = (work / "runs").iterdir()
    assert run_dir.name.startswith("dummy_recipe_")
    assert main(["run", "recipe.yaml", f"run.name={run_dir.name}"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and f"diffrl resume {run_dir}" in err


def test_run_checks_run_dir_before_training(work, capsys):
    (work / "a_file").write_text("")
    assert_one_line_error(capsys, ["run", "recipe.yaml", f"run.output_dir={work / 'a_file' / 'runs'}"],
                          "cannot write run dir")


def test_resume(work, capsys):
    assert main(["run", "recipe.yaml", "run.name=r"]) == 0
    assert main(["resume", str(work / "runs" / "r")]) == 0
    calls = [json.loads(line) for line in (work / "runs" / "r" / "calls.jsonl").read_text().splitlines()]
    assert [(c["resume"], c["resume_arg"]) for c in calls] == [("", False), ("latest", True)]
    assert_one_line_error(capsys, ["resume", str(work)], "not a run dir")


def test_resume_without_checkpoint_starts_the_run_again(work, capsys):
    # a run that failed before its first checkpoint: `diffrl run` says "resume it", and resume starts it again
    assert main(["run", "recipe.yaml", "run.name=r"]) == 0
    (work / "runs" / "r" / "checkpoints" / "step-1").rmdir()
    capsys.readouterr()
    assert main(["resume", str(work / "runs" / "r")]) == 0
    assert "has no checkpoint yet: starting it again from epoch 0" in capsys.readouterr().out
    calls = [json.loads(line) for line in (work / "runs" / "r" / "calls.jsonl").read_text().splitlines()]
    assert [(c["resume"], c["resume_arg"]) for c in calls] == [("", False), ("", False)]


def test_validate(work, capsys):
    assert main(["validate", "recipe.yaml", "sample.batch_size=4", "--num-processes", "2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["sample"]["batch_size"] == 4
    assert printed["derived"]["samples_per_epoch"] == 16  # 4 × 2 batches × 2 processes


@pytest.mark.parametrize("argv, expected", [
    (["validate", "recipe.yaml", "sample.num_stesp=3"], "did you mean 'sample.num_steps'?"),
    (["validate", "recipe.yaml", "sample.num_steps=ten"], "sample.num_steps must be int, got 'ten' (str)"),
    (["validate", "recipe.yaml", "reward.name=nope"], "reward.name: unknown reward 'nope'"),
    (["validate", "recipe.yaml", "model.pipeline=tiny-shape"], "did you mean 'tiny-shapes'"),
    (["validate", "missing.yaml"], "no recipe file or shipped recipe named 'missing.yaml'"),
    (["validate", "recipe.yaml", "trainer=nope"], "unknown trainer 'nope'"),
    (["run", "recipe.yaml", "sample.batch_size=0"], "sample.batch_size must be > 0"),
    (["validate", "recipe.yaml", "--num-processes", "0"], "--num-processes must be >= 1"),
])
def test_recipe_errors(work, capsys, argv, expected):
    assert_one_line_error(capsys, argv, expected)
    assert not (work / "runs").exists()


def test_debug_shows_the_exception(work, capsys):
    # the whole traceback, and still exit code 2 (bad input), not Python's 1
    for argv in (["--debug", "validate", "recipe.yaml", "sample.num_stesp=3"],
                 ["validate", "--debug", "recipe.yaml", "sample.num_stesp=3"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "UserError: unknown key 'sample.num_stesp'" in err


# ---------------------------------------------------------------------------------------------------------------
# sample


@pytest.fixture(scope="module")
def tiny_pipeline_dir(tmp_path_factory):
    from samplers.testing import tiny_sd_pipeline

    folder = tmp_path_factory.mktemp("tiny") / "sd"
    tiny_sd_pipeline(folder)
    return folder


def test_sample_writes_pngs_and_scores(tiny_pipeline_dir, tmp_path, capsys):
    from PIL import Image

    argv = ["sample", "--pipeline", str(tiny_pipeline_dir), "--prompt", "a red circle", "--prompt", "a square",
            "-n", "2", "--steps", "2", "--eta", "1.0", "--seed", "10", "--reward", "jpeg_compressibility"]
    assert main(argv + ["--out", str(tmp_path / "a"), "--batch-size", "3"]) == 0
    images = json.loads((tmp_path / "a" / "scores.json").read_text())
    assert [(r["file"], r["prompt"], r["seed"]) for r in images] == [
        ("00000.png", "a red circle", 10), ("00001.png", "a red circle", 11),
        ("00002.png", "a square", 12), ("00003.png", "a square", 13)]
    # the reward's score under its name, and its per-image info (the JPEG size in kB) beside it
    assert all(set(r) == {"file", "prompt", "seed", "jpeg_compressibility", "jpeg_kb"} for r in images)
    assert all(r["jpeg_kb"] > 0 and r["jpeg_compressibility"] == pytest.approx(-r["jpeg_kb"]) for r in images)
    settings = json.loads((tmp_path / "a" / "settings.json").read_text())
    assert settings["num_steps"] == 2 and settings["sampler"] == "ddim" and settings["eta"] == 1.0
    size = Image.open(tmp_path / "a" / "00000.png").size
    assert size == (16, 16)  # the tiny UNet's 8x8 latents × the tiny VAE's factor 2 (two blocks)
    # per-image seeds: the same image whatever batch it was drawn in, up to float rounding (a batch of 3 and a batch
    # of 1 run different CPU kernels, ~1e-7 apart, which can flip a pixel's 8-bit rounding: at most one level)
    import numpy as np

    assert main(argv + ["--out", str(tmp_path / "b"), "--batch-size", "1"]) == 0
    for r in images:
        a, b = (np.asarray(Image.open(tmp_path / d / r["file"]), dtype=np.int16) for d in ("a", "b"))
        assert np.abs(a - b).max() <= 1 and (a == b).mean() > 0.99, r["file"]
    assert "wrote 4 images" in capsys.readouterr().out


def test_sample_with_prompt_file_and_lora_run_dir(tiny_pipeline_dir, tmp_path):
    """--lora RUN_DIR without --pipeline takes the pipeline from the run's config.yaml and its newest LoRA."""
    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    from diffrl.pipelines import load_pipeline

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(f"model: {{pipeline: {tiny_pipeline_dir}}}\n")
    unet = load_pipeline(tiny_pipeline_dir).unet
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_B" in name:
                p.fill_(0.3)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(run / "checkpoints" / "step-4", unet_lora_layers=layers)
    (tmp_path / "prompts.txt").write_text("a red circle\n\ntwo squares\n")
    common = ["sample", "--prompts", str(tmp_path / "prompts.txt"), "--steps", "2"]
    assert main(common + ["--lora", str(run), "--out", str(tmp_path / "tuned")]) == 0
    assert main(common + ["--pipeline", str(tiny_pipeline_dir), "--out", str(tmp_path / "base")]) == 0
    tuned = json.loads((tmp_path / "tuned" / "scores.json").read_text())
    assert [r["prompt"] for r in tuned] == ["a red circle", "two squares"]
    settings = json.loads((tmp_path / "tuned" / "settings.json").read_text())
    assert settings["pipeline"] == str(tiny_pipeline_dir) and settings["lora"] == str(run)
    # which checkpoint of the run was loaded
    assert settings["lora_step"] == 4
    assert settings["lora_weights"] == str(run / "checkpoints" / "step-4" / "pytorch_lora_weights.safetensors")
    assert (tmp_path / "tuned" / "00000.png").read_bytes() != (tmp_path / "base" / "00000.png").read_bytes()


@pytest.mark.parametrize("inside", ["best", "checkpoints/step-4"])
def test_sample_lora_from_a_folder_inside_a_run_dir(tiny_pipeline_dir, tmp_path, inside):
    """--lora RUN_DIR/best (the README's command) or RUN_DIR/checkpoints/step-N without --pipeline: the pipeline
    comes from the run's config.yaml and the LoRA from that folder, not from the newest checkpoint."""
    from diffusers import StableDiffusionPipeline

    run = tmp_path / "run"
    (run / "config.yaml").parent.mkdir(parents=True)
    (run / "config.yaml").write_text(f"model: {{pipeline: {tiny_pipeline_dir}}}\n")
    (run / "metrics.jsonl").write_text('{"epoch": 0}\n')
    layers = _lora_layers(tiny_pipeline_dir, 0.3)
    for folder in ("best", "checkpoints/step-4", "checkpoints/step-8"):
        StableDiffusionPipeline.save_lora_weights(run / folder, unet_lora_layers=layers)
    args = ["sample", "--prompt", "a red circle", "--steps", "2", "--lora", str(run / inside), "--out",
            str(tmp_path / "out")]
    assert main(args) == 0
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    assert settings["pipeline"] == str(tiny_pipeline_dir)
    assert settings["lora_weights"] == str(run / inside / "pytorch_lora_weights.safetensors")


def test_sample_lora_folder_outside_a_run_needs_the_pipeline(tiny_pipeline_dir, tmp_path, capsys):
    """A LoRA folder whose parent has a config.yaml but is no run dir (no metrics.jsonl) does not borrow it."""
    from diffusers import StableDiffusionPipeline

    (tmp_path / "config.yaml").write_text(f"model: {{pipeline: {tiny_pipeline_dir}}}\n")
    StableDiffusionPipeline.save_lora_weights(tmp_path / "lora", unet_lora_layers=_lora_layers(tiny_pipeline_dir, 0.3))
    args = ["sample", "--prompt", "x", "--lora", str(tmp_path / "lora"), "--out", str(tmp_path / "out")]
    assert main(args) == 2
    assert "--pipeline is required" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _lora_layers(pipeline_dir, value: float) -> dict:
    """A rank-4 attention LoRA of the tiny UNet with every B matrix `value` (so it changes the images)."""
    import torch
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    from diffrl.pipelines import load_pipeline

    unet = load_pipeline(pipeline_dir).unet
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_B" in name:
                p.fill_(value)
    return convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))


@pytest.mark.parametrize("extra, expected", [
    (["-n", "0", "--prompt", "x"], "argument -n/--num-images: must be > 0, got 0"),
    (["-n", "two", "--prompt", "x"], "expected a whole number, got 'two'"),
    (["--batch-size", "-1", "--prompt", "x"], "must be > 0, got -1"),
    (["--prompts", "empty.txt"], "--prompts: empty.txt holds no prompts"),
    (["--prompts", "missing.txt"], "prompt file missing.txt does not exist"),
    (["--prompt", "x", "--prompts", "p.txt"], "give either --prompt TEXT"),
    ([], "give either --prompt TEXT"),
    (["--prompt", "x", "--reward", "nope"], "unknown reward 'nope'"),
    (["--prompt", "x", "--pipeline", "tiny-shape"], "unknown pipeline 'tiny-shape'"),
    (["--prompt", "x", "--pipeline", "/no/such/folder"], "pipeline folder /no/such/folder does not exist"),
    (["--prompt", "x", "--pipeline", "some-org/uncached-model"], "HF_HUB_OFFLINE"),
    (["--prompt", "x", "--lora", "missing-run"], "--lora missing-run does not exist"),
    (["--prompt", "x", "--reward", "jpeg_compressibility", "--reward", "aesthetic", "--reward-arg", "a=1"],
     "--reward-arg needs exactly one --reward"),
])
def test_sample_bad_input(tmp_path, monkeypatch, capsys, extra, expected):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "p.txt").write_text("a\n")
    argv = ["sample", "--out", str(tmp_path / "out")] + extra
    if "--pipeline" not in extra:
        argv += ["--pipeline", "some-org/uncached-model"]
    assert_one_line_error(capsys, argv, expected)


def test_score(tmp_path, capsys):
    import numpy as np
    import torch
    from PIL import Image

    from rewards import get_reward

    rng = np.random.default_rng(0)
    files = []
    for i, array in enumerate([np.full((16, 16, 3), 128, np.uint8), rng.integers(0, 256, (16, 16, 3), np.uint8)]):
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(array).save(files[-1])
    out = tmp_path / "s" / "scores.json"
    assert main(["score", "--reward", "jpeg_compressibility", "--prompt", "a gray square", "--out", str(out),
                 *map(str, files)]) == 0
    records = json.loads(out.read_text())
    assert [(r["file"], r["prompt"]) for r in records] == [(str(f), "a gray square") for f in files]
    reward = get_reward("jpeg_compressibility")
    for f, r in zip(files, records):
        image = torch.from_numpy(np.array(Image.open(f))).permute(2, 0, 1)[None].float() / 255
        assert r["jpeg_compressibility"] == pytest.approx(float(reward(image, ["a gray square"]).scores[0]))
    assert records[0]["jpeg_compressibility"] > records[1]["jpeg_compressibility"]  # flat gray compresses better


@pytest.mark.parametrize("argv, expected", [
    (["score", "--reward", "nope", "--prompt", "x", "a.png"], "image a.png does not exist"),
    (["score", "--reward", "nope", "--prompt", "x", "img.png"], "unknown reward 'nope'"),
    (["score", "--reward", "jpeg_compressibility", "--prompt", "x"], "required: IMAGE"),
    (["score", "--reward", "jpeg_compressibility", "--reward-arg", "quality", "--prompt", "x", "img.png"],
     "--reward-arg 'quality' is not key=value"),
])
def test_score_bad_input(tmp_path, monkeypatch, capsys, argv, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "img.png").write_bytes(b"")
    assert_one_line_error(capsys, argv, expected)


def test_steer_verb_is_wired(tiny_pipeline_dir, tmp_path, capsys):
    """The options and logic are the steering package's; here only that the verb reaches them."""
    assert main(["steer", "--pipeline", str(tiny_pipeline_dir), "--method", "best-of-n", "--reward",
                 "jpeg_compressibility", "--prompt", "a red circle", "--steps", "2", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "scores.json").read_text())
    assert len(records) == 1 and records[0]["prompt"] == "a red circle" and "jpeg_compressibility" in records[0]
    assert_one_line_error(capsys, ["steer", "--method", "bestofn", "--out", "x"], "invalid choice: 'bestofn'")


def test_sample_requires_out(capsys):
    assert_one_line_error(capsys, ["sample", "--prompt", "x"], "the following arguments are required: --out")


# ---------------------------------------------------------------------------------------------------------------
# ls / bench / main


@pytest.mark.parametrize("topic", ["trainers", "rewards", "samplers", "recipes", "pipelines", "prompts", None])
def test_ls(capsys, topic):
    assert main(["ls"] + ([topic] if topic else [])) == 0
    out = capsys.readouterr().out
    if topic == "trainers":
        assert "ddpo" in out
    if topic == "rewards":
        assert "jpeg_compressibility" in out
    if topic == "samplers":
        assert "ddim" in out
    if topic == "recipes":  # a header over the four verification marks, a row per recipe, a legend
        lines = out.splitlines()
        assert lines[0].split() == ["parity", "direction", "gold", "real", "path"] and "docs/parity.md" in lines[-1]
        row = next(line for line in lines if line.startswith("flow_grpo/tiny_shapes_flow_verifier "))
        assert row.split()[1:5] == ["✓", "✓", "✗", "✗"] and row.endswith("tiny_shapes_flow_verifier.yaml")
    if topic is None:
        assert all(f"{t}:" in out for t in ("trainers", "rewards", "samplers", "recipes", "pipelines", "prompts"))


def test_ls_unknown_topic(capsys):
    assert_one_line_error(capsys, ["ls", "models"], "invalid choice: 'models'")


def test_bench_dispatch(tmp_path, monkeypatch, capsys):
    (tmp_path / "toy.py").write_text(textwrap.dedent('''\
        """A toy benchmark for the CLI tests."""
        from pathlib import Path


        def add_arguments(parser):
            parser.add_argument("--out", required=True)
            parser.add_argument("--size", type=int, default=3)


        def run_toy_bench(args):
            Path(args.out).write_text(str(args.size * 2))
    '''))
    monkeypatch.setattr(diffrl.bench, "__path__", [*diffrl.bench.__path__, str(tmp_path)])
    assert main(["bench"]) == 0
    listed = [line.split(None, 1) for line in capsys.readouterr().out.splitlines()]
    assert ["toy", "A toy benchmark for the CLI tests."] in listed
    assert main(["bench", "toy", "--out", str(tmp_path / "result"), "--size", "5"]) == 0
    assert (tmp_path / "result").read_text() == "10"
    assert_one_line_error(capsys, ["bench", "toy", "--size", "x"], "diffrl bench toy: error: argument --size")
    assert_one_line_error(capsys, ["bench", "tyo"], "unknown benchmark 'tyo'; did you mean 'toy'?")


def test_no_verb_and_unknown_verb(capsys):
    assert_one_line_error(capsys, [], "the following arguments are required: VERB")
    assert_one_line_error(capsys, ["train"], "invalid choice: 'train'")


# ---------------------------------------------------------------------------------------------------------------
# the real command in a subprocess


@pytest.mark.parametrize("args, expected", [
    (["validate", "recipe.yaml", "sample.num_stesp=3"], "did you mean 'sample.num_steps'?"),
    (["sample", "--out", "o", "--prompt", "x", "-n", "0"], "must be > 0"),
    (["sample", "--out", "o", "--prompts", "empty.txt", "--pipeline", "p"], "holds no prompts"),
    (["sample", "--out", "o", "--prompt", "x", "--pipeline", "nope-pipe"], "unknown pipeline 'nope-pipe'"),
    (["run", "missing.yaml"], "no recipe file"),
    (["run", "draft/tiny_shapes_pickscore", "reward.name=shapes_verifier", "reward.kwargs={}"],
     ("DRaFT backpropagates through the reward and 'shapes_verifier' is not differentiable; use one of aesthetic, "
     "clip_score")),
    (["validate", "draft/tiny_shapes_clip", "reward.components=[{name: clip_score}, {name: jpeg_compressibility}]",
      "reward.name=", "reward.kwargs={}"], "'jpeg_compressibility' is not differentiable"),
])
def test_subprocess_errors_are_one_line(work, args, expected):
    (work / "empty.txt").write_text("")
    result = run_cli(args, cwd=work, extra_path=work)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert expected in result.stderr


def test_importing_the_cli_loads_no_config_yaml_or_numpy():
    """`import diffrl` hands the trainer lookup down (`diffrl.trainer_lookup`) without importing diffrl.config, and the
    CLI's top imports load neither YAML nor numpy (nor torch), so `diffrl --help` starts in about Python's own time."""
    heavy = ("diffrl.config", "yaml", "numpy", "torch")
    code = f"import sys, diffrl.cli; sys.exit(any(m in sys.modules for m in {heavy!r}))"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60, check=False).returncode == 0


def test_help_is_fast_and_imports_no_torch():
    code = "import sys, diffrl.cli; sys.exit('torch' in sys.modules or 'diffusers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60, check=False).returncode == 0
    result = run_cli(["--help"], cwd=REPO)
    assert result.returncode == 0
    for verb in ("run", "resume", "validate", "ls", "sample", "score", "steer", "bench"):
        assert verb in result.stdout
        assert run_cli([verb, "--help"], cwd=REPO).returncode == 0


def test_a_reader_that_leaves_early_gets_no_error_line(capsys, monkeypatch, tmp_path):
    """`diffrl ls | head -1`: writing to the closed pipe raises BrokenPipeError; diffrl stops quietly (exit 1, nothing
    on stderr) and points stdout at /dev/null so Python's final flush cannot fail again."""
    with open(tmp_path / "stdout", "w") as sink:  # stands in for the pipe's file descriptor

        class ClosedPipe:
            def write(self, text):
                raise BrokenPipeError(32, "Broken pipe")

            def flush(self):
                pass

            def fileno(self):
                return sink.fileno()

        monkeypatch.setattr(sys, "stdout", ClosedPipe())
        assert main(["ls", "recipes"]) == 1
    assert capsys.readouterr().err == ""
