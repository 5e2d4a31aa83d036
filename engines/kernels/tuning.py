"""The GEMM tuners' choices kept in a file, so that every start of the engine runs the same kernels.

Each engine process times its GEMM tilings when it starts (skinny_gemm.tune, fp8_gemm.tune): one timing per
candidate, each kernel alone. Candidates within a few percent of each other come out in a different order from one
start to the next, and the decode step moves with the picks: on an H100 with fp8 weights, four starts of the same code
measured 3.86-4.12 ms at batch 1 (2026-11-27). That is as large as many of the changes an A/B capacity run is asked to
judge, and an operator cannot tell which start got the good set.

With MOSS_TUNING_FILE=PATH in the engine process's environment, a start takes the choices stored in PATH for its GPU
model, tunes only the shapes the file lacks, and adds those to it. A choice the tuner no longer offers (a candidate
list changed) is tuned again. Delete the file, or its GPU's section, to tune afresh. The file is JSON:
{"version": 1, "gpus": {GPU name: {"KIND N K ...": tiling or null}}}, written whole on each change (a temporary file,
then a rename), so a reader never sees half of one. Two engines adding to one file at the same moment may each drop
the other's additions; the next start tunes those again.

The package ships picks of its own (SHIPPED, tunings.json beside this file) for the GPU models they were measured on:
without MOSS_TUNING_FILE a start takes them for the shapes they hold and tunes the rest. An operator's file is a set of
its own (seed it with a copy of tunings.json to start from the shipped picks); docs/bench/gpu_tuning_pick.sh makes one
from the fastest of several starts. MOSS_TUNING_FILE=none tunes every shape at every start. The H100 80GB HBM3
section is the fastest of four starts with fp8 weights (3.99 ms a decode step at batch 1, where starts spread
3.86-4.12 ms); capacity at 136 sessions with it against tuning at start, ABBA on one H100: p95 188 / 180 against
204 (one underrun) / 180 ms (2026-11-27). The NVIDIA H200 section is the fastest of four starts (fp8 weights; decode
steps summed over batches 1, 8 and 16: 11.90-11.94 ms, 2026-11-29, so on the H200 the picks matter little to speed;
shipping them spares each start the tuning and keeps every start on one set).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Hashable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("engines.kernels")

ENV = "MOSS_TUNING_FILE"
OFF = "none"  # MOSS_TUNING_FILE=none: tune every shape at every start (the shipped picks too)
SHIPPED = Path(__file__).with_name("tunings.json")
VERSION = 1
_lock = threading.Lock()
_MISSING = object()  # no usable stored choice (None is one: the tuner's "use cuBLAS")


def device_name(device: torch.device) -> str:
    """The section of the file a device reads and writes: its GPU model ("cpu" off CUDA)."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


def _key(kind: str, key: tuple) -> str:
    return " ".join([kind, *(str(k) for k in key)])


def _read(path: Path, label: str | None = None) -> dict:
    """The file's content, or an empty one where there is no file yet. Anything else that is not a tuning file is
    refused with the path in the message (`label`, default "MOSS_TUNING_FILE=path": the operator named it)."""
    label = label or f"{ENV}={path}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {"version": VERSION, "gpus": {}}
    except OSError as e:
        raise ValueError(f"{label}: cannot read it ({e})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{label}: not a tuning file (not JSON: {e})") from e
    if not (isinstance(data, dict) and data.get("version") == VERSION and isinstance(data.get("gpus"), dict)
            and all(isinstance(v, dict) for v in data["gpus"].values())):
        raise ValueError(f'{label}: not a tuning file of version {VERSION} ({{"version": {VERSION}, '
                         '"gpus": {GPU name: {key: tiling}}} expected)')
    return data


@lru_cache(maxsize=4)
def _shipped(path: Path) -> dict:
    """The package's own picks (read once: they do not change while the process runs)."""
    return _read(path, f"shipped tuning file {path}")["gpus"]


def decoded(stored: Any) -> Any:
    """A tiling as a file stores it (JSON lists) as the tuners name it (tuples); None (cuBLAS) as is."""
    return tuple(stored) if isinstance(stored, list) else stored


def _stored(section: dict, name: str, valid: Callable[[Any], bool], where: str) -> Any:
    """The `valid` choice stored under `name` in a GPU's section, or _MISSING."""
    if name not in section:
        return _MISSING
    stored = section[name]
    value = decoded(stored)
    if valid(value):
        return value
    log.warning("%s: %r for %s is not a tiling the tuner offers now; not taken", where, stored, name)
    return _MISSING


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{ENV}={path}: cannot write it ({e})") from e


def choose(kind: str, key: tuple, device: torch.device, tune: Callable[[], Hashable | None],
           valid: Callable[[Any], bool]) -> Any:
    """The tiling for one GEMM shape. With MOSS_TUNING_FILE=PATH: PATH's when it holds a `valid` one for this GPU
    model, else `tune()`'s, which is then added to PATH. Without the variable: the shipped one (SHIPPED) when valid,
    else `tune()`'s. MOSS_TUNING_FILE=none: `tune()`. Tilings are tuples (stored as lists) or None (the tuner's "use
    cuBLAS")."""
    env = os.environ.get(ENV, "")
    if env == OFF:
        return tune()
    gpu, name = device_name(device), _key(kind, key)
    if not env:
        shipped = _stored(_shipped(SHIPPED).get(gpu, {}), name, valid, f"{SHIPPED} ({gpu})")
        return tune() if shipped is _MISSING else shipped
    path = Path(env)
    with _lock:  # the tuners run on the engine's loading thread; the lock only keeps threads' writes whole
        section = _read(path)["gpus"].get(gpu, {})
    value = _stored(section, name, valid, f"{path} ({gpu})")
    if value is not _MISSING:
        return value
    value = tune()
    with _lock:
        data = _read(path)  # again: another engine may have added its own meanwhile
        data["gpus"].setdefault(gpu, {})[name] = list(value) if isinstance(value, tuple) else value
        _write(path, data)
    return value
