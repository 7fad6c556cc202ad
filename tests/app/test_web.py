"""The web page at `/`: served from app/static without auth or anything external, and driven in a
real headless browser (Debian's chromium + chromium-driver through selenium) against the app on
the tiny model."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.main import STATIC_DIR, create_app
from app.settings import ServiceSettings
from tests.local_services import ThreadedServer

KEY = "page-key"
DOCS = [
    {"doc_id": "france", "title": "France", "text": "France is a country in Western Europe. Its capital is Paris."},
    {"doc_id": "japan", "title": "Japan", "text": "Japan is an island country in East Asia. Its capital is Tokyo."},
    {"doc_id": "kenya", "title": "Kenya", "text": "Kenya is a country in East Africa. Its capital is Nairobi."},
]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)


def _settings(data_dir: Path, **kw) -> ServiceSettings:
    values = dict(data_dir=data_dir, ingest_sample_on_start=False, memory_cache_mb=256, redis_url=None, api_key=KEY,
                  workers=1, max_queue=16)
    values.update(kw)
    return ServiceSettings(_env_file=None, **values)


# ============================================================================ served files
def test_page_and_its_files_are_served_without_the_key_and_fetch_nothing_external(tmp_path, tiny_stack_factory):
    with TestClient(create_app(_settings(tmp_path / "data"), tiny_stack_factory)) as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert sorted(assets) == ["/static/app.js", "/static/style.css"]
        for path in assets:
            r = c.get(path)
            assert r.status_code == 200 and len(r.text) > 100
        assert c.post("/v1/query", json={"question": "q?"}).status_code == 401  # the API still needs the key
        assert "/" not in c.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
    for f in STATIC_DIR.iterdir():  # no CDN, no remote fonts: nothing outside the app is fetched
        assert not re.search(r"https?://", f.read_text()), f


# ============================================================================ the browser
@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("browser test needs Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download a driver or browser
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,1700",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def _wait(driver, script: str, timeout: float = 60.0):
    """Poll a JS expression until truthy; fail early with the page's error message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(f"return {script}")
        if value:
            return value
        error = driver.execute_script("const e = document.getElementById('error'); return e.hidden ? '' : e.textContent")
        if error:
            raise AssertionError(f"the page shows an error: {error}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {script}")


