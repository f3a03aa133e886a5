"""Find shipped recipes by short name.

Recipes live in `recipes/<trainer>/<model>_<reward>[_<variant>].yaml`. In a source checkout that folder sits at
the top of the repository; an installed wheel ships it as package data in `diffrl/recipes/` (this module is not
called `diffrl.recipes`, so it cannot shadow that folder). A recipe's short
name is its path under that folder without `.yaml`: `ddpo/tiny_shapes_verifier`.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from diffrl.errors import UserError


def recipe_roots() -> list[Path]:
    """Folders that hold shipped recipes: the checkout's `recipes/` (a source checkout or an editable install) and/or
    the installed copy beside this module (`diffrl/recipes/` in a wheel, which setup.py maps from `recipes/`)."""
    here = Path(__file__).resolve().parent
    checkout = here.parent
    roots = []
    if (checkout / "pyproject.toml").is_file() and (checkout / "recipes").is_dir():
        roots.append(checkout / "recipes")
    if (here / "recipes").is_dir():
        roots.append(here / "recipes")
    return roots


def list_recipes() -> dict[str, Path]:
    """Short name -> path of every shipped recipe, sorted by name (first root wins on a clash)."""
    found: dict[str, Path] = {}
    for root in recipe_roots():
        for path in sorted(root.rglob("*.yaml")):
            name = path.relative_to(root).with_suffix("").as_posix()
            found.setdefault(name, path)
    return dict(sorted(found.items()))


def find_recipe(path_or_name: str | os.PathLike) -> Path:
    """A recipe file: `path_or_name` itself if it is a file, else the shipped recipe of that short name.

    Raises:
        `UserError`: neither a file nor a shipped recipe; names the closest shipped recipe.
    """
    path = Path(path_or_name)
    if path.is_file():
        return path
    if path.is_dir():
        raise UserError(f"{path} is a folder; a recipe is a YAML file (`diffrl ls recipes` lists the shipped ones)")
    if path.suffix in (".yaml", ".yml") and (path.is_absolute() or str(path_or_name).startswith(".")):
        raise UserError(f"recipe file {path} does not exist")
    recipes = list_recipes()
    name = str(path_or_name).removesuffix(".yaml").removesuffix(".yml")
    if name in recipes:
        return recipes[name]
    close = difflib.get_close_matches(name, list(recipes), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; `diffrl ls recipes` lists the shipped recipes"
    raise UserError(f"no recipe file or shipped recipe named '{path_or_name}'{hint}")
