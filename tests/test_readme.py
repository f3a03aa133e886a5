"""Every `diffrl` command in README.md and the docs pages runs, and the README's links resolve.

Commands come from the fenced code blocks (```bash, ```console or unlabelled) of README.md and docs/*.md: a line
(backslash continuations joined, `# ...` comments dropped) is split on `&&`, and each part that starts with `diffrl`
or `accelerate launch -m diffrl.cli` is a command. A line `$ diffrl ...` is a transcript: the lines after it are its
output, and an error shown there must be exactly the one line the command prints on stderr (exit code 2).

The commands of one document run in order in one fresh working directory, so a later command finds what an earlier
one wrote (`diffrl sample --out samples/base`, then `diffrl score samples/base/00000.png`). How each is checked is
`CHECKS[verb]`:

- run for real (`ls`, `validate`, `score`, `export`, `--help`) or on tiny settings (`sample`, `steer`, `pairs`:
  the options in `TINY` are added or capped, nothing else changes);
- training and the demo only parse: `run` through the CLI's argparse and then `diffrl validate` with the same recipe
  and overrides (the checks `run` makes before it trains), `resume` by reading the run dir's config and checking
  what it names, `demo` and `bench NAME` through their argparse.

Placeholders are upper-case words (`RUN_DIR`, `DIR`): `PLACEHOLDERS` says what each stands for here, and a command
with one that is not listed fails, so a new placeholder is added here rather than skipped. The reader's own files
(a prompt file, a recipe of their own, a run dir, images to score) are made by `reader_files`.
"""

import argparse
import importlib
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from PIL import Image

from diffrl import config
from diffrl.cli import build_parser, main
from diffrl.config_references import check_references
from diffrl.pipelines import load_pipeline
from diffrl.training.weights import export_weights

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
PREFIXES = (["diffrl"], ["accelerate", "launch", "-m", "diffrl.cli"], ["python", "-m", "diffrl.cli"])

# What each placeholder stands for in the working directory the commands run in.
PLACEHOLDERS = {
    "RUN_DIR": "runs/lr1e-4",  # a run dir made by `reader_files`, as `diffrl run ... run.name=lr1e-4` names it
    "DIR": "exported",  # a new folder
}
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*[A-Z0-9]\b")

# Options that make a command cheap: added to the command, or lowered to this value where the command gives more.
TINY = {
    "sample": {"--steps": 2, "-n": 2},
    "steer": {"--steps": 2, "--num-prompts": 1},
    "pairs": {"-n": 2},
}
OUT_FLAGS = ("--out",)  # a documented --out folder from an earlier command of the page is removed first


# ---------------------------------------------------------------------------------------------------------------
# extraction
# ---------------------------------------------------------------------------------------------------------------


