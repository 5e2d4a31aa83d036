"""A scripted stand-in for `engines.process.main`: same CLI, same socket and messages, no model.

For server protocol tests that must not depend on the model (error paths, limits, supervision). Its
rules, which the tests rely on:
- user audio: one row per 1280 samples at 16 kHz (12.5 Hz codes); a commit adds 4 rows; a text item adds
  one row per word + 4;
- a response prefills the rows added since the previous response (`prompt_rows`), streams
  FAKE_ENGINE_CHUNKS (default 4) steps, each a TextDelta "w{i} " and an AudioChunk of 5 codes
  (9600 samples of a 440 Hz tone), FAKE_ENGINE_STEP_S (default 0.02) apart, then ResponseDone;
- KV: 16 rows per block, 4096 blocks; a session's blocks are held until CloseSession; Pong reports
  kv_free / kv_total / running / sessions, and as the engine does, its device, max_running and max_model_len
  (the options given, else EngineConfig's defaults) and kv_block_rows; and `argv`, its command line's arguments.
It takes every option the engine process takes (engines/process/options.py) and ignores those it has no use for.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import zmq

from engines.process.options import add_arguments
from engines.protocol import messages as m

BLOCK_ROWS = 16
KV_TOTAL = 4096
MAX_RUNNING, MAX_MODEL_LEN = 64, 8192  # EngineConfig's defaults
SAMPLES_PER_CODE = 1920  # 24 kHz / 12.5 Hz


@dataclass
class _Resp:
    id: str
    modality: str
    prompt_rows: int
    cached_rows: int
    max_rows: int
    step: int = 0
    rows: int = 0
    samples: int = 0
    text: str = ""
    cancelled: bool = False
    next_at: float = 0.0
    started_at: float = 0.0
    first_audio_ms: float | None = None


@dataclass
class _Sess:
    ident: bytes
    rows: int = 0  # rows in the (cached) history
    new_rows: int = 0  # rows added since the last response
    audio_samples: int = 0
    resp: _Resp | None = None


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args()
    capacity = {"device": args.device, "max_running": args.max_running or MAX_RUNNING,
                "max_model_len": args.max_model_len or MAX_MODEL_LEN, "kv_block_rows": BLOCK_ROWS,
                "argv": sys.argv[1:]}
    chunks = int(os.environ.get("FAKE_ENGINE_CHUNKS", "4"))
    step_s = float(os.environ.get("FAKE_ENGINE_STEP_S", "0.02"))
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(5 * SAMPLES_PER_CODE) / 24000) * 32767).astype("<i2").tobytes()

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(args.endpoint)
    sessions: dict[str, _Sess] = {}

    def send(ident: bytes, msg: object) -> None:
        sock.send_multipart([ident, m.encode(msg)])

    def blocks_used() -> int:
        return sum(math.ceil((s.rows + s.new_rows + (s.resp.rows if s.resp else 0)) / BLOCK_ROWS)
                   for s in sessions.values())

    def finish(s: _Sess, sid: str, status: str, reason: str | None) -> None:
        r = s.resp
        assert r is not None
        s.rows += r.prompt_rows + r.rows
        send(s.ident, m.ResponseDone(session_id=sid, response_id=r.id, status=status, reason=reason,
                                     output_rows=r.rows, prompt_rows=r.prompt_rows, cached_rows=r.cached_rows,
                                     audio_samples=r.samples, text=r.text, engine_ttfa_ms=r.first_audio_ms))
        s.resp = None

    while True:
        due = [s.resp.next_at for s in sessions.values() if s.resp]
        wait_ms = max(0, int((min(due) - time.monotonic()) * 1000)) if due else 100
        while sock.poll(wait_ms):
            wait_ms = 0
            frames = sock.recv_multipart()
            ident, payload = frames[0], frames[-1]
            try:
                msg = m.decode(payload)
            except m.MessageError as e:
                send(ident, m.Error(session_id=None, code="invalid_message", message=str(e)))
                continue
            if isinstance(msg, m.Ping):
                send(ident, m.Pong(nonce=msg.nonce, stats={
                    "kv_total": KV_TOTAL, "kv_free": KV_TOTAL - blocks_used(), "sessions": len(sessions),
                    "running": sum(1 for s in sessions.values() if s.resp), "waiting": 0, "fake": True, **capacity}))
                continue
            sid = msg.session_id
            if isinstance(msg, m.OpenSession):
                sessions[sid] = _Sess(ident)
                send(ident, m.SessionReady(session_id=sid))
                continue
            s = sessions.get(sid)
            if s is None:
                send(ident, m.Error(session_id=sid, code="unknown_session", message=f"no session {sid}"))
                continue
            if isinstance(msg, m.Sync):
                send(ident, m.Synced(session_id=sid, seq=msg.seq))
            elif isinstance(msg, m.CloseSession):
                del sessions[sid]
            elif isinstance(msg, m.AppendUserAudio):
                s.audio_samples += len(msg.pcm16k) // 2
                rows = s.audio_samples // 1280
                s.new_rows += rows
                s.audio_samples -= rows * 1280
                send(ident, m.UserAudioProgress(session_id=sid, codes=rows, prefilled_rows=s.new_rows))
            elif isinstance(msg, m.ClearUserAudio):
                s.audio_samples = 0
            elif isinstance(msg, m.CommitUserAudio):
                s.new_rows += 4 + (1 if s.audio_samples else 0)
                s.audio_samples = 0
            elif isinstance(msg, m.AddUserText):
                s.new_rows += len(msg.text.split()) + 4
            elif isinstance(msg, m.UpdateSession):
                pass
            elif isinstance(msg, m.CreateResponse):
                if s.resp is not None:
                    send(ident, m.Error(session_id=sid, code="response_active", message="busy",
                                        response_id=msg.response_id))
                    continue
                now = time.monotonic()
                s.resp = _Resp(msg.response_id, msg.modality, s.new_rows, s.rows, msg.sampling.max_new_tokens,
                               next_at=now + step_s, started_at=now)
                s.new_rows = 0
                send(ident, m.ResponseStarted(session_id=sid, response_id=msg.response_id,
                                              prompt_rows=s.resp.prompt_rows))
            elif isinstance(msg, m.CancelResponse):
                if s.resp is not None and s.resp.id == msg.response_id:
                    s.resp.cancelled = True
            elif isinstance(msg, m.WithdrawResponse):
                if s.resp is not None and s.resp.id == msg.response_id:
                    finish(s, sid, "cancelled", "withdrawn")
            elif isinstance(msg, m.TruncateResponse | m.ConfirmUserAudio):
                pass  # the fake keeps no real history
        now = time.monotonic()
        for sid, s in list(sessions.items()):
            r = s.resp
            if r is None or now < r.next_at:
                continue
            if r.cancelled:
                finish(s, sid, "cancelled", "client_cancelled")
                continue
            r.next_at = now + step_s
            delta = f"w{r.step} "
            r.text += delta
            r.rows += 5
            send(s.ident, m.TextDelta(session_id=sid, response_id=r.id, text=delta))
            if r.modality == "audio":
                if r.first_audio_ms is None:
                    r.first_audio_ms = (now - r.started_at) * 1000
                send(s.ident, m.AudioChunk(session_id=sid, response_id=r.id, pcm24k=tone, index=r.step))
                r.samples += len(tone) // 2
            r.step += 1
            if r.step >= chunks or r.rows >= r.max_rows:
                finish(s, sid, "completed" if r.step >= chunks else "incomplete",
                       None if r.step >= chunks else "max_output_tokens")


if __name__ == "__main__":
    main()
