"""`moss-speech bench engine`: its options are checked before anything loads, and its TTFA counts by default the
codes the served decoder's first audio waits for."""

from __future__ import annotations

import argparse

import pytest

from engines.process.config import ProcessConfig
from engines.process.loading import build_service
from moss_speech.commands.bench_engine import TTFA_CODES, add_arguments, run


@pytest.mark.parametrize("codes", [0, TTFA_CODES + 1])
def test_first_audio_codes_outside_what_its_request_makes_are_refused(codes):
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit, match=f"--first-audio-codes must be 1-{TTFA_CODES}, got {codes}"):
        run(p.parse_args(["--model", "tiny-random", "--device", "cpu", "--first-audio-codes", str(codes)]))


def test_the_default_is_what_the_served_decoder_waits_for():
    """The served default: the full-context decoder and the bundled voice (the tiny codec's chunks and lookahead are
    the full-size codec's; the voice's prompt codes count its recording's length, whatever the weights)."""
    svc = build_service(ProcessConfig.parse(["--device", "cpu", "--model", "tiny-random", "--codec", "tiny-random",
                                             "--no-warm-up"]))
    stream = svc.decoder.open_stream("s")
    try:
        p = argparse.ArgumentParser()
        add_arguments(p)
        assert p.parse_args([]).first_audio_codes == stream.first_audio_codes
    finally:
        stream.close()
