"""Fine-tuning algorithms, one module per algorithm.

`TRAINERS` maps a recipe's `trainer:` name to the module that implements it. The table is lazy (module
paths, not modules) so `import diffrl.trainers` and `diffrl ls trainers` stay fast; each module defines

- `TrainConfig`: the dataclass of the recipe's `train:` group (defaults = the reference implementation's),
- `train(cfg, run_dir, *, resume=False) -> dict`: run (or continue) a training run and return its final metrics.

Pieces the trainers share (stat tracker, checkpoints, LoRA, logging, prompts, guards) live in
`diffrl.training` as plain functions and classes; trainers never inherit from each other.
"""

import importlib

TRAINERS = {"ddpo": "diffrl.trainers.ddpo", "dpok": "diffrl.trainers.dpok"}


def get_trainer(name: str):
    """Import and return the module implementing trainer `name` (a key of `TRAINERS`)."""
    from diffrl.errors import UserError

    if name not in TRAINERS:
        import difflib

        close = difflib.get_close_matches(name, list(TRAINERS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"unknown trainer '{name}'{hint} (known: {', '.join(sorted(TRAINERS))})")
    return importlib.import_module(TRAINERS[name])
