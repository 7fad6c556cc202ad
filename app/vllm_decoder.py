"""The `vllm` decoder: Blendserve retrieves and blends, a stock vLLM server decodes.

    QueryRun._submit (event loop)                         engine loop thread
    -----------------------------                         ------------------
    VllmClient.submit(plan, gens, layout):
      blend / full_reuse, not a repeat: the engine   ->   prefill (max_tokens 1); once its last layer is
        prefills (`EngineClient.submit`, `export`)          done `export` copies the KV into a segment
    VllmStream (iterated by QueryRun.deltas):        <-   (`executor.kv_export`), then stores missed
      await the segment's handle                          passages as usual
      POST {vllm}/v1/completions {prompt: token ids, kv_transfer_params: {blendserve_kv: handle}}
      vLLM's chunks -> (index, Delta); the choices' ends -> BlendResult

An exact repeat of a prompt this service handed over recently (same tenant, same mode) is not
blended again: vLLM holds its KV in its prefix cache (vLLM's `cached_tokens` confirms; a miss there
drops the record). vLLM's prefix cache is salted by tenant and KV recipe (`vllm_salt`): blended KV
never answers a full_prefill request there. full_prefill and prefix_cache go to vLLM directly: its own prefix caching is the
prefix_cache mode. vLLM down: `DecoderUnavailable` (503, Retry-After), nothing stored is lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from app.service import ServiceError
from blend_engine.cancel import DeadlineExceeded
from blend_engine.client import EngineClient, RequestStream
from blend_engine.errors import InputError
from blend_engine.executor.kv_export import Exported, export
from blend_engine.generation import Delta
from blend_engine.layout import PromptLayout
from blend_engine.scheduler.admission import Ticket
from blend_engine.scheduler.kv_blocks import recipes
from blend_engine.types import BlendPlan, BlendReport, BlendResult, GenerationConfig, Mode, TokenLogprob
from blendserve_config.groups import DecoderSettings
from blendserve_vllm.segments import RedisPublisher, SegmentError, SegmentPublisher, token_hash

logger = logging.getLogger(__name__)
PARAM = "blendserve_kv"  # blendserve_vllm.connector.PARAM (that module needs vLLM to import)
BLENDED = (Mode.BLEND, Mode.FULL_REUSE)  # the modes Blendserve's engine computes for vLLM
RECENT = 4096  # prompts remembered as handed over (exact repeats go to vLLM's prefix cache)
BLEND_ONLY = (GenerationConfig(max_tokens=1),)  # the blend's own request: prefill, then one token nobody reads


class DecoderUnavailable(ServiceError):
    """The vLLM decoder did not answer (down, restarting, or overloaded): retry later."""

    status_code = 503
    code = "decoder_unavailable"
    headers = {"Retry-After": "5"}


class DecoderRejected(ServiceError):
    """vLLM refused the request as asked (its 4xx): the caller's to change."""

    status_code = 400
    code = "invalid_request"


@dataclass
class DecoderSplit:
    """Where a vLLM-decoded answer's time went (milliseconds from submit)."""

    blend_ms: float = 0.0  # Blendserve's prefill, until the segment was written (0: not blended)
    handover_ms: float = 0.0  # copying the KV into the segment (part of blend_ms)
    handover_bytes: int = 0
    decoder_ttft_ms: float = 0.0  # vLLM: request sent until its first token
    decoder_ms: float = 0.0  # vLLM: request sent until its last chunk
    total_ms: float = 0.0  # submit until the last chunk
    cached_tokens: int | None = None  # prompt tokens vLLM did not compute (its prefix cache + the handed KV)
    repeat: bool = False  # an exact repeat served from vLLM's prefix cache


@dataclass(frozen=True)
class Handoff:
    """What the engine loop passes back once the prefill is done."""

    exported: Exported
    report: BlendReport
    explanation: Any


def report_for(plan: BlendPlan, n_tokens: int, source: str) -> BlendReport:
    """The report of a prompt Blendserve did not prefill (vLLM computed what it did not hold)."""
    return BlendReport(mode=plan.mode.value, recompute_ratio=0.0, ratio_source=source, context_tokens=n_tokens,
                       recomputed_tokens=n_tokens, recomputed_positions=(), selected_per_layer=(), cache_hits=0,
                       cache_misses=0, prefix_tokens_reused=0, repaired_chunks=0, assemble_ms=0.0, recompute_ms=0.0,
                       load_ms=0.0, load_wait_ms=0.0, prefill_ms=0.0)


