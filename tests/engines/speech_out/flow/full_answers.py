"""Answers streamed chunk by chunk through a FullContextFlow, recording the noise each chunk drew, so that the chunk
model's whole-sequence decode (`reference.py`) can be run on the same noise: shared by the CPU and GPU tests."""

from __future__ import annotations

import torch

from engines.speech_out.flow.full_context import VOICE_NOISE_SEED, FullContextFlow
from engines.speech_out.flow.reference import reference_mel


def voice_inputs(P: int, seed: int):
    """A voice prompt's codes [P], mel [80, 4P] and x-vector [192], random from `seed`."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16384, (P,), generator=g)
    return codes, -5 + torch.randn(80, 4 * P, generator=g), torch.randn(192, generator=g)


class Answer:
    """One answer streamed chunk by chunk through a FullContextFlow, recording the noise each chunk drew."""

    def __init__(self, fc: FullContextFlow, voice, codes: list[int], seed: int) -> None:
        self.fc, self.voice, self.state = fc, voice, fc.new_state(voice)
        self.seq, self.i = voice.tail + codes, 0
        self.gen = torch.Generator(device=fc.flow.device).manual_seed(seed)
        self.mel, self.z = [], []

    def job(self, n: int | None = None):
        """The next job: a chunk, or n codes (several chunks, as an answer's first job). Its row, n, its lookahead."""
        n = min(5, len(self.seq) - self.i) if n is None else n
        look = self.seq[self.i + n:self.i + n + 3]
        self.fc.reserve(self.state, self.fc.pages_for(n, 5))
        g = torch.Generator(device=self.gen.device)
        g.set_state(self.gen.get_state())
        for i in range(0, n, 5):  # the flow draws each chunk's noise in turn
            self.z.append(torch.randn(80, 4 * min(5, n - i), generator=g, device=self.gen.device))
        return self.seq[self.i:self.i + n] + look + [0] * (3 - len(look)), n, len(look)

    def took(self, mel: torch.Tensor, n: int) -> None:
        self.mel.append(mel[:, self.state.skip:])
        self.i += n

    @property
    def done(self) -> bool:
        return self.i >= len(self.seq)

    def reference(self, flow, pcodes, pmel, codes, chunk: bool = True) -> torch.Tensor:
        dev = self.gen.device
        g = torch.Generator(device=dev).manual_seed(VOICE_NOISE_SEED)
        vz = torch.randn(80, 4 * self.voice.n_codes, generator=g, device=dev)
        return reference_mel(flow, pcodes, pmel, self.voice.spks, codes, torch.cat([vz, *self.z], 1), chunk)


def decode_in_rounds(fc: FullContextFlow, answers: list[Answer], first: bool = False) -> None:
    """Every answer decoded to its end as the codec worker's rounds decode them: answers join a round apart (other
    page counts side by side), one batch per job length; `first`: each answer's first job is its voice's tail and its
    first codes up to a chunk boundary (several chunks in one call)."""
    rnd = 0
    while not all(a.done for a in answers):
        live = [a for k, a in enumerate(answers) if not a.done and k <= rnd]
        jobs = [(a, *a.job(-(-(len(a.voice.tail) + 5) // 5) * 5 if first and a.i == 0 else None)) for a in live]
        for n in {j[2] for j in jobs}:
            group = [j for j in jobs if j[2] == n]
            mel = fc.decode_chunk([j[0].state for j in group], torch.tensor([j[1] for j in group]), n,
                                  [j[3] for j in group], [j[0].gen for j in group])
            for b, j in enumerate(group):
                j[0].took(mel[b], n)
        rnd += 1


def alone(fc: FullContextFlow, flow, P: int, N: int, seed: int):
    """An answer of N codes after a prompt of P, decoded alone; returns it, its voice, the prompt and the codes."""
    pcodes, pmel, xv = voice_inputs(P, seed)
    codes = torch.randint(0, 16384, (N,), generator=torch.Generator().manual_seed(seed + 1))
    voice = fc.prepare_voice(pcodes, pmel, xv)
    a = Answer(fc, voice, codes.tolist(), seed)
    while not a.done:
        row, n, nl = a.job()
        a.took(fc.decode_chunk([a.state], torch.tensor([row]), n, [nl], [a.gen])[0], n)
    return a, voice, pcodes, pmel, codes
