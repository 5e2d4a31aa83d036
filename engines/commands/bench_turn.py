"""`moss-speech bench turn`: engine-side TTFA of a spoken turn, with and without incremental prefill.

A user turn of N seconds arrives in 20 ms pieces at real time. With incremental prefill (what the
service does) each piece is encoded and its codes prefilled while the user talks; the baseline
("at end of turn", as public MOSS-Speech servers do) sends the whole recording at commit. TTFA is
measured from the commit to the first PCM chunk of the answer leaving the service (in-process: no
network, no VAD silence).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from engines.bench.hardware import device_name, median
from engines.codec.audio_io import float32_to_pcm16
from engines.service import messages as m

PIECE = 320  # 20 ms at 16 kHz


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--codec", default="tiny-random")
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocoder", default="hift", choices=["bigvgan", "hift"])
    p.add_argument("--turn-seconds", default="2,10")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)


def _speechlike(seconds: float, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)  # syllable-rate envelope
    return (0.2 * env * (np.sin(2 * np.pi * 180 * t) + 0.3 * rng.standard_normal(t.size))).astype(np.float32)


def _one_turn(svc, sid: str, pcm: np.ndarray, incremental: bool) -> float:
    client = b"bench"
    svc.handle(client, m.OpenSession(sid))
    if incremental:
        start = time.monotonic()
        for i in range(0, pcm.size, PIECE):
            svc.handle(client, m.AppendUserAudio(sid, float32_to_pcm16(pcm[i:i + PIECE])))
            svc.step()
            due = start + (i + PIECE) / 16000
            while time.monotonic() < due:  # the engine keeps stepping while the user talks
                svc.step() if svc.has_work() else time.sleep(0.001)
    else:
        time.sleep(pcm.size / 16000)  # the user talks; nothing is sent until the end
        svc.handle(client, m.AppendUserAudio(sid, float32_to_pcm16(pcm)))
    t0 = time.monotonic()
    svc.handle(client, m.CommitUserAudio(sid, "item"))
    svc.handle(client, m.CreateResponse(sid, "resp", "audio", m.Sampling(max_new_tokens=64, min_new_tokens=32)))
    ttfa = None
    while ttfa is None:
        for _, msg in svc.step():
            if isinstance(msg, m.AudioChunk):
                ttfa = time.monotonic() - t0
                break
    svc.handle(client, m.CloseSession(sid))
    while svc.has_work():
        svc.step()
    return ttfa * 1e3


def run(args: argparse.Namespace) -> int:
    from engines.service.process import build_service

    ns = argparse.Namespace(model=args.model, codec=args.codec, device=args.device, dtype=None,
                            vocoder=args.vocoder, kv_cache_gib=None, max_running=None, max_model_len=None, seed=0)
    svc = build_service(ns)
    rng = np.random.default_rng(0)
    res = {"device": device_name(__import__("torch").device(args.device)), "model": args.model,
           "codec": args.codec, "vocoder": args.vocoder, "ttfa_ms": {}}
    _one_turn(svc, "warm", _speechlike(1.0, rng), True)
    for secs in [float(s) for s in args.turn_seconds.split(",")]:
        pcm = _speechlike(secs, rng)
        for mode, inc in (("incremental", True), ("at_end_of_turn", False)):
            ms = median([_one_turn(svc, f"{mode}-{secs}-{i}", pcm, inc) for i in range(args.repeats)])
            res["ttfa_ms"][f"{secs:g}s_{mode}"] = ms
            print(f"turn {secs:4.1f} s, {mode:15s}: TTFA {ms:8.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