def vllm_salt(plan: BlendPlan) -> str:
    """vLLM's `cache_salt` for a plan: the tenant's namespace and the recipe of the KV it leaves in
    vLLM's prefix cache (`kv_blocks.recipes`), so that blended KV never serves an exact mode there,
    nor one tenant's another's."""
    return f"{plan.cache_salt or ''}|{recipes(plan.mode)[1]}"


class VllmClient:
    """The routes' engine client when `BLENDSERVE_DECODER_KIND=vllm`: the same `admit` / `submit`
    as `EngineClient`, whose stream `QueryRun` reads unchanged."""

    def __init__(self, engine_client: EngineClient, settings: DecoderSettings, publisher: SegmentPublisher | RedisPublisher,
                 tokenizer_decode: Any) -> None:
        self.engine_client, self.settings, self.publisher = engine_client, settings, publisher
        self.engine = engine_client.engine
        self.decode = tokenizer_decode  # token ids -> text (the logprobs' alternatives)
        self.http = httpx.AsyncClient(base_url=settings.vllm_url.rstrip("/"),
                                      timeout=httpx.Timeout(None, connect=5.0))
        self.model: str | None = settings.vllm_model
        self._recent: OrderedDict[tuple[str, str], None] = OrderedDict()

    # ------------------------------------------------------------------ health
    async def problem(self) -> str | None:
        """Why vLLM cannot decode now (None: it answers, and its model is known)."""
        try:
            r = await self.http.get("/health", timeout=5.0)
            if r.status_code != 200:
                return f"the vLLM decoder at {self.settings.vllm_url} answers /health with {r.status_code}"
            if self.model is None:
                models = (await self.http.get("/v1/models", timeout=5.0)).json()["data"]
                self.model = models[0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            return f"the vLLM decoder at {self.settings.vllm_url} does not answer: {exc or type(exc).__name__}"
        return None

    async def aclose(self) -> None:
        await self.http.aclose()

    # ------------------------------------------------------------------ the engine client's surface
    def admit(self, timeout_s: float | None) -> Ticket:
        return self.engine_client.admit(timeout_s)

    def prepare(self, plan: BlendPlan, gens: Sequence[GenerationConfig], layout: PromptLayout) -> Any:
        """The blend's engine plan (for its one token), on any thread; None when nothing is blended
        (an exact mode, or a repeat vLLM holds): `submit` decides again and plans what it still needs."""
        if not self._blends(plan, self._key(plan, layout.token_ids())):
            return None
        return self.engine_client.prepare(plan, BLEND_ONLY, layout)

    def submit(self, plan: BlendPlan, gens: Sequence[GenerationConfig], timeout_s: float | None = None,
               layout: PromptLayout | None = None, ticket: Ticket | None = None, prep: Any = None) -> VllmStream:
        """Start the blend (when the mode needs one and vLLM does not hold the prompt) and return the
        stream that hands it to vLLM. InputError for what vLLM cannot do."""
        layout = layout if layout is not None else self.engine.layout(plan)
        ids = layout.token_ids()
        key = self._key(plan, ids)
        blends = self._blends(plan, key)
        if plan.explain and not blends:
            raise InputError("explain needs Blendserve's prefill: with BLENDSERVE_DECODER_KIND=vllm it is served for "
                             "mode blend or full_reuse on a prompt vLLM does not already hold")
        stream = VllmStream(self, plan, list(gens), ids, key, timeout_s,
                            repeat=plan.mode in BLENDED and not blends)
        if blends:
            stream.start_blend(layout, ticket, prep)
        return stream

    @staticmethod
    def _key(plan: BlendPlan, ids: list[int]) -> tuple[str, str]:
        """The prompt as vLLM's prefix cache knows it: its salt (`vllm_salt`) and token ids' hash."""
        return vllm_salt(plan), token_hash(ids)

    def _blends(self, plan: BlendPlan, key: tuple[str, str]) -> bool:
        """Blendserve computes the KV: a blended mode, and not a prompt handed over recently."""
        return plan.mode in BLENDED and key not in self._recent

    def remember(self, key: tuple[str, str]) -> None:
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)

    def forget(self, key: tuple[str, str]) -> None:
        self._recent.pop(key, None)


