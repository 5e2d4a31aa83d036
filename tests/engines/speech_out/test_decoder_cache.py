"""The full-context decoder's cache of earlier chunks (pages) as a server runs it: voices are cached with their
pages and dropped, least recent first, when answers need the room; a voice an answer speaks in, and the default
voice, stay; with the cache short, long answers forget their oldest chunks only once no such voice is left; every
page comes back."""

from __future__ import annotations

import numpy as np
import pytest

from engines.speech_out import CodecDecoder, Voice
from engines.speech_out.decoder import cache_page_bytes, default_cache_gib
from engines.speech_out.flow.pages import DecoderCacheFull
from tests.engines.speech_out.decoder_rounds import small_cache_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(dec: CodecDecoder, s) -> list:
    """The stream's jobs decoded one by one as the codec worker's rounds would: PCM, or the error that ended it."""
    return [dec.run_jobs([j])[0] for j in s.take_jobs()]


def test_the_default_cache_is_40_gib_on_a_gpu_or_under_half_its_free_memory_if_less():
    gib = 2**30
    assert default_cache_gib(True, 104 * gib) == 40.0  # an H200 after the model's weights and the encoder's slots
    assert default_cache_gib(True, 40 * gib) == pytest.approx(18.0)  # an 80 GB card there: room for the KV pool
    assert default_cache_gib(False) == 0.5


def test_a_decoder_loaded_without_a_cache_size_takes_the_default():
    dec = CodecDecoder.load("tiny-random")
    page = cache_page_bytes(dec.cfg, dec.full.est_dtype)
    assert dec.full.pages.n_pages == int(default_cache_gib(False) * 2**30 // page)


def test_answers_take_the_room_of_voices_no_answer_speaks_in():
    dec = small_cache_decoder(14, vocoder="hift")
    dec.full.low_water = 0  # voices are dropped only once no page is free
    a, b = Voice.random(seed=31, n_codes=23), Voice.random(seed=32, n_codes=23)  # 4 shared pages each
    dec.prepared(dec.default_voice)  # 4 pages (25 codes)
    dec.prepared(a)
    speaking = dec.open_stream("b", voice=b)  # b is in use from here on
    assert dec.full.pages.n_free == 14 - 12
    s = dec.open_stream("s")
    s.add(np.arange(10) % 16384)
    out = _run(dec, s)  # the prompt's tail of 5 and 5 codes (and 3 ahead): 2 pages, the last free ones
    assert len(out) == 1 and isinstance(out[0], np.ndarray)
    assert dec.full.pages.n_free == 0 and dec.voices.cached(a)
    s.add(np.arange(8) % 16384)
    assert all(isinstance(o, np.ndarray) for o in _run(dec, s))  # 2 pages more: a, the least recent voice no
    assert dec.full.pages.n_free == 2 and not dec.voices.cached(a)  # answer speaks in, gives its 4
    assert dec.voices.cached(b) and dec.voices.cached(dec.default_voice)
    s.add(np.arange(5 * 8) % 16384)
    out = _run(dec, s)  # b is spoken in and the default voice stays: nothing more to drop
    assert [type(o) for o in out[:3]] == [np.ndarray, np.ndarray, DecoderCacheFull]
    s.close()
    speaking.close()
    dec.check_idle_cache()


def test_with_the_cache_short_voices_nobody_speaks_in_go_before_an_answer_forgets_its_chunks():
    dec = small_cache_decoder(14, vocoder="hift")
    dec.full.kept_pages, dec.full.low_water = 2, 2
    a = Voice.random(seed=31, n_codes=23)
    dec.prepared(dec.default_voice)
    dec.prepared(a)  # 4 + 4 pages
    s = dec.open_stream("s")
    s.add(np.arange(10 + 5 * 2) % 16384)
    assert all(isinstance(o, np.ndarray) for o in _run(dec, s))  # 2 pages, then 2 more: the room left at 2
    assert dec.voices.cached(a) and dec.full.forgotten == 0 and dec.full.pages.n_free == 2
    s.add(np.arange(5) % 16384)
    assert all(isinstance(o, np.ndarray) for o in _run(dec, s))  # short: a goes, the answer keeps its chunks
    assert not dec.voices.cached(a) and dec.full.forgotten == 0 and dec.full.pages.n_free == 5
    s.add(np.arange(5 * 6) % 16384)
    assert all(isinstance(o, np.ndarray) for o in _run(dec, s))  # short again, no voice to drop: it forgets
    assert dec.full.forgotten > 0 and len(s.flow_state.pages) + dec.full.forgotten == 2 + 2 + 1 + 6
    s.close()
    dec.check_idle_cache()


def test_a_voice_dropped_meanwhile_is_made_again_for_the_stream_that_asks():
    dec = small_cache_decoder(20, vocoder="hift")
    v = Voice.random(seed=33, n_codes=23)
    first = dec.prepared(v)
    dec.voices.reclaim(dec.full.pages.n_pages)  # drops every idle voice but the default one
    s = dec.open_stream("s", voice=v)
    assert s.flow_state.voice is not first and s.flow_state.shared == s.flow_state.voice.pages != []
    s.close()
    dec.check_idle_cache()


def test_the_benchs_rounds_raise_a_full_cache_rather_than_return_it():
    from engines.bench.codec_rounds import SteadyRounds

    dec = small_cache_decoder(6, vocoder="hift")  # the default voice's 4 pages and 2 more: one answer's first job
    rounds = SteadyRounds(dec, 2)
    rounds.feed()  # each answer's first job: the prompt's tail and 5 codes, 2 pages
    with pytest.raises(DecoderCacheFull):
        rounds.decode()
    rounds.close()
    dec.check_idle_cache()
