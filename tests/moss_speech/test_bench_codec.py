"""`moss-speech bench codec` on the tiny codec, CPU: a complete report, timed only once the encoder's window is full."""

from __future__ import annotations

import json

from engines.speech_out.presets import DECODER_PRESETS
from moss_speech.cli import main


def test_bench_codec_reports_every_batch_after_the_window_fills(tmp_path, capsys):
    out = tmp_path / "codec.json"
    assert main(["bench", "codec", "--codec", "tiny-random", "--device", "cpu", "--vocoder", "hift",
                 "--batches", "1,3", "--iters", "2", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    # The encoder's keys grow for enc_left_chunks chunks; each new length is a new graph on a GPU, so the default
    # warm-up runs past them before anything is timed.
    assert rep["warmup_steps"] == DECODER_PRESETS["tiny-random"].stream.enc_left_chunks + 2
    assert [r["batch"] for r in rep["results"]] == [1, 3]
    hw = rep["hardware"]
    assert hw["copy_bytes_per_s"] > 0 and hw["matmul_flop_per_s"] > 0  # measured in the same run
    for r in rep["results"]:
        assert r["step_ms_median"] >= r["step_ms_min"] > 0 and r["streams_supported"] >= 0
        assert abs(r["ms_per_chunk"] * r["batch"] - r["step_ms_median"]) <= 0.001 * r["batch"]  # both rounded
    floors = [r["solve_floor_ms"] for r in rep["results"]]
    assert 0 < floors[0] <= floors[1]  # three sessions' rows cost at least one's
    assert "batch   3:" in capsys.readouterr().out
