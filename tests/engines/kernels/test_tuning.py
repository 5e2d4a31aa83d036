"""MOSS_TUNING_FILE: the GEMM tuners' choices kept across engine starts (engines/kernels/tuning.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engines.kernels import tuning as tuning_file

CPU = torch.device("cpu")
OFFERED = {(16, 256, 4, 4, 1), (32, 256, 4, 3, 2), (64, 64, 128, 4, 3, True, 1), None}


class Tuner:
    """A tuner that counts its calls and returns the given tilings in turn."""

    def __init__(self, *choices):
        self.choices, self.calls = list(choices), 0

    def __call__(self):
        self.calls += 1
        return self.choices.pop(0)


def choose(key, tuner, kind="skinny"):
    return tuning_file.choose(kind, key, CPU, tune=tuner, valid=lambda c: c in OFFERED)


@pytest.fixture
def tfile(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning_file.ENV, str(path))
    return path


def test_without_the_variable_every_start_tunes_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(tuning_file.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    tuner = Tuner((16, 256, 4, 4, 1), (32, 256, 4, 3, 2))
    assert choose((6144, 4096, "torch.float8_e4m3fn", 16), tuner) == (16, 256, 4, 4, 1)
    assert choose((6144, 4096, "torch.float8_e4m3fn", 16), tuner) == (32, 256, 4, 3, 2)
    assert tuner.calls == 2 and list(tmp_path.iterdir()) == []


def test_a_later_start_takes_the_stored_tiling_without_tuning(tfile):
    key = (6144, 4096, "torch.float8_e4m3fn", 16)
    assert choose(key, Tuner((32, 256, 4, 3, 2))) == (32, 256, 4, 3, 2)
    data = json.loads(tfile.read_text())
    assert data == {"version": 1, "gpus": {"cpu": {"skinny 6144 4096 torch.float8_e4m3fn 16": [32, 256, 4, 3, 2]}}}
    again = Tuner((16, 256, 4, 4, 1))
    assert choose(key, again) == (32, 256, 4, 3, 2) and again.calls == 0
    # cuBLAS (None) and the fp8 GEMM's tilings (with a bool) come back as they went in
    assert choose((4096, 4096, "torch.bfloat16", 16), Tuner(None)) is None
    assert choose((4096, 12288, 64), Tuner((64, 64, 128, 4, 3, True, 1)), kind="fp8_gemm") == (64, 64, 128, 4, 3,
                                                                                               True, 1)
    later = Tuner((16, 256, 4, 4, 1), (16, 256, 4, 4, 1))
    assert choose((4096, 4096, "torch.bfloat16", 16), later) is None
    assert choose((4096, 12288, 64), later, kind="fp8_gemm") == (64, 64, 128, 4, 3, True, 1)
    assert later.calls == 0


def test_another_gpus_section_is_neither_used_nor_lost(tfile):
    key = (6144, 4096, "torch.float8_e4m3fn", 16)
    name = "skinny 6144 4096 torch.float8_e4m3fn 16"
    tfile.write_text(json.dumps({"version": 1, "gpus": {"NVIDIA H200": {name: [16, 256, 4, 4, 1]}}}))
    tuner = Tuner((32, 256, 4, 3, 2))
    assert choose(key, tuner) == (32, 256, 4, 3, 2) and tuner.calls == 1
    gpus = json.loads(tfile.read_text())["gpus"]
    assert gpus == {"NVIDIA H200": {name: [16, 256, 4, 4, 1]}, "cpu": {name: [32, 256, 4, 3, 2]}}


def test_a_tiling_the_tuner_no_longer_offers_is_tuned_again_and_replaced(tfile, caplog):
    name = "skinny 6144 4096 torch.float8_e4m3fn 16"
    tfile.write_text(json.dumps({"version": 1, "gpus": {"cpu": {name: [8, 8, 8, 8, 8], "other": [1]}}}))
    tuner = Tuner((16, 256, 4, 4, 1))
    with caplog.at_level(logging.WARNING, logger="engines.kernels"):
        assert choose((6144, 4096, "torch.float8_e4m3fn", 16), tuner) == (16, 256, 4, 4, 1)
    assert tuner.calls == 1 and "not a tiling the tuner offers now" in caplog.text
    assert json.loads(tfile.read_text())["gpus"]["cpu"] == {name: [16, 256, 4, 4, 1], "other": [1]}


@pytest.mark.parametrize("content,why", [("{not json", "not JSON"), ('{"version": 2, "gpus": {}}', "version 1"),
                                         ('{"version": 1, "gpus": {"cpu": []}}', "version 1"), ("[]", "version 1")])
def test_a_file_that_is_not_a_tuning_file_is_refused_with_its_path(tfile, content, why):
    tfile.write_text(content)
    tuner = Tuner((16, 256, 4, 4, 1))
    with pytest.raises(ValueError, match=why) as e:
        choose((1, 2, 3), tuner)
    assert str(tfile) in str(e.value) and tuner.calls == 0
    assert tfile.read_text() == content  # left as it was


def test_the_file_is_replaced_whole_and_no_temporary_file_stays(tfile):
    for n in range(5):
        choose((n, 1, 16), Tuner((16, 256, 4, 4, 1)))
    assert [p.name for p in tfile.parent.iterdir()] == [tfile.name]
    assert len(json.loads(tfile.read_text())["gpus"]["cpu"]) == 5


def test_a_file_that_cannot_be_written_is_refused_with_its_path(tmp_path, monkeypatch):
    path = tmp_path / "no-such-directory" / "tuning.json"
    monkeypatch.setenv(tuning_file.ENV, str(path))
    with pytest.raises(ValueError, match="cannot write it") as e:
        choose((1, 2, 3), Tuner((16, 256, 4, 4, 1)))
    assert str(path) in str(e.value) and not path.parent.exists()


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A shipped tuning file with a section for this (CPU) device: the package's own picks."""
    path = tmp_path / "shipped.json"
    path.write_text(json.dumps({"version": 1, "gpus": {"cpu": {"skinny 1 2 16": [32, 256, 4, 3, 2],
                                                               "skinny 3 4 16": [8, 8, 8, 8, 8]}}}))
    monkeypatch.setattr(tuning_file, "SHIPPED", path)
    return path


