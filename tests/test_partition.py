"""SM partitions refuse what they cannot do, with a message that says why (GPU cases: tests/gpu/test_partition.py)."""

from __future__ import annotations

import argparse

import pytest

from engines.partition import split
from engines.service.process import add_arguments, build_service


def test_split_needs_a_cuda_device():
    with pytest.raises(ValueError, match="need a CUDA device"):
        split("cpu", 32)


def test_codec_sms_on_the_cpu_is_refused():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--codec", "none", "--codec-sms", "32"])
    with pytest.raises(ValueError, match="--codec-sms 32 needs a CUDA device"):
        build_service(args)


def test_codec_sms_only_needs_codec_sms():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--codec", "none", "--codec-sms-only"])
    with pytest.raises(ValueError, match="--codec-sms-only needs --codec-sms N"):
        build_service(args)
