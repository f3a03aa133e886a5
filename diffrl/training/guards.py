"""Guards that stop a run early and loudly instead of wasting compute or silently training on garbage.

- `check_run_dir_writable`: an unwritable run dir fails before the pipeline is even loaded.
- non-finite rewards: those samples are dropped (advantage, loss and statistics ignore them) and counted;
  an epoch whose rewards are all non-finite stops the run.
- non-finite losses / gradients: the optimizer step is skipped (weights stay good) and counted;
  `max_nan_steps` of them in a row stop the run. A stopped run first saves a checkpoint of its last good weights.
"""

import os
import uuid
from pathlib import Path

from diffrl.errors import UserError


class TrainingStopped(UserError):
    """The run cannot continue (all rewards non-finite, repeated non-finite losses). The message names the last
    good checkpoint. A `UserError`, so the CLI prints it as one line."""


def check_run_dir_writable(run_dir: Path) -> None:
    """Create `run_dir` and write/delete a probe file in it, or raise `UserError` saying what to do."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-probe-{uuid.uuid4().hex}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"run dir {run_dir} is not writable ({e.strerror or e}); set run.output_dir to a folder you can write to"
        ) from None
    if not os.access(run_dir, os.W_OK):
        raise UserError(f"run dir {run_dir} is not writable; set run.output_dir to a folder you can write to")


class NanStepGuard:
    """Counts optimizer steps skipped for a non-finite loss or gradient norm; trips after `limit` in a row.

    Args:
        limit (`int`): consecutive non-finite steps that stop the run (`<= 0`: never stop, only skip).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.consecutive = 0
        self.total = 0

    def record(self, finite: bool) -> bool:
        """Record one step; returns whether the run must stop."""
        if finite:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.total += 1
        return self.limit > 0 and self.consecutive >= self.limit
