"""Reliability against a running service: a bad-input battery, then goodput under load.

    python -m benchmarks.load.reliability --url http://127.0.0.1:8000 [--api-key KEY]
        [--duration 120] [--clients 8] [--max-tokens 16] [--top-k 3] [--skip-battery] [--json OUT]

1. Battery: ~60 hostile requests (lone UTF-16 surrogates in every string field of every endpoint,
   control characters in document ids, oversized titles, NaN, wrong types, broken JSON, other
   content types, unknown paths). Every answer must be a 4xx with a JSON error; a 5xx is a defect.
2. Lone client: one client sends retrieval queries back to back for `--duration` seconds: the
   answers a single client gets, and one query's time (p50).
3. Load: `--clients` clients do the same at once for `--duration` seconds. Goodput = answers
   (HTTP 200) per second. The target (issue 18): with the server's BLENDSERVE_SERVICE_REQUEST_TIMEOUT_S at
   twice one query's time and a small queue (BLENDSERVE_SERVICE_MAX_QUEUE=4), the loaded service answers at
   least 80% of what the lone client got in the same time, and gives no 5xx other than 503/504
   load shedding (counted apart). The table reports sent, status counts, goodput, p50/p99 latency
   of answers and the 5xx count per phase.

Questions are "What is <title> known for?" over the titles of `--corpus` (default: the bundled
sample corpus the service ingests on its first start).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_corpus" / "hotpotqa_sample.jsonl"


# ====================================================================== the battery
@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: Any = None  # JSON value (sent with \\u escapes, so lone surrogates travel as escapes)
    raw: bytes | None = None  # sent as is
    content_type: str = "application/json"


SURROGATE = "\ud800"  # a lone surrogate: not encodable as UTF-8
OK_USER = [{"role": "user", "content": "hi"}]


def _surrogates() -> list[Case]:
    """A lone surrogate in each string field of every endpoint (422 naming the field)."""
    return [
        Case("ingest title surrogate", "POST", "/v1/documents", {"documents": [{"text": "ok", "title": "\ud83d"}]}),
        Case("ingest text surrogate", "POST", "/v1/documents", {"documents": [{"text": f"ok {SURROGATE}"}]}),
        Case("ingest doc_id surrogate", "POST", "/v1/documents", {"documents": [{"text": "ok", "doc_id": f"a{SURROGATE}"}]}),
        Case("query question surrogate", "POST", "/v1/query", {"question": f"q{SURROGATE}?"}),
        Case("query doc title surrogate", "POST", "/v1/query",
             {"question": "q?", "documents": [{"title": SURROGATE, "text": "p"}]}),
        Case("query doc text surrogate", "POST", "/v1/query", {"question": "q?", "documents": [{"text": f"p{SURROGATE}"}]}),
        Case("chat content surrogate", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}),
        Case("chat text part surrogate", "POST", "/v1/chat/completions",
             {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}),
        Case("chat system surrogate", "POST", "/v1/chat/completions",
             {"messages": [{"role": "system", "content": SURROGATE}, *OK_USER]}),
        Case("chat model surrogate", "POST", "/v1/chat/completions", {"model": SURROGATE, "messages": OK_USER}),
        Case("chat stop surrogate", "POST", "/v1/chat/completions", {"stop": [SURROGATE], "messages": OK_USER}),
        Case("chat name surrogate", "POST", "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]}),
        Case("chat doc title surrogate", "POST", "/v1/chat/completions",
             {"messages": OK_USER, "documents": [{"title": SURROGATE, "text": "p"}]}),
    ]


def _limits_and_types() -> list[Case]:
    """Values past a limit, out of range, or of the wrong type."""
    return [
        Case("huge title (9,000 words)", "POST", "/v1/documents",
             {"documents": [{"text": "ten words of text here and there", "title": "word " * 9000}]}),
        Case("huge inline title", "POST", "/v1/query", {"question": "q?", "documents": [{"title": "w " * 9000,
                                                                                       "text": "p"}]}),
        Case("NaN ratio", "POST", "/v1/query", raw=b'{"question": "q?", "recompute_ratio": NaN}'),
        Case("Infinity temperature", "POST", "/v1/query", raw=b'{"question": "q?", "temperature": Infinity}'),
        Case("string top_k", "POST", "/v1/query", {"question": "q?", "top_k": "3"}),
        Case("negative max_tokens", "POST", "/v1/query", {"question": "q?", "max_tokens": -1}),
        Case("huge max_tokens", "POST", "/v1/query", {"question": "q?", "max_tokens": 10**9}),
        Case("huge top_k", "POST", "/v1/query", {"question": "q?", "top_k": 10**9}),
        Case("ratio above 1", "POST", "/v1/query", {"question": "q?", "recompute_ratio": 1.5}),
        Case("unknown mode", "POST", "/v1/query", {"question": "q?", "mode": "turbo"}),
        Case("unknown field", "POST", "/v1/query", {"question": "q?", "bogus": 1}),
        Case("missing question", "POST", "/v1/query", {}),
        Case("blank question", "POST", "/v1/query", {"question": "   "}),
        Case("question not a string", "POST", "/v1/query", {"question": ["a"]}),
    ]


def _malformed_bodies() -> list[Case]:
    """Bodies that are not a JSON object, or not JSON at all."""
    return [
        Case("body is a list", "POST", "/v1/query", [1, 2]),
        Case("body is null", "POST", "/v1/query", raw=b"null"),
        Case("empty body", "POST", "/v1/query", raw=b""),
        Case("broken JSON", "POST", "/v1/query", raw=b'{"question": "q?"'),
        Case("invalid UTF-8", "POST", "/v1/query", raw=b'{"question": "\xff\xfe"}'),
        Case("form content type", "POST", "/v1/query", raw=b"question=q", content_type="application/x-www-form-urlencoded"),
        Case("text content type", "POST", "/v1/documents", raw=b"hello", content_type="text/plain"),
        Case("deeply nested JSON", "POST", "/v1/query", raw=b"[" * 5000 + b"]" * 5000),
    ]


def _documents_and_chat() -> list[Case]:
    """Documents and chat messages that break the schema."""
    return [
        Case("no documents", "POST", "/v1/documents", {"documents": []}),
        Case("empty document text", "POST", "/v1/documents", {"documents": [{"text": ""}]}),
        Case("document text not a string", "POST", "/v1/documents", {"documents": [{"text": 5}]}),
        Case("too many documents", "POST", "/v1/documents", {"documents": [{"text": "t"}] * 1000}),
        Case("oversized document", "POST", "/v1/documents", {"documents": [{"text": "x " * 200_000}]}),
        Case("empty inline documents", "POST", "/v1/query", {"question": "q?", "documents": []}),
        Case("chat without user", "POST", "/v1/chat/completions", {"messages": [{"role": "system", "content": "s"}]}),
        Case("chat empty messages", "POST", "/v1/chat/completions", {"messages": []}),
        Case("chat unknown role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
        Case("chat n=2", "POST", "/v1/chat/completions", {"messages": OK_USER, "n": 2}),
        Case("chat top_p 0", "POST", "/v1/chat/completions", {"messages": OK_USER, "top_p": 0}),
        Case("chat content number", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ]


def _paths() -> list[Case]:
    """Methods, paths and document ids the routes refuse."""
    return [
        Case("wrong method", "GET", "/v1/query"),
        Case("unknown path", "GET", "/v1/nothing-here"),
        Case("missing document", "GET", "/v1/documents/no-such-document-id"),
        Case("delete missing document", "DELETE", "/v1/documents/no-such-document-id"),
        Case("doc id traversal", "GET", "/v1/documents/..%2F..%2Fetc%2Fpasswd"),
        Case("doc id encoded newline", "GET", "/v1/documents/a%0Ab"),
        Case("doc id encoded surrogate", "GET", "/v1/documents/%ED%A0%80"),
    ]


def _control_characters_in_doc_ids() -> list[Case]:
    """Each control character in an ingested doc_id (422: ids are logged and shown)."""
    return [Case(f"doc_id with {label}", "POST", "/v1/documents",
                 {"documents": [{"text": "Some text.", "doc_id": f"bad{ch}id"}]})
            for ch, label in (("\n", "newline"), ("\r", "carriage return"), ("\x1b[31m", "ANSI escape"), ("\t", "tab"),
                              ("\x00", "NUL"), ("\u2028", "line separator"))]


def battery() -> list[Case]:
    """Every bad input the service must answer with a JSON 4xx, never a 5xx."""
    return [*_surrogates(), *_limits_and_types(), *_malformed_bodies(), *_documents_and_chat(), *_paths(),
            *_control_characters_in_doc_ids()]


def _send(client: httpx.Client, case: Case) -> tuple[int, bool]:
    """(status, answered with a JSON body)."""
    headers = {"content-type": case.content_type}
    content = case.raw if case.raw is not None else (json.dumps(case.body).encode() if case.body is not None else None)
    r = client.request(case.method, case.path, content=content, headers=headers if content is not None else None)
    try:
        r.json()
        is_json = True
    except ValueError:
        is_json = False
    return r.status_code, is_json


def run_battery(client: httpx.Client) -> dict:
    statuses: Counter[int] = Counter()
    defects: list[str] = []
    for case in battery():
        try:
            status, is_json = _send(client, case)
        except httpx.HTTPError as exc:
            defects.append(f"{case.name}: transport error {exc!r}")
            continue
        statuses[status] += 1
        if status >= 500 or not is_json or status < 400:
            defects.append(f"{case.name}: {status}{'' if is_json else ' (not JSON)'}")
    return {"sent": sum(statuses.values()) + sum(1 for d in defects if "transport" in d),
            "statuses": dict(sorted(statuses.items())), "defects": defects,
            "5xx": sum(n for s, n in statuses.items() if s >= 500)}


# ====================================================================== load
@dataclass
class Phase:
    name: str
    clients: int
    seconds: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # of answers (200), seconds
    errors: int = 0  # transport errors (no HTTP status)
    in_window: int = 0  # answers received before the phase's end (what the lone-client comparison uses)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values()) + self.errors

    @property
    def answers(self) -> int:
        return self.statuses.get(200, 0)

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        return {"phase": self.name, "clients": self.clients, "seconds": round(self.seconds, 1), "sent": self.sent,
                "statuses": dict(sorted(self.statuses.items())), "transport_errors": self.errors,
                "answers": self.answers, "answers_in_window": self.in_window,
                "goodput_per_s": round(self.answers / max(self.seconds, 1e-9), 3),
                "p50_ms": round(1e3 * _pct(lat, 50), 1) if lat else None,
                "p99_ms": round(1e3 * _pct(lat, 99), 1) if lat else None,
                "5xx": sum(n for s, n in self.statuses.items() if s >= 500),
                "faults": sum(n for s, n in self.statuses.items() if s >= 500 and s not in (503, 504))}


def _pct(sorted_values: list[float], p: float) -> float:
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def questions(corpus: Path) -> list[str]:
    titles: list[str] = []
    for line in corpus.read_text(encoding="utf-8").splitlines():
        try:
            title = json.loads(line).get("title")
        except ValueError:
            continue
        if title and title not in titles:
            titles.append(title)
    return [f"What is {t} known for?" for t in titles] or ["What is the capital of France?"]


def run_load(base: httpx.Client, url: str, headers: dict, phase: Phase, duration: float, qs: list[str],
             max_tokens: int, top_k: int, http_timeout: float) -> Phase:
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def client_loop(i: int) -> None:
        n = i
        with httpx.Client(base_url=url, headers=headers, timeout=http_timeout) as c:
            while time.monotonic() < stop_at:
                body = {"question": qs[n % len(qs)], "top_k": top_k, "max_tokens": max_tokens}
                n += phase.clients
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/query", json=body)
                except httpx.HTTPError:
                    with lock:
                        phase.errors += 1
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    phase.statuses[r.status_code] += 1
                    if r.status_code == 200:
                        phase.latencies.append(dt)
                        if time.monotonic() <= stop_at:
                            phase.in_window += 1
                if r.status_code == 503:  # shed: honour a short back-off like a polite client
                    time.sleep(min(1.0, float(r.headers.get("retry-after", "1"))))

    t0 = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(phase.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    phase.seconds = time.monotonic() - t0
    return phase


# ====================================================================== report
def table(battery_result: dict | None, phases: list[dict]) -> str:
    lines = ["| phase | sent | status counts | goodput (answers/s) | p50 ms | p99 ms | 5xx | 5xx not 503/504 |",
             "|---|---|---|---|---|---|---|---|"]
    if battery_result is not None:
        counts = ", ".join(f"{s}: {n}" for s, n in battery_result["statuses"].items())
        n5 = battery_result["5xx"]
        lines.append(f"| bad-input battery | {battery_result['sent']} | {counts} | - | - | - | {n5} | {n5} |")
    for p in phases:
        counts = ", ".join(f"{s}: {n}" for s, n in p["statuses"].items()) + (
            f", transport errors: {p['transport_errors']}" if p["transport_errors"] else "")
        lines.append(f"| {p['phase']} ({p['clients']} client{'s' if p['clients'] > 1 else ''}, {p['seconds']:.0f} s) | "
                     f"{p['sent']} | {counts} | {p['goodput_per_s']:.3f} | {p['p50_ms']} | {p['p99_ms']} | {p['5xx']} | "
                     f"{p['faults']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load.reliability", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="base URL of a running service, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="bearer token when the service has BLENDSERVE_AUTH_API_KEY set")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of each load phase (lone client, then load)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients in the load phase")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--corpus", type=Path, default=SAMPLE, help="JSONL whose titles make the questions")
    p.add_argument("--http-timeout", type=float, default=600.0, help="client-side timeout per request (seconds)")
    p.add_argument("--skip-battery", action="store_true")
    p.add_argument("--skip-solo", action="store_true", help="no lone-client phase (no 80%% check)")
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.clients < 1:
        p.error("--duration must be > 0 and --clients >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    qs = questions(args.corpus)
    with httpx.Client(base_url=url, headers=headers, timeout=args.http_timeout) as base:
        try:
            ready = base.get("/readyz")
        except httpx.HTTPError as exc:
            print(f"error: {url} does not answer: {exc}", file=sys.stderr)
            return 2
        if ready.status_code != 200:
            print(f"error: {url}/readyz says {ready.status_code}: {ready.text[:200]}", file=sys.stderr)
            return 2
        bat = None if args.skip_battery else run_battery(base)
        phases: list[Phase] = []
        if not args.skip_solo:
            phases.append(run_load(base, url, headers, Phase("lone client", 1), args.duration, qs, args.max_tokens,
                                   args.top_k, args.http_timeout))
        phases.append(run_load(base, url, headers, Phase("load", args.clients), args.duration, qs, args.max_tokens,
                               args.top_k, args.http_timeout))
        alive = base.get("/healthz").status_code == 200 and base.get("/readyz").status_code == 200
    summaries = [p.summary() for p in phases]
    print(table(bat, summaries))
    result: dict = {"url": url, "duration_s": args.duration, "clients": args.clients, "max_tokens": args.max_tokens,
                    "top_k": args.top_k, "battery": bat, "phases": summaries, "alive_after": alive}
    if bat is not None and bat["defects"]:
        print("\nbattery defects (expected a JSON 4xx):\n  " + "\n  ".join(bat["defects"]))
    if not args.skip_solo:
        solo, load = summaries[0], summaries[-1]
        share = load["answers_in_window"] / max(solo["answers_in_window"], 1)
        result["load_vs_lone_answers"] = round(share, 3)
        one_query_s = (solo["p50_ms"] or 0) / 1e3
        result["one_query_s"] = one_query_s
        print(f"\none query (lone client p50): {one_query_s:.2f} s -> the target setting is "
              f"BLENDSERVE_SERVICE_REQUEST_TIMEOUT_S={max(1, round(2 * one_query_s))} (twice one query's time)")
        print(f"load answers / lone-client answers within the same {args.duration:g} s: {load['answers_in_window']} / "
              f"{solo['answers_in_window']} = "
              f"{100 * share:.0f}% (target >= 80%)")
    print(f"service still answering after the run: {'yes' if alive else 'NO'}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    defects = (len(bat["defects"]) if bat else 0) + sum(p["faults"] for p in summaries)
    return 0 if alive and not defects else 1


if __name__ == "__main__":
    sys.exit(main())

