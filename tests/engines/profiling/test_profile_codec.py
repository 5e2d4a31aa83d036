"""engines/profiling/profile_codec.py's stage times on CPU (the tool is run on a GPU; this checks what it wraps)."""


from engines.bench.codec_rounds import SteadyRounds
from engines.profiling.profile_codec import _stage_times
from engines.speech_out import CodecDecoder


def test_stage_times_cover_the_stages_a_step_runs_and_restore_every_wrapped_method():
    dec = CodecDecoder.load("tiny-random", vocoder="hift", context="window")  # the tool's path
    st = _stage_times(dec, SteadyRounds(dec, 2), dec.cfg.stream.steady_chunks + 2)
    # No encoder graphs off CUDA: the inputs are built and the encoder runs eagerly, each timed.
    assert set(st) == {"total", "solve", "vocoder", "encoder", "encoder_inputs", "host_and_rest"}
    assert all(v > 0 for k, v in st.items() if k != "host_and_rest")
    assert abs(sum(v for k, v in st.items() if k != "total") - st["total"]) < 1e-9
    for owner, attr in ((dec.flow, "_solve"), (dec.flow, "encode"), (dec.flow, "encode_inputs"),
                        (dec.windowed, "render")):
        assert attr not in vars(owner), attr  # the class's method again
