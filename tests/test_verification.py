"""The verification levels of `diffrl/verification.py` against the files they name, and docs/parity.md against them.

Checked: every ✓ parity claim names a parity test that exists and whose module docstring names the same reference
repository and commit(s); every direction test named exists; every shipped recipe has an entry, and a gold entry
exactly when it runs on an embedded ShapesWorld model; every bench row named is a row of docs/benchmarks.md's
`bench learn` table with that gain and standard error; docs/parity.md's generated tables equal the rendered ones.

`python tests/test_verification.py --write` rewrites docs/parity.md's generated tables from the module (after
flipping a trainer's parity, say).
"""

import ast
import re
import sys
from pathlib import Path

import pytest
import yaml

from diffrl import verification
from diffrl.embedded import EMBEDDED_MODELS
from diffrl.shipped_recipes import list_recipes

REPO = Path(__file__).resolve().parents[1]
PARITY_DOC = REPO / "docs" / "parity.md"
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.DOTALL)


def rendered(name: str) -> str:
    if name == "levels_table":
        return verification.levels_table(list(list_recipes()))
    return getattr(verification, name)()


@pytest.mark.parametrize("trainer", sorted(t for t, p in verification.PARITY.items() if p.verified))
def test_a_parity_claim_names_a_test_of_the_same_reference_and_commit(trainer):
    claim = verification.PARITY[trainer]
    test = REPO / "tests" / "trainers" / f"test_{trainer}_parity.py"
    assert test.is_file(), f"{trainer}: parity ✓ but {test.relative_to(REPO)} does not exist"
    doc = ast.get_docstring(ast.parse(test.read_text())) or ""
    if claim.repo is None:  # no public code: checked against the paper's algorithms worked out by hand
        assert claim.commit == "closed forms" and "no official code" in doc, test.name
        return
    assert claim.repo in doc, f"{test.name}'s docstring does not name {claim.repo}"
    for commit in claim.commit.split(", "):
        assert re.search(rf"\b{re.escape(commit)}", doc), f"{test.name}'s docstring does not name commit {commit}"


@pytest.mark.parametrize("test", sorted({*verification.DIRECTION.values(), *verification.STEER_DIRECTION.values()}))
def test_every_direction_test_exists(test):
    path, _, function = test.partition("::")
    function, _, param = function.partition("[")
    assert f"def {function}(" in (REPO / path).read_text(), test
    if path.endswith("test_contract.py"):  # parametrised over the registered trainers
        from diffrl.trainers import TRAINERS

        assert param.rstrip("]") in TRAINERS, test


def _pipeline(path: Path) -> str:
    recipe = yaml.safe_load(path.read_text())
    return recipe["pipeline"] if "pipeline" in recipe else recipe["model"]["pipeline"]


@pytest.mark.parametrize("name, path", list(list_recipes().items()))
def test_every_shipped_recipe_has_an_entry(name, path):
    levels = verification.recipe_levels(name)
    assert all(level.mark != verification.UNKNOWN for level in levels.values()), (name, levels)
    embedded = _pipeline(path) in EMBEDDED_MODELS
    assert (name in verification.GOLD) == embedded, (
        f"{name}: a recipe on an embedded model needs a GOLD entry (None for no bench row), one on a real model none")


def test_every_entry_is_a_shipped_recipe():
    recipes = set(list_recipes())
    assert set(verification.GOLD) <= recipes and set(verification.REAL_WEIGHTS) <= recipes
    assert set(verification.PARITY) == set(verification.DIRECTION) == {n.partition("/")[0] for n in recipes} - {
        "steer"}


def test_every_bench_row_is_in_the_benchmarks_table():
    rows = {}
    table = (REPO / "docs" / "benchmarks.md").read_text().split("## Which trainer", 1)[1].split("\n#", 1)[0]
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| row"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[3]  # row label -> "gain ± se"
    for recipe, row in verification.GOLD.items():
        if row is None:
            continue
        label = next((label for label in rows if label.startswith(f"{row.row} (`{recipe}`")), None)
        assert label, f"{recipe}: no row '{row.row} (`{recipe}`...' in docs/benchmarks.md"
        gain = f"{row.gain:+.3f} ± {row.se:.3f}".replace("-", "−")
        assert gain in rows[label], (recipe, gain, rows[label])


def test_the_two_standard_error_rule():
    assert verification.BenchRow("x", 0.066, 0.033).raised and not verification.BenchRow("x", 0.065, 0.033).raised
    assert verification.recipe_levels("draft/tiny_shapes_pickscore")["gold"].mark == verification.YES
    assert verification.recipe_levels("ddpo/sd15_aesthetic")["gold"].mark == verification.NOT_APPLICABLE


def test_docs_parity_tables_equal_the_rendered_ones():
    blocks = {name: body for _, name, body, _ in BLOCK.findall(PARITY_DOC.read_text())}
    assert set(blocks) == {"parity_table", "direction_table", "levels_table"}
    for name, body in blocks.items():
        assert body == rendered(name), f"docs/parity.md's {name} is stale: python tests/test_verification.py --write"


def write() -> None:
    """Rewrite docs/parity.md's generated tables from `diffrl.verification`."""
    text = BLOCK.sub(lambda m: m[1] + rendered(m[2]) + m[4], PARITY_DOC.read_text())
    PARITY_DOC.write_text(text)
    print(f"wrote {PARITY_DOC}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_verification.py --write")
    write()
