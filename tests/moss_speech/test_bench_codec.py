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


def _args(*flags: str):
    import argparse

    from moss_speech.commands import bench_codec

    p = argparse.ArgumentParser()
    bench_codec.add_arguments(p)
    return p.parse_args(list(flags))


def test_bench_codec_loads_the_decoder_as_the_engine_serves_it_on_the_device(tmp_path):
    from moss_speech.commands.bench_codec import load_options

    gpu = load_options(_args("--codec", "full-random"), on_gpu=True)
    assert gpu == {"vocoder": "bigvgan", "cuda_graphs": True, "encoder_graphs": True, "encoder_tf32": True,
                   "estimator_dtype": "bfloat16"}
    cpu = load_options(_args(), on_gpu=False)
    assert cpu == {"vocoder": "bigvgan", "cuda_graphs": False, "encoder_graphs": False, "encoder_tf32": False,
                   "estimator_dtype": "float32"}
    # A codec directory without bigvgan/ (the published layout) is served with its own HiFT.
    codec = tmp_path / "codec"
    codec.mkdir()
    assert load_options(_args("--codec", str(codec)), on_gpu=True)["vocoder"] == "hift"
    (codec / "bigvgan").mkdir()
    assert load_options(_args("--codec", str(codec)), on_gpu=True)["vocoder"] == "bigvgan"


def test_bench_codec_flags_override_the_served_settings():
    from moss_speech.commands.bench_codec import load_options

    opts = load_options(_args("--no-cuda-graphs", "--estimator-dtype", "float32", "--no-encoder-tf32",
                              "--vocoder", "hift"), on_gpu=True)
    assert opts == {"vocoder": "hift", "cuda_graphs": False, "encoder_graphs": True, "encoder_tf32": False,
                    "estimator_dtype": "float32"}
    assert load_options(_args("--no-encoder-graphs"), on_gpu=True)["encoder_graphs"] is False
    assert load_options(_args("--cuda-graphs"), on_gpu=False)["cuda_graphs"] is True


def test_bench_codec_counts_the_chunks_answers_forgot_while_timed(tmp_path):
    """Answers longer than the cache holds forget their oldest chunks: a step timed then has less context than the
    chunk model was trained with, and the report says how much was cut."""
    short, roomy = tmp_path / "short.json", tmp_path / "roomy.json"
    base = ["bench", "codec", "--codec", "tiny-random", "--device", "cpu", "--batches", "3", "--iters", "3",
            "--warmup", "36"]
    assert main(base + ["--cache-gib", "0.0086", "--json", str(short)]) == 0  # 100 pages of 90 KiB
    assert main(base + ["--json", str(roomy)]) == 0
    cut = json.loads(short.read_text())
    assert cut["cache_pages"] == 100
    assert cut["results"][0]["chunks_forgotten_timed"] > 0
    assert json.loads(roomy.read_text())["results"][0]["chunks_forgotten_timed"] == 0


def test_bench_codec_names_a_cache_too_small_for_its_answers(capsys, monkeypatch):
    from engines.bench.codec_rounds import SteadyRounds

    closed = []
    close = SteadyRounds.close
    monkeypatch.setattr(SteadyRounds, "close", lambda self: (closed.append(len(self.streams)), close(self)))
    rc = main(["bench", "codec", "--codec", "tiny-random", "--device", "cpu", "--batches", "3", "--iters", "2",
               "--warmup", "20", "--cache-gib", "0.003"])
    assert rc == 1
    assert "error: batch 3:" in capsys.readouterr().err
    assert closed == [3]  # the batch's answers closed all the same
    assert main(["bench", "codec", "--codec", "tiny-random", "--device", "cpu", "--cache-gib", "0"]) == 2
    assert main(["bench", "codec", "--codec", "tiny-random", "--device", "cpu", "--prompt-codes", "5000"]) == 2
    assert "exceeds a voice prompt's" in capsys.readouterr().err


def test_bench_codec_times_only_rounds_where_every_answer_decodes_a_chunk(tmp_path, capsys):
    """In a voice, an answer's first job waits for the prompt's tail and more codes: a round timed before then would
    decode fewer chunks than the batch and overstate the streams."""
    assert main(["bench", "codec", "--codec", "tiny-random", "--device", "cpu", "--batches", "2", "--iters", "2",
                 "--warmup", "0"]) == 2
    assert "a timed step decoded fewer than 2 chunks" in capsys.readouterr().err
    out = tmp_path / "none.json"
    assert main(["bench", "codec", "--codec", "tiny-random", "--device", "cpu", "--batches", "2", "--iters", "2",
                 "--warmup", "0", "--prompt-codes", "0", "--json", str(out)]) == 0  # no prompt: every round decodes
    assert json.loads(out.read_text())["prompt_codes"] == 0
