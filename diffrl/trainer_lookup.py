"""Where `diffrl.config` finds the trainer a recipe names: a slot the trainers package fills from above.

Config sits below the trainers in the layers, so it does not import them; `diffrl.trainers` hands its table
(`TRAINERS`, name -> module path) and its lookup (`get_trainer`, which imports the module and checks the trainer
contract) to `register` when it is imported, and `import diffrl`, which runs before any `diffrl.*` module, imports
it. This module imports nothing, so `import diffrl` and `diffrl --help` load no YAML or config machinery for it.
"""

from collections.abc import Callable, Mapping
from types import ModuleType

_table: Mapping[str, str] = {}
_lookup: Callable[[str], ModuleType] | None = None


def register(table: Mapping[str, str], lookup: Callable[[str], ModuleType]) -> None:
    """Hand down the trainer table (read when asked, so entries added later count) and the lookup."""
    global _table, _lookup
    _table, _lookup = table, lookup


def names() -> dict[str, str]:
    """Trainer name -> module path, as registered."""
    return dict(_table)


def find(name: str) -> ModuleType:
    """The module of trainer `name` (a registered name or a module path), from the registered lookup."""
    if _lookup is None:  # only if diffrl/__init__.py stopped importing diffrl.trainers
        raise RuntimeError("no trainers registered; import diffrl.trainers first")
    return _lookup(name)
