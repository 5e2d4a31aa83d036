"""The window on the engine process's device work (`--gpu-window`). On the CPU the window records host operators
instead of kernels; the plumbing is the same."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from torch.profiler import ProfilerActivity

from engines.process import main as process
from engines.process.observe.gpu_window import Events, GpuWindow, WindowConfig, busy_us, summary
from tests.engines.process.tiny_engine import served, text_turns


def test_window_spec_is_parsed_and_checked(tmp_path) -> None:
    c = WindowConfig.parse(f"100,2.5,{tmp_path}/w,1.npz")  # the path may hold commas
    assert (c.sessions, c.seconds, str(c.path)) == (100, 2.5, f"{tmp_path}/w,1.npz")
    for bad, why in [("100,2", "SESSIONS,SECONDS,PATH"), ("x,2,/p", "bad window"), ("0,2,/p", ">= 1"),
                     ("5,0,/p", r"\(0, 60\]"), ("5,61,/p", r"\(0, 60\]"), ("5,2,", "SESSIONS,SECONDS,PATH")]:
        with pytest.raises(ValueError, match=why):
            WindowConfig.parse(bad)


def test_busy_time_is_the_union_of_intervals() -> None:
    start = np.array([10.0, 0.0, 5.0, 30.0, 31.0])
    dur = np.array([5.0, 8.0, 1.0, 2.0, 0.5])  # [0,8) u [5,6) u [10,15) u [30,32) u [31,31.5)
    assert busy_us(start, dur) == 8.0 + 5.0 + 2.0
    ev = Events(start, dur, np.array([1, 1, 2, 2, 2]), np.arange(5), np.array([0, 0, 1, 1, 0]), ["gemm", "conv"])
    lines = summary(ev, span_us=32.0)
    assert lines[0] == "window 0 ms, any stream busy 0.0 ms"
    assert lines[1].startswith("stream 1: 2 events, busy 0.0 ms (41%)")  # [0,8) u [10,15): 13 of 32 us
    assert lines[2].startswith("stream 2: 3 events, busy 0.0 ms (9%)")  # [5,6) u [30,32): 3 us


def test_window_records_once_enough_sessions_are_open(tmp_path, caplog) -> None:
    now = [0.0]
    window = GpuWindow(WindowConfig(2, 1.0, tmp_path / "w.npz"), activities=[ProfilerActivity.CPU],
                       clock=lambda: now[0])
    server, ctx = served(window)
    try:
        window.poll(1)
        assert window._prof is None and not window.done  # too few sessions: not started
        with caplog.at_level(logging.INFO, logger="engines.process.observe.gpu_window"):
            text_turns(server, ctx, sessions=2)  # two sessions open: recording while they are answered
            assert window._prof is not None and not window.done
            now[0] = 1.0
            server.run_once(timeout_ms=0)
        assert window.done and (tmp_path / "w.npz").exists()
        ev = Events.load(tmp_path / "w.npz")
        assert len(ev.start) == len(ev.duration) == len(ev.stream) == len(ev.name) > 0
        assert any(n.startswith("aten::") for n in ev.names)  # the engine steps' operators
        assert (ev.start >= 0).all() and ev.start.min() == 0
        logged = [r.getMessage() for r in caplog.records]
        assert any(re.match(r"gpu window: stream \d+: \d+ events, busy", x) for x in logged)
        window.poll(5)
        assert window._prof is None  # one window per process
    finally:
        server.close()
        ctx.term()


def test_close_writes_a_window_still_recording(tmp_path) -> None:
    window = GpuWindow(WindowConfig(1, 60.0, tmp_path / "w.npz"), activities=[ProfilerActivity.CPU])
    server, ctx = served(window)
    text_turns(server, ctx, sessions=1)
    assert not window.done
    server.close()
    ctx.term()
    assert window.done and (tmp_path / "w.npz").exists()


def test_engine_process_refuses_a_bad_window() -> None:
    with pytest.raises(SystemExit) as e:
        process.main(["--gpu-window", "0,2,/tmp/w.npz"])
    assert e.value.code == 2


def test_window_report_names_the_parts_and_the_model_steps() -> None:
    from engines.profiling.window_report import report

    names = ["_skinny_kernel", "_ln_linear_kernel", "_snake_kernel", "gemmSN_TN_kernel<float>", "memset"]
    # Stream 1: two language-model steps of 60 kernels (one launch each), 10 ms apart, 4 ms long. Stream 2: the codec's
    # flow, busy the first 5 ms. Stream 3: HiFT; stream 4: the speech encoder; stream 5: something else.
    start = [0.0 + 4000 * i / 60 for i in range(60)] + [10000.0 + 4000 * i / 60 for i in range(60)]
    dur = [4000 / 60] * 120
    stream, corr, name = [1] * 120, [7] * 60 + [8] * 60, [0] * 120
    start += [0.0, 2500.0, 3000.0, 4000.0, 5000.0]
    dur += [2500.0, 2500.0, 100.0, 100.0, 100.0]
    stream += [2, 2, 3, 4, 5]
    corr += [20, 21, 22, 23, 24]
    name += [1, 1, 2, 3, 4]
    ev = Events(np.array(start), np.array(dur), np.array(stream), np.array(corr), np.array(name), names)
    lines = report(ev)
    assert lines[0] == "window 14 ms; any stream busy 65%"  # [0, 5.1) and [10, 14) ms of 14
    by_part = {line.split(":")[0]: line for line in lines[1:-1]}
    assert set(by_part) == {"language model", "codec flow (estimator, flow encoder)", "codec vocoder (HiFT)",
                            "speech encoder", "other"}
    assert "2 kernels" in by_part["codec flow (estimator, flow encoder)"] and "busy 36%" in by_part[
        "codec flow (estimator, flow encoder)"]
    assert lines[-1].startswith("language model: 2 step launches of >= 50 kernels; each took p10/p50/p90 "
                                "4.0 / 4.0 / 4.0 ms, starts 10.0 ms apart")


def test_window_report_knows_the_speech_encoders_triton_kernels() -> None:
    """A held-audio step on a GPU runs only the encoder's Triton kernels (no cuBLAS SGEMM, no SDPA) on its stream."""
    from engines.profiling.window_report import part_of

    assert part_of({"_encoder_attention_kernel", "vectorized_layer_norm_kernel"}) == "speech encoder"
    assert part_of({"_tf32x3_gemm_kernel"}) == "speech encoder"  # the encoder GEMM's former name, in older windows
    assert part_of({"_encoder_gemm_kernel"}) == "speech encoder"
