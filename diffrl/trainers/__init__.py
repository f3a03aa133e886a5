"""Fine-tuning algorithms, one module per algorithm, and the trainer contract.

`TRAINERS` maps a recipe's `trainer:` name to the module that implements it. The table is lazy (module paths, not
modules) so `import diffrl.trainers` and `diffrl ls trainers` stay fast. Registering a trainer here enrols it in the
contract tests (tests/trainers/test_contract.py): parameters change, resume equals an uninterrupted run, two
processes agree, its recipes validate, and it learns in the direction of its reward.

A trainer module states this contract:

- `TrainConfig`: the dataclass of the recipe's `train:` group, algorithm-only fields (defaults = the reference
  implementation's);
- `OPTIM_DEFAULTS`: `dict` of the reference implementation's values for the shared `optim:` group (AdamW, schedule,
  clipping, accumulation, EMA: `diffrl.config.OptimGroup`);
- `ADVANTAGE_DEFAULTS`: `dict` for the shared `advantage:` group of policy-gradient trainers, or `None` for a
  trainer that computes no advantages (its recipes then have no such group);
- `check(cfg)`: cross-field checks of a whole `RunConfig`, raising `UserError` (run at load time, so `diffrl
  validate` reports them);
- `derived(cfg, num_processes) -> dict`: the numbers that follow from the config (global batch, optimizer steps per
  epoch, ...), printed at start and saved in the run dir's `config.yaml`;
- `train(cfg, run_dir, *, resume=False, accelerator=None, step_callback=None) -> dict`: run (or continue) a run
  and return its final metrics. It composes the shared run context (`diffrl.training.context.RunContext`) and
  keeps its own loop visible;
- `epoch_passes(cfg) -> dict`: how many network passes of each kind one epoch's training makes per process
  (`train_batch` rows each: `fwd_bwd`, `reference`, `adam`, optionally `value` with `value_batch` and a module-level
  `ValueNet`), so `diffrl bench train` times the same work without knowing the algorithm.

Trainers never inherit from each other; what several need lives in `diffrl.training`.

`diffrl.config` sits below this package: it does not import it, it receives `TRAINERS` and `get_trainer` through
`diffrl.trainer_lookup.register`, called at the end of this module (`import diffrl` imports this package, so the
lookup is in place before any config is loaded).
"""

import difflib
import importlib

from diffrl import trainer_lookup
from diffrl.errors import UserError

TRAINERS = {"ddpo": "diffrl.trainers.ddpo", "dpok": "diffrl.trainers.dpok", "draft": "diffrl.trainers.draft",
            "raft": "diffrl.trainers.raft", "d3po": "diffrl.trainers.d3po",
            "diffusion_dpo": "diffrl.trainers.diffusion_dpo", "flow_grpo": "diffrl.trainers.flow_grpo",
            "diffusion_nft": "diffrl.trainers.diffusion_nft", "prdp": "diffrl.trainers.prdp",
            "awm": "diffrl.trainers.awm", "pxpo": "diffrl.trainers.pxpo",
            "adjoint_matching": "diffrl.trainers.adjoint_matching", "seppo": "diffrl.trainers.seppo"}

CONTRACT = ("TrainConfig", "OPTIM_DEFAULTS", "ADVANTAGE_DEFAULTS", "check", "derived", "train", "epoch_passes")


def get_trainer(name: str):
    """The module implementing trainer `name`: a key of `TRAINERS`, or a module path `my_pkg.my_trainer`.

    Raises:
        `UserError`: unknown name (with the closest known one), a module that is missing or breaks the contract.
    """
    if name in TRAINERS:
        module_path = TRAINERS[name]
    elif "." in name:
        module_path = name
    else:
        close = difflib.get_close_matches(name, list(TRAINERS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"unknown trainer '{name}'{hint} (known: {', '.join(sorted(TRAINERS))})")
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        if e.name and module_path.startswith(e.name):
            raise UserError(f"trainer '{name}': module '{module_path}' not found") from e
        raise
    missing = [attr for attr in CONTRACT if not hasattr(module, attr)]
    if missing:
        raise UserError(f"trainer module '{module_path}' lacks {', '.join(missing)}; a trainer module defines "
                        f"{', '.join(CONTRACT)} (see diffrl.trainers)")
    return module


trainer_lookup.register(TRAINERS, get_trainer)