class VllmStream:
    """One request decoded by vLLM, read like `RequestStream`: `(index, Delta)` items, then
    `results`; `abort()` stops both sides; `split` says where the time went."""

    def __init__(self, client: VllmClient, plan: BlendPlan, gens: list[GenerationConfig], ids: list[int],
                 key: tuple[str, str], timeout_s: float | None, repeat: bool) -> None:
        self.client, self.plan, self.gens, self.ids, self.key = client, plan, gens, ids, key
        self.timeout_s, self.t0 = timeout_s, time.perf_counter()
        self.results: list[BlendResult | None] = [None] * len(gens)
        self.split = DecoderSplit(repeat=repeat)
        self._handoff: asyncio.Future[Handoff] | None = None
        self._engine: RequestStream | None = None
        self._drain: asyncio.Task | None = None
        self._aborted = False

    # ------------------------------------------------------------------ the blend (engine loop)
    def start_blend(self, layout: PromptLayout, ticket: Ticket | None, prep: Any = None) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Handoff] = loop.create_future()
        publisher = self.client.publisher

        def on_prefilled(cache: Any, state: Any) -> None:  # the engine loop's thread
            exported = export(cache, state.layout.token_ids()[:-1], publisher)
            handoff = Handoff(exported, state.report, state.explanation)
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(handoff))

        self._engine = self.client.engine_client.submit(self.plan, BLEND_ONLY, self.timeout_s, layout, ticket,
                                                        export=on_prefilled, prep=prep)
        self._handoff = fut
        self._drain = asyncio.ensure_future(self._drain_engine(fut))

    async def _drain_engine(self, fut: asyncio.Future) -> None:
        """Run the engine's request to its end (it stores missed passages after the hand-over); its
        failure before the hand-over is the request's."""
        try:
            async for _ in self._engine:
                pass
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting stream, or logged
            if not fut.done():
                fut.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                logger.warning("the blend's engine request failed after its hand-over: %s", exc)

    # ------------------------------------------------------------------ reading
    def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        return self._items()

    async def _items(self) -> AsyncIterator[tuple[int, Delta]]:
        handoff = await self._await_handoff()
        body = self._body(handoff)
        texts = [""] * len(self.gens)
        tokens: list[list[int]] = [[] for _ in self.gens]
        logprobs: list[list[TokenLogprob]] = [[] for _ in self.gens]
        finish: list[str | None] = [None] * len(self.gens)
        ttft: list[float | None] = [None] * len(self.gens)
        usage: dict = {}
        sent = time.perf_counter()
        async for chunk in self._chunks(body):
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                i = int(c["index"])
                lps = self._logprobs(c.get("logprobs"), self.gens[i].logprobs)
                tokens[i].extend(lp.token_id for lp in lps)
                if ttft[i] is None and (c.get("text") or lps):
                    ttft[i] = (time.perf_counter() - self.t0) * 1e3
                    self.split.decoder_ttft_ms = self.split.decoder_ttft_ms or (time.perf_counter() - sent) * 1e3
                if self.gens[i].logprobs is not None:
                    logprobs[i].extend(lps)
                texts[i] += c.get("text") or ""
                if c.get("finish_reason"):
                    finish[i] = c["finish_reason"]
                if c.get("text") or (self.gens[i].logprobs is not None and lps):
                    yield i, Delta(c.get("text") or "", tuple(lps) if self.gens[i].logprobs is not None else ())
        self._finish(handoff, texts, tokens, logprobs, finish, ttft, usage, sent)

    async def _await_handoff(self) -> Handoff | None:
        if self._handoff is None:
            return None
        left = None if self.timeout_s is None else max(0.0, self.timeout_s - (time.perf_counter() - self.t0))
        try:
            handoff = await asyncio.wait_for(asyncio.shield(self._handoff), left)
        except (TimeoutError, asyncio.TimeoutError):
            self.abort()
            raise DeadlineExceeded(f"request exceeded its timeout of {self.timeout_s:g} s") from None
        except (SegmentError, OSError) as exc:  # shared memory full, Redis down: not the caller's fault
            raise DecoderUnavailable(f"the KV hand-over to vLLM failed: {exc}") from exc
        self.split.blend_ms = (time.perf_counter() - self.t0) * 1e3
        self.split.handover_ms, self.split.handover_bytes = handoff.exported.copy_ms, handoff.exported.nbytes
        return handoff

    def _body(self, handoff: Handoff | None) -> dict:
        g = self.gens[0]
        body: dict[str, Any] = {
            "model": self.client.model, "prompt": self.ids, "max_tokens": g.max_tokens, "n": len(self.gens),
            "temperature": g.temperature, "top_p": g.top_p, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": g.ignore_eos,
            "logprobs": g.logprobs if g.logprobs is not None else 0, "return_tokens_as_token_ids": True}
        if g.stop:
            body["stop"] = list(g.stop)
        if g.seed is not None:
            body["seed"] = g.seed
        body["cache_salt"] = self.key[0]
        if handoff is not None:
            body["kv_transfer_params"] = {PARAM: handoff.exported.handle}
        return body

    async def _chunks(self, body: dict) -> AsyncIterator[dict]:
        """vLLM's streamed chunks; its errors as the service's (503 when it does not answer)."""
        url = self.client.settings.vllm_url
        left = None if self.timeout_s is None else max(0.1, self.timeout_s - (time.perf_counter() - self.t0))
        try:
            async with self.client.http.stream("POST", "/v1/completions", json=body,
                                               timeout=httpx.Timeout(left, connect=5.0)) as r:
                if r.status_code >= 400:
                    await self._raise_for(r)
                async for line in r.aiter_lines():
                    if self._aborted:
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise DecoderUnavailable(f"the vLLM decoder failed mid-stream: {chunk['error']}")
                    yield chunk
        except httpx.TimeoutException:
            raise DecoderUnavailable(f"the vLLM decoder at {url} did not answer within the request's timeout of "
                                     f"{self.timeout_s:g} s (overloaded or stalled)") from None
        except httpx.HTTPError as exc:
            raise DecoderUnavailable(f"the vLLM decoder at {url} does not answer: {exc or type(exc).__name__}") from exc

    @staticmethod
    async def _raise_for(r: httpx.Response) -> None:
        text = (await r.aread()).decode("utf-8", "replace")
        try:
            message = json.loads(text).get("error", {}).get("message") or text
        except (ValueError, AttributeError):
            message = text
        if 400 <= r.status_code < 500:
            raise DecoderRejected(f"the vLLM decoder refused the request: {message[:500]}")
        raise DecoderUnavailable(f"the vLLM decoder failed ({r.status_code}): {message[:500]}")

    def _logprobs(self, lp: dict | None, k: int | None) -> list[TokenLogprob]:
        """vLLM's completions logprobs of one chunk (tokens as `token_id:N`) as TokenLogprob."""
        if not lp or not lp.get("tokens"):
            return []
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        out = []
        for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], tops):
            tid = _token_id(tok)
            alts = sorted(((self.client.decode([_token_id(t)]), float(v)) for t, v in (top or {}).items()),
                          key=lambda a: -a[1])[: k or 0]
            out.append(TokenLogprob(tid, self.client.decode([tid]), float(value), tuple(alts)))
        return out

    def _finish(self, handoff: Handoff | None, texts: list[str], tokens: list[list[int]],
                logprobs: list[list[TokenLogprob]], finish: list[str | None], ttft: list[float | None],
                usage: dict, sent: float) -> None:
        now = time.perf_counter()
        self.split.decoder_ms, self.split.total_ms = (now - sent) * 1e3, (now - self.t0) * 1e3
        details = usage.get("prompt_tokens_details") or {}
        self.split.cached_tokens = details.get("cached_tokens")
        T = len(self.ids)
        if handoff is not None:
            report = handoff.report
            self.client.remember(self.key)
        else:
            source = "vllm_prefix_cache" if self.split.repeat else "mode"
            report = replace(report_for(self.plan, T, source), recomputed_tokens=T - (self.split.cached_tokens or 0))
            if self.split.repeat and (self.split.cached_tokens or 0) < (T - 1) // 2:
                self.client.forget(self.key)  # vLLM no longer held it: blend it again next time
        for i in range(len(self.gens)):
            self.results[i] = BlendResult(
                text=texts[i], token_ids=tuple(tokens[i]), finish_reason=_finish_reason(finish[i]), report=report,
                ttft_ms=ttft[i] if ttft[i] is not None else self.split.total_ms,
                # the choices ran together in one vLLM request: the first carries the time (QueryRun sums them)
                total_ms=self.split.total_ms if i == 0 else 0.0, store_ms=0.0,
                explanation=None if handoff is None else handoff.explanation, logprobs=tuple(logprobs[i]))

    def abort(self) -> None:
        """Stop the blend (if running) and stop reading vLLM (closing the response cancels it there)."""
        self._aborted = True
        if self._engine is not None and self._handoff is not None and not self._handoff.done():
            self._engine.abort()


def _token_id(tok: str) -> int:
    """`token_id:123` (vLLM's `return_tokens_as_token_ids`) -> 123."""
    return int(tok.rsplit(":", 1)[-1])


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"
