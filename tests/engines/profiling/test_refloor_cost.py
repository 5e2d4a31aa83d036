"""The commit's re-encode cost tool: a quiet-start turn is encoded again whole and its held codes redone from the
first that changed; a turn whose floor never rises costs nothing."""

from __future__ import annotations

from engines.audio.wav import read_wav
from engines.profiling.refloor_cost import measure, turn
from engines.speech_in import SpeechEncoder
from tests.paths import DATA


def test_a_quiet_start_turn_is_redone_and_a_loud_start_one_is_not():
    enc = SpeechEncoder.load("tiny-random")
    wav = read_wav(DATA / "speech_en_16k.wav")[0]
    m = measure(enc, turn(wav, 2.0), iters=1)
    assert m["codes"] == 25 and m["codes changed"] > 0 and m["rows redone at commit"] == 24  # all it held
    assert m["frames redone at commit"] > 190 and m["segments redone while spoken"] == 0
    click = turn(wav, 1.5) * 0.05
    click[:40] += 0.9
    m = measure(enc, click, iters=1)
    assert (m["codes changed"], m["rows redone at commit"], m["frames redone at commit"]) == (0, 0, 0)
    assert m["finalize ms"] > 0
