"""engines/protocol/errors.py is the one table of error codes: every code the server and the engine send is spelled
with its constants and is in the table, every entry is sent somewhere, docs/api.md lists each one, and the table
imports neither torch nor the server."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engines.protocol import errors
from tests.paths import REPO

SOURCES = sorted(p for d in ("server", "engines") for p in (REPO / d).rglob("*.py")
                 if p != REPO / "engines" / "protocol" / "errors.py")
# Calls that carry an error code: the callee's name -> the code's position (or a `code=` keyword).
CODE_ARG = {"ProtocolError": 0, "error_event": 0, "ServiceError": 0, "_error": 0, "Error": 1, "fail": 1}
SESSION_NAMES = {"self", "s", "session"}  # `<session>.error(code, message)` (not `log.error`)
CODES = {name: value for name, value in vars(errors).items() if name.isupper() and isinstance(value, str)
         and value in errors.ERRORS}


def _code_sites(tree: ast.AST) -> list[ast.expr]:
    """The expressions a module passes as an error code."""
    sites: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            sites += [st.value for st in node.body if isinstance(st, ast.Assign) and st.value is not None
                      and [getattr(t, "id", None) for t in st.targets] == ["code"]]
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name == "error" and isinstance(f, ast.Attribute) and getattr(f.value, "id", None) in SESSION_NAMES:
            pos = 0
        elif name in CODE_ARG:
            pos = CODE_ARG[name]
        else:
            continue
        keyword = [k.value for k in node.keywords if k.arg == "code"]
        if keyword:
            sites.append(keyword[0])
        elif len(node.args) > pos:
            sites.append(node.args[pos])
    return sites


def _errors_refs(tree: ast.AST) -> list[ast.Attribute]:
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "errors"]


@pytest.fixture(scope="module")
def trees() -> dict[Path, ast.AST]:
    return {p: ast.parse(p.read_text(), str(p)) for p in SOURCES}


def test_every_code_sent_is_a_constant_of_the_table(trees):
    literal, unknown, constants = [], [], 0
    for path, tree in trees.items():
        where = path.relative_to(REPO)
        for expr in _code_sites(tree):
            if isinstance(expr, ast.Constant):
                literal.append(f"{where}:{expr.lineno} {expr.value!r}")
            elif isinstance(expr, ast.Attribute) and getattr(expr.value, "id", None) == "errors":
                constants += 1
                if expr.attr not in CODES:
                    unknown.append(f"{where}:{expr.lineno} errors.{expr.attr}")
            # anything else passes a code on (e.code, msg.code): checked where it was made
    assert not literal, f"error codes spelled as strings (use engines.protocol.errors): {literal}"
    assert not unknown, f"not codes of the table: {unknown}"
    assert constants >= 60, constants  # the scan sees the call sites


def test_every_reference_resolves_and_every_entry_is_used(trees):
    used: set[str] = set()
    for path, tree in trees.items():
        for ref in _errors_refs(tree):
            assert hasattr(errors, ref.attr), f"{path.relative_to(REPO)}:{ref.lineno} errors.{ref.attr}"
            if ref.attr in CODES:
                used.add(CODES[ref.attr])
    assert set(CODES.values()) == set(errors.ERRORS), "every code of the table has its constant"
    assert used == set(errors.ERRORS), f"codes nobody sends: {sorted(set(errors.ERRORS) - used)}"


def test_the_table_is_consistent():
    for code, e in errors.ERRORS.items():
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", code), code
        assert e.meaning and e.type in ("invalid_request_error", "server_error", "authentication_error"), code
        assert e.close in (None, 1001, 1008, 1011), code
        assert e.http is None or 400 <= e.http < 600, code
    assert errors.error_type("no_such_code") == "server_error"
    assert errors.close_code(errors.SLOW_CONSUMER) == 1008
    with pytest.raises(ValueError, match="invalid_value"):
        errors.close_code(errors.INVALID_VALUE)
    assert errors.http_status(errors.INVALID_VALUE) == 400  # a client mistake refused over HTTP
    with pytest.raises(ValueError, match="engine_error"):
        errors.http_status(errors.ENGINE_ERROR)


def _doc_tables() -> tuple[dict[str, int], set[str]]:
    """docs/api.md: the HTTP errors table's codes with their status, and the codes in the first column of the
    Errors section's code tables."""
    text = (REPO / "docs" / "api.md").read_text()
    part = text[text.index("HTTP errors are JSON"):text.index("Connection-level outcomes")]
    http: dict[str, int] = {}
    events: set[str] = set()
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2:
            continue
        if re.fullmatch(r"\d{3}", cells[0]):
            http.update({c: int(cells[0]) for c in re.findall(r"`([a-z_]+)`", cells[1])})
        else:
            events |= set(re.findall(r"`([a-z_]+)`", cells[0]))
    return http, events


def test_docs_list_every_code_with_its_http_status():
    http, events = _doc_tables()
    assert set(errors.ERRORS) == set(http) | events, (
        f"missing in docs/api.md: {sorted(set(errors.ERRORS) - set(http) - events)}; "
        f"not codes: {sorted((set(http) | events) - set(errors.ERRORS))}")
    assert {c: errors.ERRORS[c].http for c in http} == http


def test_the_table_imports_neither_torch_nor_the_server():
    code = ("import sys, engines.protocol.errors, engines.protocol.messages; "
            "sys.exit(any(m == 'torch' or m.split('.')[0] == 'server' for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
