"""docs/training.md's preset tables are the presets: a drift between them fails here.

Each ``### METHOD`` table under "Presets" has the header ``| option | PRESET... | source |``.
For every method and preset the test resolves ``fastcl train METHOD --preset PRESET``
(no data or model is touched) and checks that every listed option has the listed value,
that every option the preset itself sets is listed, that every source cell is filled,
and that the methods and presets are exactly those registered.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from fastcl.cli.train import parse
from fastcl.trainers.registry import RECIPES, get_recipe

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
MARKER = "<!-- preset tables:"


def parse_value(cell: str):
    """A table cell as the resolved option: unset (None) / true / false / int / float / str."""
    text = cell.strip().strip("`")
    low = text.lower()
    if low == "unset":
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_tables(markdown: str) -> dict[str, dict]:
    """``{method: {"presets": [...], "rows": {option: ([values], source)}}}``."""
    if MARKER not in markdown:
        raise AssertionError(f"{DOC} lost its preset-table marker {MARKER!r}")
    body = markdown[markdown.index(MARKER) :]
    body = body[: body.index("\n## ")] if "\n## " in body else body
    tables: dict[str, dict] = {}
    method = None
    for line in body.splitlines():
        heading = re.match(r"^###\s+(\S+)\s*$", line)
        if heading:
            method = heading.group(1)
            continue
        if method is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "option":
            assert cells[-1] == "source", f"{method}: the last column must be 'source', got {cells}"
            assert method not in tables, f"two tables for {method}"
            tables[method] = {"presets": cells[1:-1], "rows": {}}
        elif set(cells[0]) <= set("-: "):
            continue
        else:
            table = tables[method]
            assert len(cells) == len(table["presets"]) + 2, f"{method}: malformed row {line!r}"
            assert cells[0] not in table["rows"], f"{method}: option {cells[0]} listed twice"
            table["rows"][cells[0]] = ([parse_value(c) for c in cells[1:-1]], cells[-1])
    return tables


TABLES = parse_tables(DOC.read_text())


def test_every_method_and_preset_has_a_table():
    assert set(TABLES) == set(RECIPES)
    for method, table in TABLES.items():
        assert set(table["presets"]) == set(get_recipe(method).presets), method


def _same(actual, expected) -> bool:
    if isinstance(expected, bool) or expected is None or isinstance(actual, bool):
        return actual is expected
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        return math.isclose(actual, expected, rel_tol=1e-12, abs_tol=0.0)
    return str(actual) == str(expected)


@pytest.mark.parametrize("method, preset", [(m, p) for m in sorted(RECIPES) for p in sorted(get_recipe(m).presets)])
def test_preset_matches_the_documented_table(method, preset):
    table = TABLES[method]
    column = table["presets"].index(preset)
    _, cfg = parse([method, "--preset", preset])
    drift = {}
    for option, (values, source) in table["rows"].items():
        assert source, f"{method}/{option}: empty source"
        assert hasattr(cfg, option), f"{method}: the table lists {option!r}, which is no option"
        if not _same(getattr(cfg, option), values[column]):
            drift[option] = (values[column], getattr(cfg, option))
    assert not drift, f"{method} --preset {preset}: (documented, actual) {drift}"
    unlisted = set(get_recipe(method).presets[preset]) - set(table["rows"])
    assert not unlisted, f"{method} --preset {preset} sets {sorted(unlisted)}, not in docs/training.md"


def test_the_parser_catches_a_drift():
    doc = DOC.read_text().replace("| lr | 3e-5 | 1e-5 |", "| lr | 3e-4 | 1e-5 |", 1)
    assert parse_tables(doc)["simcse-unsup"]["rows"]["lr"][0] == [3e-4, 1e-5]
    assert (
        parse_value("`1,1,1,6,15,20`") == "1,1,1,6,15,20"
        and parse_value("unset") is None
        and parse_value("none") == "none"
    )
    assert parse_value("0.25") == 0.25 and parse_value("false") is False and parse_value("512") == 512