def test_ask_stream_heatmap_compare_in_a_real_browser(browser, tmp_path, tiny_stack_factory, free_port):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    app = create_app(_settings(tmp_path / "data"), tiny_stack_factory)
    with ThreadedServer(app, free_port()) as srv:
        r = httpx.post(f"{srv.url}/v1/documents", json={"documents": DOCS}, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 201, r.text
        d = browser
        d.get(srv.url + "/")
        assert d.title.startswith("Blendserve")
        question = d.find_element(By.ID, "question")
        # without the key: a readable 401 message, not a blank page
        question.send_keys("What is the capital of France?", Keys.ENTER)
        deadline = time.monotonic() + 30
        while d.find_element(By.ID, "error").get_attribute("hidden") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "API key" in d.find_element(By.ID, "error").text and "401" in d.find_element(By.ID, "error").text

        d.find_element(By.ID, "apikey").send_keys(KEY)
        assert d.execute_script("return sessionStorage.getItem('blendserve.apiKey')") == KEY
        d.find_element(By.ID, "ratio").send_keys("0.3")
        d.find_element(By.ID, "question").send_keys(Keys.ENTER)  # keyboard submission
        last = _wait(d, "window.blendserve.last")
        ex, stats = last["explain"], last["stats"]

        # the answer streamed in as deltas and ends as the final answer
        assert d.execute_script("return window.blendserve.deltas") >= (1 if last["answer"] else 0)
        shown = d.find_element(By.ID, "answer").text
        assert shown == (last["answer"].strip() or "(the model gave an empty answer)")
        # passages in prompt order with title, score, hit/miss and tier; the timings
        items = d.find_elements(By.CSS_SELECTOR, "#passages > li")
        assert [i.find_element(By.TAG_NAME, "h3").text for i in items] == \
            [f"[{n + 1}] {p['title']}" for n, p in enumerate(last["passages"])]
        # the sources under the answer, numbered as in the prompt, each linked to its passage
        links = d.find_elements(By.CSS_SELECTOR, "#citations a")
        assert [a.text for a in links] == [f"[{s['index']}] {s['title']}" for s in last["sources"]]
        assert [a.get_attribute("href").split("#")[1] for a in links] == [i.get_attribute("id") for i in items]
        # beside each source, the text it cites (issue #38)
        quotes = d.find_elements(By.CSS_SELECTOR, "#citations .source-text")
        assert [q.text for q in quotes] == [s["text"].strip() for s in last["sources"]]
        assert all("cache hit · memory" in i.text and "retrieval score" in i.text for i in items)
        timings = {e.get_attribute("data-key") for e in d.find_elements(By.CSS_SELECTOR, "#timings dd")}
        assert timings == {"retrieval_ms", "kv_load_ms", "recompute_ms", "ttft_ms", "total_ms"}
        # one heatmap cell per explained token; marked cells = the response's recomputed count
        for item, p in zip(items, ex["passages"]):
            assert len(item.find_elements(By.CSS_SELECTOR, ".tok")) == len(p["tokens"]) == p["n_tokens"]
        cells = d.find_elements(By.CSS_SELECTOR, "#passages .tok, #question-tokens .tok")
        assert len(cells) == ex["explained_tokens"] and not ex["truncated"]
        marked = d.find_elements(By.CSS_SELECTOR, "#passages .tok.rc, #question-tokens .tok.rc")
        assert ex["system"]["recomputed_tokens"] == 0  # the system prefix is exact: never a cell
        markers = sum(m["recomputed_tokens"] for m in ex["markers"])  # the [n] markers: counted, not shown as cells
        assert len(marked) == stats["recomputed_tokens"] - markers \
            > len(d.find_elements(By.CSS_SELECTOR, "#question-tokens .tok"))
        # the score as text on focus, and arrow keys move along the tokens
        first = d.find_element(By.CSS_SELECTOR, "#passages .tok")
        first.click()
        first.send_keys(Keys.ARROW_RIGHT)
        readout = d.find_element(By.CSS_SELECTOR, "#passages .readout").text
        shown_score = re.search(r"score (\S+),", readout)
        piece = json.dumps(ex["passages"][0]["tokens"][1], ensure_ascii=False)
        assert readout.startswith(f"token {piece}: ") and shown_score, readout
        assert float(shown_score.group(1)) == pytest.approx(ex["passages"][0]["scores"][1], rel=1e-2)

        d.find_element(By.ID, "compare").click()
        results = _wait(d, "window.blendserve.compare")
        for mode in ("full_prefill", "blend"):
            col = d.find_element(By.ID, f"col-{mode}").text
            assert col.startswith(mode) and "TTFT" in col
            assert results[mode]["mode"] == mode
        summary = d.find_element(By.ID, "compare-summary").text
        assert ("identical" in summary) == (results["full_prefill"]["answer"] == results["blend"]["answer"])
        if results["full_prefill"]["answer"] != results["blend"]["answer"]:
            assert d.find_elements(By.CSS_SELECTOR, "#comparison mark")

        # 503 (with Retry-After) and 504 bodies as the API sends them become readable messages
        for status, headers, expect in [(503, {"retry-after": "5"}, ["503", "retry in 5 s", "still loading"]),
                                        (504, {}, ["504", "too long", "still loading"])]:
            message = d.execute_async_script(
                "const done = arguments[arguments.length - 1];"
                "const body = JSON.stringify({detail: 'still loading', error: {message: 'still loading'}});"
                "apiError(new Response(body, {status: arguments[0], headers: arguments[1]})).then((e) => done(e.message));",
                status, headers)
            assert all(part in message for part in expect), message

        shot = tmp_path / "page.png"
        assert d.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

        # an API error is a readable message (422 names the field)
        d.find_element(By.ID, "topk").clear()
        d.find_element(By.ID, "topk").send_keys("999", Keys.ENTER)
        deadline = time.monotonic() + 30
        while d.find_element(By.ID, "error").get_attribute("hidden") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        error = d.find_element(By.ID, "error").text
        assert "422" in error and "top_k" in error



def test_upload_box_and_sample_ingestion_progress_in_a_real_browser(browser, tmp_path, tiny_stack_factory, free_port):
    from selenium.webdriver.common.by import By

    from tests.files import HTML_PAGE, tiny_pdf

    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(json.dumps({"title": f"T{i}", "text": f"Sample fact {i}."}) for i in range(3)) + "\n")
    good, scan = tmp_path / "ferry.html", tmp_path / "scan.pdf"
    good.write_bytes(HTML_PAGE)
    scan.write_bytes(tiny_pdf([""]))
    app = create_app(_settings(tmp_path / "data", ingest_sample_on_start=True, sample_corpus=sample), tiny_stack_factory)
    with ThreadedServer(app, free_port()) as srv:
        d = browser
        d.get(srv.url + "/")
        d.find_element(By.ID, "apikey").send_keys(KEY)
        info = _wait(d, "window.blendserve.ingestion && window.blendserve.ingestion.status === 'done' "
                        "&& window.blendserve.ingestion")
        assert info["processed"] == info["documents"] == 3
        assert "Sample corpus: 3 of 3 documents ingested, 3 passages searchable (done)" in \
            d.find_element(By.ID, "ingestion").text

        d.find_element(By.ID, "files").send_keys(f"{good}\n{scan}")  # two files in one multiple input
        d.find_element(By.ID, "upload-submit").click()
        job = _wait(d, "window.blendserve.job")
        assert job["status"] == "done" and [f["state"] for f in job["files"]] == ["done", "failed"]
        rows = d.find_elements(By.CSS_SELECTOR, "#job-files tr")
        assert [r.find_elements(By.TAG_NAME, "td")[0].text for r in rows] == ["ferry.html", "scan.pdf"]
        assert rows[0].find_elements(By.TAG_NAME, "td")[1].text == "done"
        assert "1 / 1" == rows[0].find_elements(By.TAG_NAME, "td")[2].text
        assert "no text layer" in rows[1].text and "failed" in rows[1].text
        assert "1 done, 1 failed of 2 files" in d.find_element(By.ID, "job-caption").text
