"""docs/architecture.md is the map of the code: its table names every module of the packages, every file of the
page and every script of docs/bench, each in the row of its folder (or of the nearest folder above it that has one)."""

from __future__ import annotations

import re

from tests.paths import REPO

PACKAGES = ("engines", "server", "moss_speech", "client_web")


def rows() -> dict[str, str]:
    """The table's rows by their first cell (a folder `a/b/` or a file `a/b.py`)."""
    out = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \|(.*)\|\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def mapped_files() -> list[str]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*") if p.suffix in (".py", ".js", ".html", ".css")
             and p.name != "__init__.py" and "__pycache__" not in p.parts]
    files += [p for p in (REPO / "docs" / "bench").iterdir() if p.suffix in (".py", ".sh")]
    return sorted(str(p.relative_to(REPO)) for p in files)


def row_of(path: str, table: dict[str, str]) -> tuple[str, str] | None:
    if path in table:
        return path, ""
    parts = path.split("/")[:-1]
    while parts:
        folder = "/".join(parts) + "/"
        if folder in table:
            return folder, table[folder]
        parts.pop()
    return None


def test_every_module_page_file_and_bench_script_is_named_in_its_folders_row():
    table = rows()
    assert "engines/lm/" in table and "docs/bench/" in table, "the map's table is not where this test reads it"
    missing = []
    for path in mapped_files():
        found = row_of(path, table)
        name = path.rsplit("/", 1)[1]
        if found is None or (found[1] and f"`{name}`" not in found[1]):
            missing.append(f"{path} (row {found[0] if found else 'none'})")
    assert not missing, "docs/architecture.md does not name: " + ", ".join(missing)
