"""Schema fuzzing (schemathesis over /openapi.json) against the app on a tiny random model: valid and
invalid requests for every operation, bounded in examples and time. Every valid JSON body is also
sent again with text the generator never produces (a lone UTF-16 surrogate, control characters)
in each of its strings in turn. No request may get a 5xx, and the service must still answer
normally afterwards."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.helpers import make_settings, serving

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[dev]')")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES = 100  # per operation and generation mode
BUDGET_S = 50.0  # wall-clock bound for the whole run (operations left over are reported, not fuzzed)
DOCS = [{"doc_id": "paris", "title": "Paris", "text": "Paris is the capital of France."},
        {"doc_id": "nile", "title": "Nile", "text": "The Nile is a river in Africa."}]


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory, tiny_stack_factory):
    settings = make_settings(tmp_path_factory.mktemp("fuzz") / "data", max_new_tokens=4, max_top_k=5,
                             max_documents=3, max_document_chars=1500, max_question_chars=400,
                             max_title_chars=80, chunk_tokens=64, request_timeout_s=30, max_body_bytes=64 * 1024)
    with serving(settings, tiny_stack_factory, DOCS) as client:
        yield client.app, client


POISONS = ("\ud800", "\udfff tail", "line\nbreak\r\x1b[2J\x00")


def _poisoned(body: Any) -> list[Any]:
    """Copies of `body`, each with one string (value or key) replaced by a poison."""
    out: list[Any] = []

    def walk(value: Any, rebuild) -> None:
        if isinstance(value, str):
            out.extend(rebuild(p) for p in POISONS)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, lambda new, key=key: rebuild({**value, key: new}))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, lambda new, i=i: rebuild([*value[:i], new, *value[i + 1:]]))

    walk(body, lambda new: new)
    return out[:24]


def _fuzz_operation(operation, mode, failures: list[str], client) -> int:
    sent = 0

    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        nonlocal sent
        response = case.call()
        sent += 1
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]} "
                            f"(body {str(case.body)[:300]!r})")
        if mode is schemathesis.GenerationMode.POSITIVE and isinstance(case.body, (dict, list)):
            for body in _poisoned(case.body):
                r = client.request(case.method, case.formatted_path, content=json.dumps(body),
                                   headers={"content-type": "application/json"})
                sent += 1
                if r.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} -> {r.status_code}: {r.text[:300]} "
                                    f"(poisoned body {json.dumps(body)[:300]})")

    try:
        run()
    except hypothesis.errors.Unsatisfiable:  # nothing to make invalid (an operation without parameters)
        pass
    return sent


def test_schema_fuzzing_gives_no_5xx_and_the_service_still_answers(fuzz_app):
    app, client = fuzz_app
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    failures: list[str] = []
    sent, skipped = 0, []
    t0 = time.monotonic()
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        for op in operations:
            if time.monotonic() - t0 > BUDGET_S:
                skipped.append(f"{mode.value} {op.method.upper()} {op.path}")
                continue
            sent += _fuzz_operation(op, mode, failures, client)
    print(f"fuzz: {sent} requests over {len(operations)} operations in {time.monotonic() - t0:.1f} s; "
          f"skipped for time: {skipped or 'none'}")
    assert not failures, "\n".join(failures[:10])
    assert sent >= 100, f"only {sent} requests were generated (skipped for time: {skipped})"
    # the service still answers
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    r = client.post("/v1/query", json={"question": "What is the capital of France?", "max_tokens": 2,
                                       "documents": [{"title": "Paris", "text": DOCS[0]["text"]}]})
    assert r.status_code == 200 and isinstance(r.json()["answer"], str), r.text
    assert app.state.svc.worker.running == 0
