"""Token sampling and incremental detokenization for streaming.

A decode step's logits [B, V] reach the host once (`read_logits`): every row's argmax, plus the
full rows whose sampler draws or whose logprobs are wanted, in one copy (the step's one
device->host sync, `_to_host`). Samplers and logprobs then work on host values only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostLogits:
    """What one step's logits gave the host: top[b] the argmax of row b, rows[b] the fp32 row [V]
    where it was asked for."""

    top: list[int]
    rows: dict[int, torch.Tensor]


def read_logits(logits: torch.Tensor, want_rows: Sequence[bool]) -> HostLogits:
    """logits [B, V] on any device -> every row's argmax and the rows where want_rows[b], in one read."""
    B, V = logits.shape
    if V >= 1 << 24:
        raise ValueError(f"a vocabulary of {V} ids is not exact in fp32; read_logits packs ids as fp32")
    wanted = [b for b, want in enumerate(want_rows) if want]
    parts = [torch.argmax(logits, dim=-1).float()]  # [B]: ids below 2^24 are exact in fp32
    parts += [logits[b].float() for b in wanted]  # [V] each
    host = _to_host(torch.cat(parts).detach())  # [B + F*V]
    rows = {b: host[B + i * V:B + (i + 1) * V] for i, b in enumerate(wanted)}  # [V] each
    return HostLogits([int(x) for x in host[:B].tolist()], rows)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """THE device->host sync of a decode step (and of the first token): its tokens, once."""
    return t.cpu()


class Sampler:
    """Greedy at temperature 0; otherwise temperature + nucleus (top-p) sampling."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self._gen = torch.Generator()
        self._gen.manual_seed(seed if seed is not None else torch.seed())

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def pick(self, top: int, row: torch.Tensor | None) -> int:
        """The next token from a `read_logits` row: its argmax when greedy, else a draw from row [V] (host)."""
        return top if self.greedy else self(row)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id."""
        if self.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)  # [V]
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)  # [V]
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > self.top_p  # keep the smallest set reaching top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self._gen))


class StreamDecoder:
    """Turns token ids into text deltas; holds back incomplete UTF-8 and possible stop strings."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token. Returns (new text safe to emit, whether a stop string was hit)."""
        self._ids.append(token_id)
        full = self._tok.decode(self._ids, skip_special_tokens=True)
        for s in self._stop:
            at = full.find(s)
            if at >= 0:
                self.text = full[:at]
                delta = self.text[self._emitted:]
                self._emitted = len(self.text)
                return delta, True
        self.text = full
        safe = len(full)
        if full.endswith("\ufffd"):
            safe = len(full.rstrip("\ufffd"))
        for s in self._stop:  # a stop string may be starting at the end: wait
            for n in range(min(len(s) - 1, safe), 0, -1):
                if full[:safe].endswith(s[:n]):
                    safe -= n
                    break
        delta = full[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return delta, False

    def flush(self) -> str:
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
