"""Only the package list lives here: recipes/ (and demo/, once it exists) sit at the top of the repository but
ship inside the wheel as ``diffrl.recipes`` and ``diffrl.demo``, which ``packages.find`` cannot express.
Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

packages = find_packages(include=["diffrl", "diffrl.*", "rewards", "rewards.*", "samplers", "samplers.*"])
# the embedded models' folder holds no Python; it is listed so setuptools ships it as package data without warning
packages.append("diffrl.shapes.assets")
# Each recipe folder is listed so setuptools ships its YAML files as package data.
recipe_dirs = sorted(p.name for p in Path(__file__).parent.joinpath("recipes").iterdir() if p.is_dir())
packages += ["diffrl.recipes"] + [f"diffrl.recipes.{d}" for d in recipe_dirs]
package_dir = {"diffrl.recipes": "recipes", **{f"diffrl.recipes.{d}": f"recipes/{d}" for d in recipe_dirs}}
if Path(__file__).parent.joinpath("demo").is_dir():
    packages.append("diffrl.demo")
    package_dir["diffrl.demo"] = "demo"
setup(packages=packages, package_dir=package_dir)
