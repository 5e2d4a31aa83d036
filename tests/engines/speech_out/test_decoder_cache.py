"""The full-context decoder's cache of earlier chunks (pages) as a server runs it: voices are cached with their
pages and dropped, least recent first, when answers need the room; a voice an answer speaks in, and the default
voice, stay; every page comes back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.speech_out import CodecDecoder, Voice
from engines.speech_out.flow.pages import DecoderCacheFull, EstimatorPages

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _decoder(pages: int) -> CodecDecoder:
    cfg = CodecDecoder.load("tiny-random", vocoder="hift", context="window").cfg.flow
    page = EstimatorPages.page_bytes(cfg.n_timesteps, cfg.est_n_blocks * (2 + cfg.est_mid_blocks), 20,
                                     cfg.est_heads * cfg.est_head_dim, torch.float32)
    dec = CodecDecoder.load("tiny-random", vocoder="hift", cache_gib=pages * page / 2**30)
    assert dec.full.pages.n_pages == pages
    return dec


def test_answers_take_the_room_of_voices_no_answer_speaks_in():
    dec = _decoder(14)
    a, b = Voice.random(seed=31, n_codes=23), Voice.random(seed=32, n_codes=23)  # 4 shared pages each
    dec.prepared(dec.default_voice)  # 4 pages (25 codes)
    dec.prepared(a)
    speaking = dec.open_stream("b", voice=b)  # b is in use from here on
    assert dec.full.pages.n_free == 14 - 12
    s = dec.open_stream("s")
    s.add(np.arange(10) % 16384)
    assert len(s.take_jobs()) == 1  # the prompt's tail of 5 and 5 codes (and 3 ahead): 2 pages, the last free ones
    assert dec.full.pages.n_free == 0 and dec.voices.cached(a)
    s.add(np.arange(8) % 16384)
    assert len(s.take_jobs()) == 2  # 2 pages more: a, the least recent voice no answer speaks in, gives its 4
    assert dec.full.pages.n_free == 2 and not dec.voices.cached(a)
    assert dec.voices.cached(b) and dec.voices.cached(dec.default_voice)
    s.add(np.arange(5 * 8) % 16384)
    with pytest.raises(DecoderCacheFull):  # b is spoken in and the default voice stays: nothing more to drop
        s.take_jobs()
    s.close()
    speaking.close()
    dec.check_idle_cache()


def test_a_voice_dropped_meanwhile_is_made_again_for_the_stream_that_asks():
    dec = _decoder(20)
    v = Voice.random(seed=33, n_codes=23)
    first = dec.prepared(v)
    dec.voices.reclaim(dec.full.pages.n_pages)  # drops every idle voice but the default one
    s = dec.open_stream("s", voice=v)
    assert s.flow_state.voice is not first and s.flow_state.shared == s.flow_state.voice.pages != []
    s.close()
    dec.check_idle_cache()
