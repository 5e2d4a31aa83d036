"""The API's audio formats: G.711 mu-law and A-law against the standard's own rules, the format objects a session
takes, and an answer's audio encoded as a stream."""

from __future__ import annotations

import numpy as np
import pytest

from server.audio.formats import PCM, PCMA, PCMU, AnswerEncoder, FormatError, parse_format
from server.audio.pcm import float32_to_pcm16
from server.audio.resample import AudioError, resample

CODES = bytes(range(256))


def _mulaw_decoded(code: int) -> int:
    """ITU-T G.711 mu-law expansion, written from the standard: bits inverted, then sign, segment, step."""
    v = ~code & 0xFF
    magnitude = (((v & 0x0F) << 3) + 0x84 << ((v >> 4) & 0x07)) - 0x84
    return -magnitude if v & 0x80 else magnitude


def _alaw_decoded(code: int) -> int:
    """ITU-T G.711 A-law expansion, written from the standard: even bits inverted, then sign, segment, step."""
    v = code ^ 0x55
    seg, step = (v >> 4) & 0x07, v & 0x0F
    magnitude = (step << 4) + 8 if seg == 0 else ((step << 4) + 0x108) << (seg - 1)
    return magnitude if v & 0x80 else -magnitude


@pytest.mark.parametrize(("fmt", "rule"), [(PCMU, _mulaw_decoded), (PCMA, _alaw_decoded)])
def test_every_g711_code_decodes_to_the_standards_value(fmt, rule):
    got = np.round(fmt.decode(CODES) * 32768).astype(int)
    assert got.tolist() == [rule(c) for c in CODES]


@pytest.mark.parametrize("fmt", [PCMU, PCMA])
def test_g711_encoding_picks_a_code_next_to_the_sample(fmt):
    """A correct quantizer: no code's value lies strictly between a sample and what its code decodes to; and every
    code's own value encodes back to it (mu-law's two zeros to one)."""
    levels = np.sort(np.unique(np.round(fmt.decode(CODES) * 32768)))
    x = np.arange(-32768, 32768, 3, dtype=np.float64)
    back = np.round(fmt.decode(fmt.encode(x / 32768)) * 32768)
    lo, hi = np.minimum(x, back), np.maximum(x, back)
    between = np.searchsorted(levels, hi, side="left") - np.searchsorted(levels, lo, side="right")
    assert between.max() == 0
    values = fmt.decode(CODES)
    again = fmt.decode(fmt.encode(values))
    assert np.array_equal(again, values) or fmt is PCMU and np.array_equal(np.abs(again), np.abs(values))


def test_pcm16_passes_through_and_refuses_a_half_sample():
    x = np.linspace(-1, 0.99, 101, dtype=np.float32)
    assert PCM.encode(x) == float32_to_pcm16(x)
    assert np.array_equal(PCM.decode(PCM.encode(x)), np.round(x * 32768) / 32768)
    with pytest.raises(AudioError, match="odd number of bytes"):
        PCM.decode(b"\x00\x01\x02")
    assert PCMU.decode(b"").shape == (0,) and PCMA.encode(np.zeros(0, np.float32)) == b""


@pytest.mark.parametrize(("obj", "fmt"), [
    ({}, PCM), ({"type": "audio/pcm"}, PCM), ({"type": "audio/pcm", "rate": 24000}, PCM),
    ({"type": "audio/pcmu"}, PCMU), ({"type": "audio/pcma", "rate": 8000}, PCMA)])
def test_format_objects_taken(obj, fmt):
    assert parse_format(obj) is fmt
    assert parse_format(fmt.to_event()) is fmt


@pytest.mark.parametrize(("obj", "param"), [
    ({"type": "audio/opus"}, "type"), ({"type": 3}, "type"), ({"type": None}, "type"),
    ({"type": "audio/pcm", "rate": 16000}, "rate"), ({"type": "audio/pcmu", "rate": 24000}, "rate"),
    ({"rate": True}, "rate")])
def test_format_objects_refused_name_their_field(obj, param):
    with pytest.raises(FormatError) as e:
        parse_format(obj)
    assert e.value.param == param


def test_g711_events_show_no_rate_and_pcm_shows_its_own():
    assert PCMU.to_event() == {"type": "audio/pcmu"} and PCMA.to_event() == {"type": "audio/pcma"}
    assert PCM.to_event() == {"type": "audio/pcm", "rate": 24000}


@pytest.mark.parametrize("fmt", [PCMU, PCMA])
def test_an_answer_encoded_chunk_by_chunk_equals_the_whole_answer_encoded(fmt):
    """The streaming resampler carries its filter across chunks: chunks of 5 codes (9,600 samples) and uneven ones
    give the codes of the whole answer resampled at once, but for samples on a quantizer's edge."""
    rng = np.random.default_rng(0)
    t = np.arange(24000 * 2) / 24000
    answer = (0.3 * np.sin(2 * np.pi * 180 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    whole = fmt.decode(fmt.encode(resample(np.round(answer * 32768) / 32768, 24000, 8000)))
    for cuts in ([9600 * i for i in range(1, 5)], [7, 1000, 1001, 30000]):
        enc = AnswerEncoder(fmt, 24000)
        pieces = np.split(answer, cuts)
        out = b"".join(enc.encode(float32_to_pcm16(p)) for p in pieces) + enc.flush()
        got = fmt.decode(out)
        assert got.shape == whole.shape == (16000,)
        assert np.mean(got != whole) < 1e-3
        assert enc.flush() == b""  # a second flush adds nothing


def test_a_pcm_answer_is_sent_as_the_engine_made_it():
    enc = AnswerEncoder(PCM, 24000)
    chunk = float32_to_pcm16(np.linspace(-0.5, 0.5, 9600))
    assert enc.encode(chunk) == chunk and enc.flush() == b""
