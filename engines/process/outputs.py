"""What the engine service sends: the outbox of `(client, message)` pairs, an answer's text deltas, and its audio,
whose codes go to the codec worker as they are sampled and whose PCM goes out as the worker posts it."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from engines.api import EngineError
from engines.audio.wav import float32_to_pcm16
from engines.process.codec_worker import CodecWorker
from engines.process.sessions import ResponseState, Session
from engines.protocol import messages as m

log = logging.getLogger("engines.process")

Out = tuple[bytes, Any]


class Outputs:
    """Part of Service (service.py): its messages out. Calls Responses' _complete and _fail (responses.py) once an
    answer's last audio is out or its decoder failed."""

    _codec: CodecWorker | None
    _codec_owner: dict[int, Session]  # id(response) -> its session, while the worker has its audio
    _out: list[Out]

    def _send(self, client: bytes, msg: Any) -> None:
        self._out.append((client, msg))

    def _take(self) -> list[Out]:
        out, self._out = self._out, []
        return out

    def _text(self, s: Session, r: ResponseState, delta: str) -> None:
        if delta:
            r.text.append(delta)
            self._send(s.owner, m.TextDelta(s.session_id, r.response_id, delta))

    def _audio(self, s: Session, r: ResponseState, pcm: np.ndarray | None) -> None:
        if pcm is None or len(pcm) == 0:
            return
        if r.ttfa_ms is None:
            r.ttfa_ms = r.elapsed_ms()
            r.mark("first_audio")
        self._send(s.owner, m.AudioChunk(s.session_id, r.response_id, float32_to_pcm16(pcm), r.chunks))
        r.chunks += 1
        r.audio_samples += len(pcm)

    def _push_codes(self, live: list[tuple[Session, ResponseState]]) -> None:
        """Hand live answers' new codes to the codec worker at once (it batches them by rounds)."""
        for s, r in live:
            if r.decoder_stream is not None and r.new_codes and not r.cancelled:
                self._codec_owner[id(r)] = s
                self._codec.push(r, r.decoder_stream, r.new_codes)
                r.new_codes = []
                if len(r.code_idx) >= r.first_audio_codes:
                    r.mark("first_chunk_sent")

    def _deliver(self, s: Session, r: ResponseState, pcm: np.ndarray | Exception, final: bool) -> None:
        """Decoded audio of one answer (or the decoder's failure); `final`: its last, then ResponseDone."""
        if isinstance(pcm, EngineError):  # a condition with its own code (a full decoder cache: server_busy)
            log.warning("answer %s stopped: %s", r.response_id, pcm)
            if not r.cancelled:
                self._fail(s, r, f"speech decoder: {pcm}", pcm.code)
        elif isinstance(pcm, Exception):  # the speech decoder failing ends this answer, not the engine
            log.error("speech decoder failed for %s: %r", r.response_id, pcm)
            if not r.cancelled:
                self._fail(s, r, f"speech decoder failed: {type(pcm).__name__}: {pcm}")
        elif not r.cancelled:
            self._audio(s, r, pcm)
        if final:
            self._complete(s, r)

    def _collect_decoded(self, audio_only: bool = False) -> None:
        if self._codec is None:
            return
        for r, result, worker_done in self._codec.take_results(audio_only):
            rounds = self._codec.first_chunk_round(r)
            s = self._codec_owner.get(id(r))
            if s is None:
                continue
            if worker_done:
                del self._codec_owner[id(r)]
            if rounds is not None:
                r.mark("codec_first_round_start", rounds[0])
                r.mark("codec_first_round_end", rounds[1])
            # A failure ends the worker's part; the answer itself is complete only once it has finished.
            final = s.completing is r if isinstance(result, Exception) else worker_done
            self._deliver(s, r, result, final)
