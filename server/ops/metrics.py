"""Prometheus metrics of one server process (a registry per app, so tests can run several apps).

Under `moss-speech serve --workers N` the supervisor sets PROMETHEUS_MULTIPROC_DIR before it starts the
workers, so prometheus_client keeps every value in a file there and `render()` (in whichever worker
the scrape reached) reads all workers' files: counters and histograms add up, gauges are summed or
taken from the latest writer as each one's `multiprocess_mode` says.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
TURN_END_BUCKETS = (0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0)
END_OF_TURN_BUCKETS = (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 4.0)
RTF_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0)


def _free_used(stats: dict[str, Any], free_key: str, total_key: str, free: Gauge, used: Gauge) -> None:
    """A pool's free and used gauges from the stats' free and total figures (used only where both are there)."""
    f, total = stats.get(free_key), stats.get(total_key)
    if isinstance(f, int | float):
        free.set(f)
        if isinstance(total, int | float):
            used.set(total - f)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttfa_seconds = Histogram("moss_ttfa_seconds", "Committed turn to first answer audio sent",
                                      buckets=TTFA_BUCKETS, registry=r)
        self.rtf_hist = Histogram("moss_rtf", "Answer wall time / answer audio duration, per response",
                                  buckets=RTF_BUCKETS, registry=r)
        self.underruns = Counter("moss_audio_underruns", "Answer audio that left the server after a listener playing "
                                 "at real time from the answer's first audio (60 ms buffer) had run dry", registry=r)
        self.underrun_seconds = Counter("moss_audio_underrun_seconds", "Silence that listener heard inside answers",
                                        registry=r)
        self.active_sessions = Gauge("moss_active_sessions", "Open realtime sessions", registry=r,
                                     multiprocess_mode="livesum")
        self.queue_depth = Gauge("moss_outbound_queue_depth", "Outbound items queued, summed over sessions",
                                 registry=r, multiprocess_mode="livesum")
        self.errors = Counter("moss_errors", "Error events sent to clients, by code", ["code"], registry=r)
        self.engine_up = Gauge("moss_engine_up", "1 when the engine process answers pings", registry=r,
                               multiprocess_mode="livemin")  # every worker's link to the engine up
        self.engine_restarts = Counter("moss_engine_restarts", "Engine processes lost and restarted", registry=r)
        self.speculative = Counter("moss_speculative_answers", "Answers started on a tentative end of turn, by "
                                   "outcome (confirmed, or withdrawn when the user went on)", ["outcome"], registry=r)
        self.withdrawn_rows = Counter("moss_withdrawn_rows", "Rows withdrawn answers generated", registry=r)
        # A server process's end-of-turn model falling behind its sessions' pauses shows here first: waits grow and
        # questions end withdrawn (their pause over before the model got to them) instead of answered.
        self.end_of_turn = Counter("moss_end_of_turn_questions", "Questions to the end-of-turn model, by outcome: "
                                   "answered, stale (answered after its pause ended), withdrawn (its pause ended "
                                   "before its call), failed", ["outcome"], registry=r)
        self.end_of_turn_wait = Histogram("moss_end_of_turn_wait_seconds", "End-of-turn question asked -> answered, "
                                          "its wait in the queue and its call", buckets=END_OF_TURN_BUCKETS,
                                          registry=r)
        # Apart from the wait: a call slower than the model's measured cost means its threads lose the cores.
        self.end_of_turn_call = Histogram("moss_end_of_turn_call_seconds", "The end-of-turn model's own time a "
                                          "question (answered or stale), in its thread", buckets=END_OF_TURN_BUCKETS,
                                          registry=r)
        self.turn_end_silence = Histogram("moss_turn_end_silence_seconds", "Silence the turn detector had heard when "
                                          "it ended a turn (server_vad: silence_duration_ms; semantic_vad: until the "
                                          "end-of-turn model's yes, and the confirming silence), in audio time",
                                          buckets=TURN_END_BUCKETS, registry=r)
        # The engine's own figures, the same whichever worker's Pong carried them: the latest one wins.
        engine = {"registry": r, "multiprocess_mode": "livemostrecent"}
        self.kv_blocks_free = Gauge("moss_kv_blocks_free", "Free KV blocks in the engine", **engine)
        self.kv_blocks_used = Gauge("moss_kv_blocks_used", "Used KV blocks in the engine", **engine)
        self.engine_running = Gauge("moss_engine_running_requests", "Requests being decoded", **engine)
        self.engine_waiting = Gauge("moss_engine_waiting_requests", "Requests waiting for admission", **engine)
        self.decoder_pages_free = Gauge("moss_decoder_pages_free", "Free pages of the speech decoder's cache of "
                                        "earlier chunks (0.4 s of answer audio each)", **engine)
        self.decoder_pages_used = Gauge("moss_decoder_pages_used", "Used pages of the speech decoder's cache (answers "
                                        "in progress and cached voices)", **engine)
        self.decoder_pages_forgotten = Gauge("moss_decoder_pages_forgotten", "Oldest chunks long answers have "
                                             "forgotten since the engine started, the speech decoder's cache short",
                                             **engine)
        # The same per engine (label `engine`: "0".."N-1" under --gpus, a replica's id under Ray); the ones above are
        # their sum over the engines (engine_up: 1 while any engine takes sessions).
        each = {"labelnames": ["engine"], **engine}
        # (under --workers: every worker's link up, the sessions of all workers, a loss every worker saw once)
        self.each_up = Gauge("moss_engines_up", "1 when this engine answers pings", labelnames=["engine"],
                             registry=r, multiprocess_mode="livemin")
        self.each_kv_free = Gauge("moss_engines_kv_blocks_free", "Free KV blocks in this engine", **each)
        self.each_running = Gauge("moss_engines_running_requests", "Requests this engine decodes", **each)
        self.each_waiting = Gauge("moss_engines_waiting_requests", "Requests waiting in this engine", **each)
        self.each_sessions = Gauge("moss_engines_sessions", "Sessions placed on this engine", labelnames=["engine"],
                                   registry=r, multiprocess_mode="livesum")
        self.each_step_ms = Gauge("moss_engines_step_ms", "This engine's recent step time (ms)", **each)
        self.each_restarts = Gauge("moss_engines_restarts", "Times this engine was lost and restarted",
                                   labelnames=["engine"], registry=r, multiprocess_mode="livemax")

    # SessionObserver
    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def ttfa(self, seconds: float) -> None:
        self.ttfa_seconds.observe(seconds)

    def rtf(self, value: float) -> None:
        self.rtf_hist.observe(value)

    def underrun(self, seconds: float) -> None:
        self.underruns.inc()
        self.underrun_seconds.inc(seconds)

    def speculation(self, withdrawn: bool, wasted_rows: int = 0) -> None:
        self.speculative.labels(outcome="withdrawn" if withdrawn else "confirmed").inc()
        self.withdrawn_rows.inc(wasted_rows)

    def turn_end(self, silence_s: float) -> None:
        self.turn_end_silence.observe(silence_s)

    def end_of_turn_question(self, outcome: str, wait_s: float | None, call_s: float | None) -> None:
        self.end_of_turn.labels(outcome=outcome).inc()
        if outcome == "answered" and wait_s is not None:
            self.end_of_turn_wait.observe(wait_s)
        if call_s is not None:
            self.end_of_turn_call.observe(call_s)

    def engine_stats(self, stats: dict[str, Any], engine: str | None = None) -> None:
        """The figures of an engine's Pong (`engine` named) or of all engines together."""
        if engine is not None:
            for key, gauge in (("kv_free", self.each_kv_free), ("running", self.each_running),
                               ("waiting", self.each_waiting), ("step_ms", self.each_step_ms)):
                if isinstance(stats.get(key), int | float):
                    gauge.labels(engine=engine).set(stats[key])
            return
        _free_used(stats, "kv_free", "kv_total", self.kv_blocks_free, self.kv_blocks_used)
        _free_used(stats, "decoder_pages_free", "decoder_pages_total", self.decoder_pages_free,
                   self.decoder_pages_used)
        for key, gauge in (("running", self.engine_running), ("waiting", self.engine_waiting),
                           ("decoder_pages_forgotten", self.decoder_pages_forgotten)):
            if isinstance(stats.get(key), int | float):
                gauge.set(stats[key])

    def engines(self, each: dict[str, dict[str, Any]]) -> None:
        """Each engine's liveness, sessions and restarts (server.engine_pool.EnginePool.each); gone ones dropped."""
        for gauge in (self.each_up, self.each_sessions, self.each_restarts, self.each_kv_free, self.each_running,
                      self.each_waiting, self.each_step_ms):
            for (name,) in list(gauge._metrics):  # the labels set so far
                if name not in each:
                    gauge.remove(name)
        for name, e in each.items():
            self.each_up.labels(engine=name).set(1 if e["alive"] else 0)
            self.each_sessions.labels(engine=name).set(e["sessions_placed"])
            self.each_restarts.labels(engine=name).set(e["restarts"])

    def render(self) -> bytes:
        path = os.environ.get(MULTIPROC_ENV)
        if not path:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=path)
        return generate_latest(merged)
