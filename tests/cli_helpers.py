"""What the bad-input, run-lock and resume-tampering tests share: a snapshot of files, the one-line-error check of a
CLI call, and a finished tiny DDPO run to damage."""

import hashlib
import textwrap
from pathlib import Path

from diffrl.cli import main


def snapshot(*roots: Path) -> dict:
    """Every file under `roots` → the SHA-256 of its bytes."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(Path(root).rglob("*")) if p.is_file()}


def one_line_error(capsys, argv, expected, *roots) -> str:
    """Run `argv`; assert exit code 2, one stderr line with `expected`, and the files under `roots` unchanged."""
    before = snapshot(*roots)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert expected in err, err
    assert snapshot(*roots) == before  # nothing changed, nothing added (no 0-byte or temporary file)
    return err


def tiny_ddpo_run(root: Path, num_epochs: int, optim_extra: str = "") -> Path:
    """Train `root/recipe.yaml` — DDPO on a tiny random SD pipeline (`root/pipe`), one optimizer step an epoch, a
    checkpoint every epoch — to its end through the CLI; returns the run dir `root/runs/ref`. `optim_extra` adds
    keys to the optim group (e.g. ", use_ema: true, ema_decay: 0.9")."""
    from samplers.testing import tiny_sd_pipeline

    tiny_sd_pipeline(root / "pipe")
    (root / "recipe.yaml").write_text(textwrap.dedent(f"""\
        trainer: ddpo
        run: {{name: ref, output_dir: {root / "runs"}, num_epochs: {num_epochs}, save_every: 1}}
        model: {{pipeline: {root / "pipe"}, lora: {{rank: 2, alpha: 2.0}}}}
        sample: {{num_steps: 2, guidance_scale: 3.0, eta: 1.0, batch_size: 2, num_batches_per_epoch: 1}}
        reward: {{name: jpeg_compressibility}}
        prompts: {{source: [a red circle, a blue square]}}
        log: {{tracker: none, image_every: 0}}
        optim: {{learning_rate: 1.0e-2, gradient_accumulation_steps: 1{optim_extra}}}
        train: {{batch_size: 2}}
    """))
    assert main(["run", str(root / "recipe.yaml")]) == 0
    return root / "runs" / "ref"
