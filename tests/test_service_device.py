"""`--device auto` picks the GPU when there is one, else the CPU (the server's default setting)."""

from __future__ import annotations

import argparse

import torch

from engines.service.process import add_arguments, build_service


def test_device_auto_resolves_to_an_available_device():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--device", "auto", "--codec", "none"])
    svc = build_service(args)
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert svc.engine.config.device == want
    assert args.device == want