def test_without_the_variable_the_shipped_picks_are_taken_and_the_rest_tuned(shipped, tmp_path, monkeypatch):
    monkeypatch.delenv(tuning_file.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    tuner = Tuner((16, 256, 4, 4, 1), (16, 256, 4, 4, 1))
    assert choose((1, 2, 16), tuner) == (32, 256, 4, 3, 2) and tuner.calls == 0
    assert choose((5, 6, 16), tuner) == (16, 256, 4, 4, 1) and tuner.calls == 1  # a shape it lacks
    assert choose((3, 4, 16), tuner) == (16, 256, 4, 4, 1) and tuner.calls == 2  # a pick the tuner no longer offers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shipped.json"]  # nothing written


def test_none_tunes_every_shape_even_a_shipped_one(shipped, monkeypatch):
    monkeypatch.setenv(tuning_file.ENV, tuning_file.OFF)
    tuner = Tuner((16, 256, 4, 4, 1))
    assert choose((1, 2, 16), tuner) == (16, 256, 4, 4, 1) and tuner.calls == 1


def test_an_operators_file_is_a_set_of_its_own_and_the_shipped_picks_do_not_enter_it(shipped, tfile):
    tfile.write_text(json.dumps({"version": 1, "gpus": {"cpu": {"skinny 1 2 16": None}}}))
    tuner = Tuner((16, 256, 4, 4, 1))
    assert choose((1, 2, 16), tuner) is None and tuner.calls == 0  # the file's cuBLAS over the shipped tiling
    tfile.write_text(json.dumps({"version": 1, "gpus": {}}))
    assert choose((1, 2, 16), tuner) == (16, 256, 4, 4, 1) and tuner.calls == 1  # tuned, as gpu_tuning_pick.sh needs
    assert json.loads(tfile.read_text())["gpus"] == {"cpu": {"skinny 1 2 16": [16, 256, 4, 4, 1]}}


def test_the_shipped_file_is_a_tuning_file_with_the_h100_and_h200_sections():
    """The package's tunings.json reads as a tuning file (its picks are checked against the tuners' candidate lists in
    tests/gpu/test_lm_gemm_kernels.py, where Triton is installed)."""
    gpus = tuning_file._read(tuning_file.SHIPPED)["gpus"]
    assert len(gpus["NVIDIA H100 80GB HBM3"]) >= 20 and len(gpus["NVIDIA H200"]) >= 20
    for section in gpus.values():
        assert {name.split()[0] for name in section} <= {"skinny", "fp8_gemm"}
