"""Token sampling and incremental detokenization for streaming."""

from __future__ import annotations

import torch


class Sampler:
    """Greedy at temperature 0; otherwise temperature + nucleus (top-p) sampling."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self._gen = torch.Generator()
        self._gen.manual_seed(seed if seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id."""
        if self.temperature <= 0:
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
