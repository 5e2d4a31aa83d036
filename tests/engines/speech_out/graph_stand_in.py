"""CUDA graphs on a CPU for the codec decoder's tests: `capture_graph` replaced by a stand-in whose replay re-runs the
captured function on its static inputs, so the graphs' bookkeeping (keys, buckets, padding, what is captured when)
runs as on a GPU."""

from __future__ import annotations


def replay_stand_in(monkeypatch):
    """graphs.capture_graph replaced by a stand-in whose replay re-runs the function on its static inputs (CPU)."""
    import engines.speech_out.chunk_graphs as graphs_mod

    class Replay:
        def __init__(self, fn, out):
            self.fn, self.out, self.replays = fn, out, 0

        def replay(self):
            self.replays += 1
            for o, new in zip(self.out, self.fn(), strict=True):
                o.copy_(new)

        def pool(self):
            return None

    def stand_in(fn, stream, pool=None):
        out = fn()
        return Replay(fn, out), out

    monkeypatch.setattr(graphs_mod, "capture_graph", stand_in)
    monkeypatch.setattr(graphs_mod, "private_stream", lambda device, urgent=None: None)
    return graphs_mod
