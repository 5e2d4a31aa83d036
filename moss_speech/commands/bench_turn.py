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

from engines.audio.wav import float32_to_pcm16
from engines.bench.hardware import device_name, median
from engines.process.config import ProcessConfig
from engines.process.loading import build_service
from engines.protocol import messages as m
from moss_speech.commands.arguments import counts

PIECE = 320  # 20 ms at 16 kHz


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--codec", default="tiny-random")
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocoder", default="hift", choices=["bigvgan", "hift"])
    p.add_argument("--turn-seconds", default="2,10")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sessions", type=counts, default="1", help="comma separated: sessions speaking at once")
    p.add_argument("--transcribe", action="store_true",
                   help="every committed turn is also transcribed (CommitUserAudio.transcribe): TTFA beside that")
    p.add_argument("--json", default=None)


def _speechlike(seconds: float, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)  # syllable-rate envelope
    return (0.2 * env * (np.sin(2 * np.pi * 180 * t) + 0.3 * rng.standard_normal(t.size))).astype(np.float32)


def _turns(svc, sids: list[str], pcm: np.ndarray, incremental: bool, stages: dict | None = None,
           transcribe: bool = False) -> list[float]:
    """All sessions speak the same turn at the same time; TTFA (ms) of each, from the common commit.
    `stages` collects each response's stage times (ResponseState.marks) by stage name."""
    client = b"bench"
    for sid in sids:
        svc.handle(client, m.OpenSession(sid))
    if incremental:
        start = time.monotonic()
        for i in range(0, pcm.size, PIECE):
            piece = float32_to_pcm16(pcm[i:i + PIECE])
            svc.handle_many([(client, m.AppendUserAudio(sid, piece)) for sid in sids])
            svc.step()
            due = start + (i + PIECE) / 16000
            while time.monotonic() < due:  # the engine keeps stepping while the users talk
                svc.step() if svc.has_work() else time.sleep(0.001)
    else:
        time.sleep(pcm.size / 16000)  # the users talk; nothing is sent until the end
        svc.handle_many([(client, m.AppendUserAudio(sid, float32_to_pcm16(pcm))) for sid in sids])
    t0 = time.monotonic()
    for sid in sids:
        svc.handle(client, m.CommitUserAudio(sid, "item", transcribe=transcribe))
        svc.handle(client, m.CreateResponse(sid, "resp", "audio", m.Sampling(max_new_tokens=64, min_new_tokens=32)))
    ttfa: dict[str, float] = {}
    while len(ttfa) < len(sids):
        for _, msg in svc.step():
            if isinstance(msg, m.AudioChunk) and msg.session_id not in ttfa:
                ttfa[msg.session_id] = (time.monotonic() - t0) * 1e3
                t = svc.sessions[msg.session_id].active
                if stages is not None and t is not None and t.response is not None:
                    for k, v in t.response.marks.items():
                        stages.setdefault(k, []).append(v)
    for sid in sids:
        svc.handle(client, m.CloseSession(sid))
    while svc.has_work():
        svc.step()
    return [ttfa[s] for s in sids]


def run(args: argparse.Namespace) -> int:
    # the engine process's settings, its defaults otherwise
    svc = build_service(ProcessConfig.parse([
        "--model", args.model, "--codec", args.codec, "--device", args.device, "--vocoder", args.vocoder,
        "--kv-cache-gib", "8", "--max-running", "64", "--max-model-len", "4096", "--seed", "0",
        "--encode-every-ms", "80"]))
    rng = np.random.default_rng(0)
    res = {"device": device_name(__import__("torch").device(args.device)), "model": args.model,
           "codec": args.codec, "vocoder": args.vocoder, "ttfa_ms": {}}
    _turns(svc, ["warm"], _speechlike(1.0, rng), True)
    for n in args.sessions:
        for secs in [float(s) for s in args.turn_seconds.split(",")]:
            pcm = _speechlike(secs, rng)
            for mode, inc in (("incremental", True), ("at_end_of_turn", False)):
                stages: dict[str, list[float]] = {}
                runs = [_turns(svc, [f"{mode}-{secs}-{i}-{k}" for k in range(n)], pcm, inc, stages,
                               transcribe=args.transcribe) for i in range(args.repeats)]
                ms = median([x for r in runs for x in r])
                worst = max(x for r in runs for x in r)
                key = f"{secs:g}s_{mode}" + (f"_x{n}" if n > 1 else "") + ("_transcribed" if args.transcribe else "")
                res["ttfa_ms"][key] = ms
                res.setdefault("ttfa_max_ms", {})[key] = worst
                per_run = [round(median(r)) for r in runs]
                res.setdefault("ttfa_median_per_repeat_ms", {})[key] = per_run
                st = {k: round(median(v), 1) for k, v in stages.items()}
                res.setdefault("stage_median_ms", {})[key] = st
                print(f"{n:3d} sessions, turn {secs:4.1f} s, {mode:15s}: TTFA median {ms:8.1f} ms, max {worst:8.1f} ms"
                      f" (per repeat: {per_run}); stage medians from CreateResponse {st}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
