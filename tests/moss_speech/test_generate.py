"""`moss-speech generate` on the tiny preset and on a real-layout checkpoint directory."""

from __future__ import annotations

import json

from moss_speech.cli import main


def test_generate_audio_answer_prints_codes(capsys):
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "12", "--greedy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] in ("length", "stop")
    assert all(0 <= c < 16384 for c in out["audio_codes"])
    assert len(out["audio_codes"]) + len(out["text_tokens"]) <= 12


def test_generate_text_answer_from_checkpoint_dir(tiny_checkpoint, capsys):
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "hello", "--output-modality", "text",
            "--max-new-tokens", "8", "--seed", "3", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == first  # seeded: reproducible
    assert len(first["text_tokens"]) + len(first["audio_codes"]) >= 1