def shell_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced block whose info string names a shell (or nothing)."""
    blocks, current, fence = [], None, None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            match = re.match(r"(`{3,}|~{3,})\s*([\w-]*)", stripped)
            if match:
                fence, info = match.group(1), match.group(2).lower()
                current = [] if info in SHELL_BLOCKS else False
        elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            if current is not False:
                blocks.append(current)
            current = None
        elif current is not False:
            current.append(line)
    return blocks


def _diffrl_argv(tokens: list[str]) -> list[str] | None:
    for prefix in PREFIXES:
        if tokens[: len(prefix)] == prefix:
            return tokens[len(prefix):]
    return None


def documented_commands(text: str) -> list[tuple[list[str], list[str] | None]]:
    """`(argv, transcript output or None)` for each diffrl command in the shell blocks of a Markdown text."""
    commands = []
    for block in shell_blocks(text):
        lines = "\n".join(block).replace("\\\n", " ").splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            transcript = line.startswith("$ ")
            if transcript:
                line = line[2:]
            if not re.search(r"(^|&&)\s*(diffrl|accelerate launch -m diffrl\.cli|python -m diffrl\.cli)\s", line):
                continue
            output = None
            if transcript:
                output = []
                while i < len(lines) and not lines[i].startswith("$ "):
                    output.append(lines[i])
                    i += 1
            tokens = shlex.split(line, comments=True)
            parts = [[]]
            for token in tokens:
                if token == "&&":
                    parts.append([])
                else:
                    parts[-1].append(token)
            for part in parts:
                argv = _diffrl_argv(part)
                if argv is not None:
                    commands.append((argv, output))
    return commands


def substitute(argv: list[str]) -> list[str]:
    unknown = sorted({m for a in argv for m in PLACEHOLDER.findall(a) if m not in PLACEHOLDERS})
    assert not unknown, (f"`diffrl {shlex.join(argv)}` has placeholders {unknown} that tests/test_readme.py does not "
                         "know: add what each stands for to PLACEHOLDERS")
    return [PLACEHOLDER.sub(lambda m: PLACEHOLDERS[m.group(0)], a) for a in argv]


# ---------------------------------------------------------------------------------------------------------------
# how each verb is checked
# ---------------------------------------------------------------------------------------------------------------


def _verb(argv: list[str]) -> str:
    words = [a for a in argv if not a.startswith("-")]
    return words[0] if words else ""


def _tiny(argv: list[str], verb: str) -> list[str]:
    argv = list(argv)
    for flag, value in TINY.get(verb, {}).items():
        if flag in argv:
            i = argv.index(flag) + 1
            argv[i] = str(min(int(argv[i]), value))
        else:
            argv += [flag, str(value)]
    return argv


def _clear_out(argv: list[str]) -> None:
    for flag in OUT_FLAGS:
        if flag in argv:
            shutil.rmtree(argv[argv.index(flag) + 1], ignore_errors=True)


def run_for_real(argv):
    _clear_out(argv)
    assert main(argv) == 0, f"`diffrl {shlex.join(argv)}` failed"


def run_tiny(argv):
    run_for_real(_tiny(argv, _verb(argv)))


def parse_and_validate(argv):
    """`diffrl run RECIPE overrides...`: its arguments parse, and `diffrl validate` passes with the same ones."""
    args = build_parser().parse_args(argv)
    labels = Path("labels") / "pairs.jsonl"
    if args.recipe == "d3po/tiny_shapes_labels" and labels.is_file():  # the block's comment step: a person labels
        lines = [json.loads(line) for line in labels.read_text().splitlines() if line.strip()]
        labels.write_text("".join(json.dumps({**line, "choice": 0}) + "\n" for line in lines))
    assert main(["validate", args.recipe, *args.overrides]) == 0, f"`diffrl {shlex.join(argv)}` does not validate"


def parse_and_check_run_dir(argv):
    """`diffrl resume RUN_DIR`: what resume checks before it trains."""
    args = build_parser().parse_args(argv)
    check_references(config.load_run_config(args.run_dir))


def parse_only(argv):
    build_parser().parse_args(argv)


def bench(argv):
    """`diffrl bench` lists the benchmarks (for real); `diffrl bench NAME ...` parses with the benchmark's options."""
    args = build_parser().parse_args(argv)
    if not args.name:
        return run_for_real(argv)
    module = importlib.import_module(f"diffrl.bench.{args.name}")
    parser = argparse.ArgumentParser(prog=f"diffrl bench {args.name}", exit_on_error=False)
    module.add_arguments(parser)
    parser.parse_args(args.bench_args)


CHECKS = {
    "ls": run_for_real,
    "validate": run_for_real,
    "score": run_for_real,
    "export": run_for_real,
    "sample": run_tiny,
    "steer": run_tiny,
    "pairs": run_tiny,
    "run": parse_and_validate,
    "resume": parse_and_check_run_dir,
    "demo": parse_only,
    "bench": bench,
}


def check_command(argv: list[str], output: list[str] | None, capsys) -> None:
    argv = substitute(argv)
    shown_error = [line for line in output or [] if line.startswith("diffrl: error:")]
    if shown_error:  # a transcript of bad input: exactly that line on stderr, exit code 2 (it fails before any work)
        capsys.readouterr()
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines() == shown_error
        return
    if "-h" in argv or "--help" in argv:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        return
    verb = _verb(argv)
    assert verb in CHECKS, f"`diffrl {shlex.join(argv)}`: no check for the verb '{verb}'; add one to CHECKS"
    CHECKS[verb](argv)


