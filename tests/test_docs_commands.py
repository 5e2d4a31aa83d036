"""The commands the docs and the bench scripts give are real: every `moss-speech` command they name exists and takes
every flag they pass it (README.md, docs/, docs/bench/*.sh, the Makefile, the Dockerfile and docker/), and every
`MOSS_*` variable the docs name is read."""

from __future__ import annotations

import argparse
import importlib
import re

from moss_speech.cli import COMMANDS
from server.settings import Settings
from tests.paths import REPO

# (an image's name before the command: `docker run ... moss-speech moss-speech serve`)
INVOCATION = re.compile(r"(?:moss-speech|moss_speech\.cli)\s+(?!moss-speech)([^`\n]*)")
ENDS = ("&&", "||", "|", ";", ">", "<", "2>", ")", "#")


def texts() -> dict[str, str]:
    """Each file's commands with their wrapped lines joined (a shell line's continuation, a markdown paragraph's
    lines); of markdown, its code blocks and code spans alone (prose says "moss-speech" too)."""
    paths = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "docs" / "bench").glob("*.sh"),
             REPO / "Makefile", REPO / "Dockerfile", *(p for p in (REPO / "docker").rglob("*") if p.is_file())]
    out = {}
    for p in paths:
        t = p.read_text(errors="replace").replace("\\\n", " ")
        if p.suffix == ".md":
            blocks = re.findall(r"^```[^\n]*\n(.*?)^```", t, re.M | re.S)
            prose = re.sub(r"^```.*?^```", "", t, flags=re.M | re.S)
            spans = re.findall(r"`([^`]+)`", re.sub(r"(?<!\n)\n(?!\n)\s*", " ", prose))
            t = "\n".join([*blocks, *spans])
        out[str(p.relative_to(REPO))] = t
    return out


def invocations(text: str) -> list[list[str]]:
    """The words after each `moss-speech` up to the end of its command (none where it is quoted from a message:
    `moss-speech serve: cannot ...`)."""
    out = []
    for m in INVOCATION.finditer(text):
        if re.match(r"[a-z-]+(?: [a-z-]+)?: ", m.group(1)):
            continue
        words = []
        for w in m.group(1).split():
            if w.startswith(ENDS):
                break
            words.append(w)
        out.append(words)
    return out


def options_of(module: str, cache: dict[str, set[str]]) -> set[str]:
    if module not in cache:
        parser = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(parser)
        cache[module] = {s for a in parser._actions for s in a.option_strings}
    return cache[module]


def check(words: list[str], cache: dict[str, set[str]]) -> str | None:
    """What is wrong with one invocation, or None."""
    head = [w for w in words[:2] if re.fullmatch(r"[a-z][a-z-]*", w)]
    for path, module, _ in COMMANDS:
        if tuple(words[:len(path)]) == path:
            opts = options_of(module, cache)
            flags = {w.split("=")[0].rstrip(",.:`'\"") for w in words[len(path):] if w.startswith("--")}
            unknown = sorted(f for f in flags - opts if f != "--help" and re.fullmatch(r"--[a-z][a-z0-9-]*", f))
            return f"moss-speech {' '.join(path)} has no {', '.join(unknown)}" if unknown else None
    # a group named as such ("the `moss-speech bench` commands", "bench engine|codec") or prose ("moss-speech is")
    if not head or any(p[:len(head)] == tuple(head) for p, _, _ in COMMANDS) or "|" in " ".join(words[:2]):
        return None
    return f"moss-speech has no command {' '.join(head)}"


def test_every_command_and_flag_the_docs_give_exists():
    cache: dict[str, set[str]] = {}
    found = [(name, words) for name, text in texts().items() for words in invocations(text)]
    assert len(found) > 50, "the docs' commands were not found where this test looks"  # ~110
    wrong = [f"{name}: {why}" for name, words in found if (why := check(words, cache))]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_flag_and_a_wrong_command():
    cache: dict[str, set[str]] = {}
    assert check(["serve", "--port", "8000"], cache) is None
    assert check(["serve", "--no-such-flag"], cache) == "moss-speech serve has no --no-such-flag"
    assert check(["bench", "capacity", "--start=8", "--max", "16"], cache) is None
    assert check(["bench", "nothing"], cache) == "moss-speech has no command bench nothing"
    assert invocations("run `moss-speech loadtest --sessions 4 | tee x` now") == [["loadtest", "--sessions", "4"]]
    assert invocations("docker run -it moss-speech moss-speech serve --port 9 && moss-speech serve: cannot") == [
        ["serve", "--port", "9"]]


def test_every_moss_variable_the_docs_name_is_read():
    """A `MOSS_*` variable in the docs is a server setting (server/settings.py: MOSS_ + a field's name) or one the
    code, the scripts or the image read."""
    code = [p for d in ("engines", "server", "moss_speech", "docker", "docs/bench") for p in (REPO / d).rglob("*")
            if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".yml", ".conf", "")]
    code += [REPO / "Makefile", REPO / "Dockerfile"]
    read = {"MOSS_" + name.upper() for name in Settings.model_fields}
    read |= {v for p in code for v in re.findall(r"MOSS_[A-Z0-9_]+", p.read_text(errors="replace"))}
    named = {(str(p.relative_to(REPO)), v) for p in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
             for v in re.findall(r"MOSS_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    assert len(named) > 30  # the docs name ~100
    assert not sorted(f"{name}: {v}" for name, v in named if v not in read)
