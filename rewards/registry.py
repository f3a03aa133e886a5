"""The reward registry: names to factories, plus `"package.module:factory"` for rewards defined elsewhere.

A factory is a function that builds a reward; its registry key equals its function name
(`@register_reward("aesthetic") def aesthetic(...)`). Built-in reward modules are imported on first use of
`get_reward` / `list_rewards`, so `import rewards` stays cheap and heavy libraries load only inside factories.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from collections.abc import Callable

from diffrl.checks import check_number
from diffrl.config import convert_value
from diffrl.errors import UserError
from rewards.base import check_scores

# Modules whose import registers the built-in rewards. `rewards.shapes_verifier` is the ShapesWorld verifier
# (owned by the ShapesWorld code); it is skipped while it does not exist.
BUILTIN_MODULES = (
    "rewards.jpeg",
    "rewards.aesthetic",
    "rewards.clip_score",
    "rewards.pickscore",
    "rewards.hps",
    "rewards.imagereward",
    "rewards.combine",
    "rewards.shapes_verifier",
    "rewards.video",
    "rewards.instructvideo",
)

_FACTORIES: dict[str, Callable] = {}
_DIFFERENTIABLE: dict[str, bool | Callable] = {}  # name -> what its factory declares (see `declared_differentiable`)
_RANGES: dict[str, dict[str, dict]] = {}  # name -> {option: `check_number` bounds} its factory declares
_builtins_loaded = False


def register_reward(name: str, *, differentiable: bool | Callable[[dict], bool] | None = None,
                    ranges: dict[str, dict] | None = None):
    """Register a reward factory under `name`, which must equal the factory's function name.

    Args:
        name (`str`): the registry key, e.g. `"aesthetic"`.
        differentiable (`bool` or `Callable`, *optional*): whether the rewards it builds give gradients, or a function
            of the factory's keyword arguments saying so, so a recipe can be checked before any model loads
            (`declared_differentiable`). Left out: unknown until the reward is built.
        ranges (`dict`, *optional*): the allowed range of numeric options, `{option: {"low": ..., "high": ...}}`
            (`diffrl.checks.check_number` bounds), checked with the options before the reward is built.

    Example:

    ```python
    @register_reward("brightness")
    def brightness(scale: float = 1.0):
        return BrightnessReward(scale)
    ```
    """

    def decorator(factory: Callable) -> Callable:
        if getattr(factory, "__name__", None) != name:
            raise UserError(
                f"reward factory {getattr(factory, '__name__', factory)!r} registered as '{name}'; "
                "a reward's registry key must equal its factory name"
            )
        existing = _FACTORIES.get(name)
        if (
            existing is not None
            and existing is not factory
            and (
                existing.__module__,
                existing.__qualname__,
            )
            != (factory.__module__, factory.__qualname__)
        ):
            raise UserError(f"reward '{name}' is already registered by {existing.__module__}; pick another name")
        _FACTORIES[name] = factory
        if differentiable is not None:
            _DIFFERENTIABLE[name] = differentiable
        if ranges:
            _RANGES[name] = ranges
        return factory

    return decorator


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    for module in BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # a missing dependency inside an existing module is a real error
                raise
    _builtins_loaded = True


def list_rewards() -> list[str]:
    """Names of all registered rewards, sorted."""
    _load_builtins()
    return sorted(_FACTORIES)


def get_reward_factory(name: str) -> Callable:
    """The factory behind a registry name or a `"package.module:factory"` path (no reward is built)."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise UserError(f"cannot import module '{module_name}' for reward '{name}': {err}") from err
        factory = getattr(module, attr, None)
        if factory is None or not callable(factory):
            raise UserError(f"module '{module_name}' has no callable '{attr}' to build reward '{name}'")
        return factory
    _load_builtins()
    if name not in _FACTORIES:
        known = sorted(_FACTORIES)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise UserError(
            f"unknown reward '{name}'; {hint}known rewards: {', '.join(known)} "
            "(or give 'package.module:factory' for your own)"
        )
    return _FACTORIES[name]


def get_reward(name: str, **kwargs):
    """Build a reward by registry name or `"package.module:factory"`.

    Args:
        name (`str`):
            A registered name (see `list_rewards()`), or `"package.module:factory"` for a factory defined in
            any importable module.
        **kwargs:
            Options of that reward's factory (e.g. `model=`, `device=`, `dtype=`).

    Returns:
        A reward: `reward(images, prompts, metadata) -> RewardOutput`.

    Raises:
        `UserError`: unknown name (with a did-you-mean), unknown option, or weights that cannot be found.
    """
    factory = get_reward_factory(name)
    _check_options(name, factory, kwargs)
    reward = factory(**kwargs)
    return CheckedReward(reward, name) if ":" in name else reward


class CheckedReward:
    """A user's reward (`"package.module:factory"`), its every call's output checked (`check_scores`: one score per
    image) so a wrong count or shape is one line naming it wherever the reward is called (training, evaluation,
    `sample`, `score`, steering). Every other attribute is the reward's own."""

    def __init__(self, reward, name: str):
        self.reward, self.spec = reward, name

    def __getattr__(self, attribute):
        if attribute in ("reward", "spec"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(attribute)
        return getattr(self.reward, attribute)

    def __call__(self, images, prompts, metadata=None, **kwargs):
        output = self.reward(images, prompts, metadata, **kwargs)
        check_scores(self.spec, output, images.shape[0])
        return output


def check_reward_options(name: str, kwargs: dict) -> None:
    """Check, without building anything, that `name` is a reward and `kwargs` are options of its factory."""
    _check_options(name, get_reward_factory(name), kwargs)


def _check_options(name: str, factory: Callable, kwargs: dict) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins or C callables: let the call itself complain
        return
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    options = [p for p, v in params.items() if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD)]
    for key in kwargs:
        if key not in options:
            close = difflib.get_close_matches(key, options, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UserError(
                f"reward '{name}' has no option '{key}'; {hint}its options: {', '.join(options) or '(none)'}"
            )
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        raise UserError(f"reward '{name}': {err}") from err
    try:
        hints = typing.get_type_hints(factory)
    except (NameError, TypeError, AttributeError, SyntaxError):  # an annotation that does not resolve (a user's
        # factory): its call checks the types
        hints = {}
    where = f"the options of reward '{name}'"
    for key, value in kwargs.items():
        if key in hints:  # typed as recipe values are: model=12 is refused here, not as a TypeError in the run
            convert_value(hints[key], value, key, where)
        if key in _RANGES.get(name, {}):
            try:
                check_number(key, value, **_RANGES[name][key])
            except UserError as err:
                raise UserError(f"{err} (in {where})") from None


def torch_preprocess(kwargs: dict) -> bool:
    """The CLIP-family rewards are differentiable with `preprocess="torch"` (their default), not with "processor"."""
    return kwargs.get("preprocess", "torch") == "torch"


def declared_differentiable(name: str, kwargs: dict | None = None) -> bool | None:
    """Whether reward `name` built with `kwargs` gives gradients, as its factory declares, without building it.

    Returns `None` when the factory declares nothing (a user's `module:factory`): the built reward's
    `differentiable` attribute then decides.
    """
    get_reward_factory(name)  # loads the built-ins, fails on an unknown name
    declared = _DIFFERENTIABLE.get(name)
    return declared(dict(kwargs or {})) if callable(declared) else declared


def differentiable_rewards() -> list[str]:
    """Registered rewards that give gradients with their default options (for error messages)."""
    _load_builtins()
    return sorted(n for n in _FACTORIES if declared_differentiable(n) is True)