# ---------------------------------------------------------------------------------------------------------------
# the reader's own files
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The commands are tiny: torch's threads would only spin against each other and against the other test worker
    (on a shared 2-core machine a 2-step sample took 7 s with 2 threads and 0.4 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run_template(tmp_path_factory):
    """A run dir as `diffrl run draft/tiny_shapes_pickscore run.name=lr1e-4` leaves it after an evaluation, without
    the minutes of training: its config.yaml, a metrics line, a LoRA on tiny-shapes' UNet in checkpoints/step-1 and
    in best/ (the run's own writer, `export_weights`)."""
    run_dir = tmp_path_factory.mktemp("template") / "lr1e-4"
    cfg = config.load_recipe("draft/tiny_shapes_pickscore", ["run.name=lr1e-4"])
    run_dir.mkdir()
    derived = config.derived_numbers(cfg, 1)
    text = config.to_yaml(cfg, derived=derived, versions=config.package_versions())
    (run_dir / "config.yaml").write_text(text)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "samples_seen": 0, "eval_reward_mean": 0.5}) + "\n")
    pipe = load_pipeline(cfg.model.pipeline)
    lora = cfg.model.lora
    pipe.unet.add_adapter(LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules))
    with torch.no_grad():
        for name, p in pipe.unet.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    for folder in (run_dir / "checkpoints" / "step-1", run_dir / "best"):
        export_weights(pipe, pipe.unet, folder, use_lora=True)
    (run_dir / "best" / "best.json").write_text(json.dumps({"epoch": 0, "global_step": 0, "samples_seen": 0,
                                                            "score": 0.5}))
    return run_dir


@pytest.fixture
def reader_files(tmp_path, monkeypatch, run_template):
    """A working directory with what the documented commands read but no documented command writes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("a red circle above a blue square\ntwo green triangles\n")
    shutil.copy(REPO / "recipes" / "ddpo" / "tiny_shapes_verifier.yaml", tmp_path / "my_recipe.yaml")
    shutil.copytree(run_template, tmp_path / "runs" / "lr1e-4")
    (tmp_path / "samples" / "base").mkdir(parents=True)
    for i, color in enumerate(("red", "blue")):
        Image.new("RGB", (32, 32), color).save(tmp_path / "samples" / "base" / f"{i:05d}.png")
    return tmp_path


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_documented_command_runs(document, reader_files, capsys):
    text = (REPO / document).read_text()
    commands = documented_commands(text)
    if document == "README.md":  # the extraction itself: the README's first command and its next steps are found
        argvs = [argv for argv, _ in commands]
        assert ["run", "draft/tiny_shapes_pickscore"] in argvs
        assert any(argv[:3] == ["sample", "--lora", "RUN_DIR/best"] for argv in argvs)
    for argv, output in commands:
        check_command(argv, output, capsys)


def test_extraction():
    text = """
```bash
pip install -e . && diffrl run a/b x.y=1   # a comment
diffrl sample --prompt "a red circle" \\
    -n 8 --out o
accelerate launch -m diffrl.cli run a/b
```
```yaml
diffrl run not/a_command
```
```
$ diffrl run a/b bad=1
diffrl: error: unknown key
```
"""
    assert documented_commands(text) == [
        (["run", "a/b", "x.y=1"], None),
        (["sample", "--prompt", "a red circle", "-n", "8", "--out", "o"], None),
        (["run", "a/b"], None),
        (["run", "a/b", "bad=1"], ["diffrl: error: unknown key"]),
    ]
    assert _tiny(["sample", "-n", "8", "--out", "o"], "sample") == ["sample", "-n", "2", "--out", "o", "--steps", "2"]
    assert substitute(["export", "RUN_DIR", "--out", "DIR"]) == ["export", "runs/lr1e-4", "--out", "exported"]
    with pytest.raises(AssertionError, match="NEW_THING"):
        substitute(["sample", "--lora", "NEW_THING"])


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    headings = re.findall(r"^#+\s+(.*)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_links_resolve():
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(target.read_text()), f"README.md links to {link}: no such heading"

