"""The engine process's options as `moss-speech serve` flags and MOSS_* settings, passed on to the engine it starts.

They are read from the engine's own definitions (engines/process/options.py), so every option the engine has is
one `serve` has, spelt the same: `--fp8-weights`, `--kv-cache-gib 40`. Each is also a setting named after the
option's destination: MOSS_FP8_WEIGHTS=1, MOSS_KV_CACHE_GIB=40, MOSS_CODEC_THREAD=0 for `--no-codec-thread`. A
setting left unset gives the engine nothing, so the engine's own default holds. The options `serve` sets itself
(model, codec, device, vocoder, endpoint, ready file) are not repeated here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from engines.process.options import add_arguments as add_engine_arguments

ENV_PREFIX = "MOSS_"
SET_BY_SERVE = frozenset({"model", "codec", "device", "vocoder", "endpoint", "ready_file"})
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

Kind = Literal["on", "off", "either", "value"]  # store_true, store_false, BooleanOptionalAction, one value
_KINDS: dict[Any, Kind] = {"store_true": "on", "store_false": "off", argparse.BooleanOptionalAction: "either",
                           None: "value", "store": "value"}


@dataclass(frozen=True, eq=False)
class EngineOption:
    names: tuple[str, ...]  # as the engine declares them
    declared: dict[str, Any]  # add_argument's keywords, as the engine declares them
    action: argparse.Action  # what the engine's parser made of them (dest, type, choices)
    kind: Kind

    @property
    def dest(self) -> str:
        return self.action.dest

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def flag(self) -> str:
        return self.action.option_strings[0]

    @property
    def is_switch(self) -> bool:
        return self.kind != "value"

    def setting(self, value: Any) -> bool | str | None:
        """A flag's or an environment variable's value as the setting holds it: True/False for a switch, the text
        the engine will be given for the rest (checked as the engine checks it, ValueError saying why not)."""
        if value is None or (self.is_switch and isinstance(value, bool)):
            return value
        text = str(value).strip()
        if self.is_switch:
            if text.lower() in TRUE_WORDS:
                return True
            if text.lower() in FALSE_WORDS:
                return False
            raise ValueError(f"expected on ({', '.join(TRUE_WORDS)}) or off ({', '.join(FALSE_WORDS)})")
        try:
            parsed = self.action.type(text) if self.action.type is not None else text
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise ValueError(str(e)) from None
        if self.action.choices is not None and parsed not in self.action.choices:
            raise ValueError(f"expected one of {', '.join(map(str, self.action.choices))}")
        return text

    def argv(self, value: bool | str | None) -> list[str]:
        """The engine's arguments for the setting's value (none when unset or when it is the engine's default)."""
        if value is None:
            return []
        if self.kind == "value":
            return [self.flag, str(value)]
        if self.kind == "either":  # --x / --no-x
            return [self.action.option_strings[0 if value else 1]]
        return [self.flag] if value == (self.kind == "on") else []

    def env_hint(self) -> str:
        """How --help names the setting: with the value that does what the flag does, for a switch."""
        return self.env + {"on": "=1", "off": "=0", "either": "=1|0", "value": ""}[self.kind]


class _Recorder(argparse.ArgumentParser):
    """A parser that keeps what each add_argument call was given beside the action it made."""

    def __init__(self) -> None:
        super().__init__(add_help=False)
        self.calls: list[tuple[tuple[str, ...], dict[str, Any], argparse.Action]] = []

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        action = super().add_argument(*names, **kwargs)
        self.calls.append((tuple(names), dict(kwargs), action))
        return action


def read_options(add: Callable[[argparse.ArgumentParser], None] = add_engine_arguments) -> tuple[EngineOption, ...]:
    """The options `add` defines, less those serve sets itself; TypeError for one no setting can stand for."""
    recorder = _Recorder()
    add(recorder)
    out = []
    for names, declared, action in recorder.calls:
        if action.dest in SET_BY_SERVE:
            continue
        kind = _KINDS.get(declared.get("action"))
        if kind is None or action.nargs not in (None, 0):
            raise TypeError(f"engine option {names[0]}: its kind (action={declared.get('action')!r}, "
                            f"nargs={action.nargs!r}) has no MOSS_* setting form; give it one in {__name__}")
        out.append(EngineOption(names, declared, action, kind))
    return tuple(out)


ENGINE_OPTIONS = read_options()
BY_DEST = {o.dest: o for o in ENGINE_OPTIONS}


def settings_fields() -> dict[str, Any]:
    """The settings' fields for the engine options (pydantic.create_model's keywords): None when unset."""
    return {o.dest: (Annotated[(bool if o.is_switch else str) | None, BeforeValidator(o.setting)], None)
            for o in ENGINE_OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The "engine" group of `moss-speech serve`: each option as the engine declares it, absent unless given."""
    group = parser.add_argument_group("engine", "options of the engine process that serve starts; each is also a "
                                      "MOSS_* setting (on: 1, true, yes; off: 0, false, no); unset: the engine's "
                                      "default")
    for o in ENGINE_OPTIONS:
        help_text = " ".join(filter(None, [o.declared.get("help"), f"[{o.env_hint()}]"]))
        group.add_argument(*o.names, **{**o.declared, "default": argparse.SUPPRESS, "help": help_text})


def engine_argv(settings: Any, options: Sequence[EngineOption] = ENGINE_OPTIONS) -> list[str]:
    """The engine's arguments for the engine settings that are set."""
    return [arg for o in options for arg in o.argv(getattr(settings, o.dest))]
