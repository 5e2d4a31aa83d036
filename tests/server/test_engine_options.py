"""Every engine process option is a `moss-speech serve` flag and a MOSS_* setting, and reaches the engine command."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from pydantic import ValidationError

from engines.process.options import add_arguments as engine_add_arguments
from moss_speech.commands import serve
from server import engine_options
from server.app import engine_client
from server.engine_client import engine_command
from server.settings import Settings
from tests.paths import REPO

ROOT = REPO
ENDPOINT = "ipc:///tmp/moss-test.sock"


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    engine_add_arguments(p)
    return p


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p


def settings_from(argv: list[str]) -> Settings:
    args = serve_parser().parse_args(argv)
    return Settings(**{k: v for k, v in vars(args).items() if v is not None})


def spawned(settings: Settings) -> list[str]:
    """The engine command the server would start (the interpreter and module left out)."""
    return engine_client(settings, ENDPOINT).command[3:]


def test_every_engine_option_is_a_serve_flag_in_the_engine_group_and_a_setting():
    engine = {a.dest: a.option_strings for a in engine_parser()._actions if a.dest != "help"}
    offered = set(engine) - engine_options.SET_BY_SERVE
    (group,) = [g for g in serve_parser()._action_groups if g.title == "engine"]
    assert {a.dest: a.option_strings for a in group._group_actions} == {d: engine[d] for d in offered}
    assert offered <= set(Settings.model_fields)
    assert {o.env for o in engine_options.ENGINE_OPTIONS} >= {"MOSS_FP8_WEIGHTS", "MOSS_KV_CACHE_GIB",
                                                              "MOSS_ENCODER_TF32", "MOSS_MAX_RUNNING"}
    help_text = serve_parser().format_help()
    assert "[MOSS_FP8_WEIGHTS=1]" in help_text and "[MOSS_KV_CACHE_GIB]" in help_text


def test_flags_and_settings_reach_the_engine_as_it_parses_them(monkeypatch):
    monkeypatch.setenv("MOSS_FP8_WEIGHTS", "yes")
    monkeypatch.setenv("MOSS_KV_CACHE_GIB", "40")
    monkeypatch.setenv("MOSS_ENCODER_GRAPHS", "0")  # the engine's --no-encoder-graphs
    monkeypatch.setenv("MOSS_ENCODER_THREAD", "false")  # --no-encoder-thread
    monkeypatch.setenv("MOSS_WARM_UP", "1")
    monkeypatch.setenv("MOSS_MAX_RUNNING", "64")
    monkeypatch.setenv("MOSS_SEED", "")  # empty: unset
    s = settings_from(["--encoder-tf32", "--max-running", "128", "--kv-dtype", "fp8", "--device", "cpu"])
    argv = spawned(s)
    assert argv[:argv.index("--endpoint") + 2] == engine_command(s.model, s.codec, "cpu", ENDPOINT)[3:]
    args = engine_parser().parse_args(argv)
    assert (args.fp8_weights, args.encoder_tf32, args.kv_cache_gib, args.max_running, args.kv_dtype) == (
        True, True, 40.0, 128, "fp8")  # the flag won over MOSS_MAX_RUNNING
    assert (args.encoder_graphs, args.encoder_thread, args.warm_up, args.seed) == (False, False, True, 0)
    assert "--seed" not in argv and "--max-running" in argv and argv.count("--max-running") == 1


def test_unset_engine_settings_give_the_engine_its_own_defaults(monkeypatch):
    """Nothing set, nothing passed: on a GPU the engine then sizes its KV pool itself (--kv-cache-gib auto)."""
    s = settings_from(["--device", "cpu"])
    assert spawned(s) == engine_command(s.model, s.codec, "cpu", ENDPOINT)[3:]
    assert engine_options.engine_argv(Settings(fp8_weights=False, encoder_tf32=False)) == []


def test_a_replacement_engine_command_gets_the_options_after_its_endpoint():
    s = Settings(engine_command=["wrapper", "--x"], fp8_weights=True, encoder_thread=True, kv_cache_gib="auto")
    assert engine_client(s, ENDPOINT).command == ["wrapper", "--x", "--endpoint", ENDPOINT, "--kv-cache-gib",
                                                   "auto", "--fp8-weights", "--encoder-thread"]


@pytest.mark.parametrize(("name", "value", "says"), [
    ("MOSS_FP8_WEIGHTS", "maybe", "MOSS_FP8_WEIGHTS (--fp8-weights): expected on (1, true, yes, on) or off"),
    ("MOSS_ENCODER_GRAPHS", "2", "MOSS_ENCODER_GRAPHS (--encoder-graphs): expected on"),
    ("MOSS_KV_CACHE_GIB", "-1", "MOSS_KV_CACHE_GIB (--kv-cache-gib): must be > 0, got -1"),
    ("MOSS_KV_DTYPE", "fp4", "MOSS_KV_DTYPE (--kv-dtype): expected one of auto, fp8 (got 'fp4')"),
    ("MOSS_MAX_RUNNING", "many", "MOSS_MAX_RUNNING (--max-running): invalid literal for int()"),
])
def test_a_bad_engine_setting_stops_serve_at_start_naming_it(monkeypatch, capsys, name, value, says):
    monkeypatch.setenv(name, value)
    assert serve.run(serve_parser().parse_args([])) == 2
    assert says in capsys.readouterr().err
    with pytest.raises(ValidationError, match=name[len("MOSS_"):].lower()):
        Settings()


def test_an_engine_option_of_a_kind_with_no_setting_form_is_refused():
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--several", nargs="+")

    with pytest.raises(TypeError, match="--several"):
        engine_options.read_options(add)


def test_the_server_defines_the_engine_options_without_importing_torch():
    code = ("import sys, server.settings, moss_speech.commands.serve, engines.process.options; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
