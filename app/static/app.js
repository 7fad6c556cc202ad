// Blendserve page: plain JS, no build step, nothing fetched from elsewhere.
// Talks to /v1/query (SSE stream with explain=true for the answer; two plain requests for compare).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "blendserve.apiKey";
// viridis (perceptually uniform, readable with the common colour-vision deficiencies)
const VIRIDIS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"];
const TIMINGS = [["retrieval_ms", "retrieval"], ["kv_load_ms", "KV load"], ["recompute_ms", "recompute"],
  ["ttft_ms", "TTFT"], ["total_ms", "total"]];

// What the last request produced; read by the browser test.
window.blendserve = { last: null, deltas: 0, compare: null, busy: false, job: null, ingestion: null, blend: null,
  sources: null };
const FINAL = ["done", "failed", "cancelled"];

// ------------------------------------------------------------------ request building
function headers() {
  const h = { "content-type": "application/json" };
  const key = $("apikey").value.trim();
  if (key) h.authorization = "Bearer " + key;
  return h;
}

function parseDocs(text) {
  return text.split(/^\s*---\s*$/m).map((chunk) => chunk.trim()).filter(Boolean).map((chunk) => {
    const lines = chunk.split("\n");
    if (lines[0].startsWith("#") && lines.length > 1) {
      return { title: lines[0].replace(/^#+\s*/, ""), text: lines.slice(1).join("\n").trim() };
    }
    return { text: chunk };
  });
}

function buildBody(overrides) {
  const body = { question: $("question").value, mode: $("mode").value };
  const topk = parseInt($("topk").value, 10);
  if (!Number.isNaN(topk)) body.top_k = topk;
  const maxTokens = parseInt($("maxtokens").value, 10);
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  const retrieval = $("retrieval").value;
  if (retrieval) body.retrieval = retrieval;
  const docs = parseDocs($("docs").value);
  if (docs.length) body.documents = docs;
  Object.assign(body, overrides);
  const ratio = $("ratio").value.trim();
  if (ratio !== "" && body.mode === "blend") body.recompute_ratio = Number(ratio);
  return body;
}

// ------------------------------------------------------------------ errors
class ApiError extends Error {}

async function apiError(resp) {
  let msg = "";
  try {
    const body = await resp.json();
    msg = (body.error && body.error.message) || (typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail));
  } catch (e) {
    msg = resp.statusText || "no details";
  }
  const s = resp.status;
  if (s === 401) {
    $("apikey").focus();
    return new ApiError("This server needs an API key (401): enter it in the API key field and ask again.");
  }
  if (s === 422) return new ApiError("The request was not accepted (422): " + msg);
  if (s === 503) {
    const retry = resp.headers.get("retry-after");
    return new ApiError("The server is busy or still starting (503)" + (retry ? "; retry in " + retry + " s" : "") + ": " + msg);
  }
  if (s === 504) return new ApiError("The request took too long and was stopped (504): " + msg);
  if (s === 413) return new ApiError("The request is too large (413): " + msg);
  return new ApiError("The server answered " + s + ": " + msg);
}

function showError(err) {
  const box = $("error");
  box.textContent = err instanceof ApiError ? err.message
    : "Could not reach the server or read its answer: " + (err && err.message ? err.message : err);
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

async function postJSON(body) {
  let resp;
  try {
    resp = await fetch("/v1/query", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  } catch (e) {
    throw new Error(e.message);
  }
  if (!resp.ok) throw await apiError(resp);
  return resp;
}

// ------------------------------------------------------------------ server-sent events
async function* readEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      yield { event, data: data.join("\n") };
    }
  }
}

// ------------------------------------------------------------------ ask (streamed, explained)
async function ask() {
  const body = buildBody({ stream: true, explain: true });
  const answer = $("answer");
  $("result").hidden = false;
  $("sources").hidden = true;
  $("comparison").hidden = true;
  answer.textContent = "";
  answer.classList.add("streaming");
  $("timings").replaceChildren();
  $("stats").textContent = "";
  $("cited").hidden = true;
  window.blendserve.last = null;
  window.blendserve.deltas = 0;
  setStatus("Retrieving passages, loading their KV cache and prefilling…");
  try {
    const resp = await postJSON(body);
    let final = null;
    for await (const ev of readEvents(resp)) {
      if (ev.event === "sources") {  // before the first token: the cited passages, with their text
        window.blendserve.sources = JSON.parse(ev.data).sources;
        renderSources(window.blendserve.sources);
      } else if (ev.event === "delta") {
        answer.textContent += JSON.parse(ev.data).text;
        window.blendserve.deltas += 1;
        setStatus("Generating…");
      } else if (ev.event === "done") {
        final = JSON.parse(ev.data);
      } else if (ev.event === "error") {
        const e = JSON.parse(ev.data);
        throw new ApiError("The request failed while generating: " + ((e.error && e.error.message) || e.detail));
      }
    }
    if (!final) throw new ApiError("The answer stream ended early; try again.");
    renderAnswer(answer, final.answer, final.sources || []);
    if (!final.answer) answer.textContent = "(the model gave an empty answer)";
    renderResult(final);
    window.blendserve.last = final;
    setStatus("Done: first token after " + ms(final.timings.ttft_ms) + ", complete after " + ms(final.timings.total_ms) + ".");
  } catch (err) {
    if (!answer.textContent) $("result").hidden = true;
    throw err;
  } finally {
    answer.classList.remove("streaming");
  }
}

function ms(v) {
  return v >= 1000 ? (v / 1000).toFixed(2) + " s" : v.toFixed(v < 10 ? 1 : 0) + " ms";
}

function setStatus(text) {
  $("status").textContent = text;
}

function renderTimings(t) {
  const dl = $("timings");
  dl.replaceChildren();
  for (const [key, label] of TIMINGS) {
    const div = document.createElement("div");
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = label;
    dd.textContent = ms(t[key]);
    dd.dataset.key = key;
    div.append(dt, dd);
    dl.append(div);
  }
}

// The answer with each [n] that names a source linked to that passage below.
function renderAnswer(el, text, sources) {
  el.replaceChildren();
  const known = new Set(sources.map((s) => s.index));
  let last = 0;
  for (const m of text.matchAll(/\[(\d+)\]/g)) {
    const n = Number(m[1]);
    if (!known.has(n)) continue;
    el.append(text.slice(last, m.index));
    const a = document.createElement("a");
    a.href = `#source-${n}`;
    a.textContent = m[0];
    const cited = sources.find((s) => s.index === n);
    if (cited && cited.text) a.title = cited.text;  // the cited text on hover, beside the mark
    el.append(a);
    last = m.index + m[0].length;
  }
  el.append(text.slice(last));
}

// Sources under the answer: [n] title, document and passage index, score, and the cited text itself
// (what the model read); each links to its passage in the explain view.
function renderSources(sources) {
  const list = $("citations");
  list.replaceChildren();
  for (const s of sources) {
    const li = document.createElement("li");
    li.value = s.index;
    li.id = `source-${s.index}`;
    const a = document.createElement("a");
    a.href = `#passage-${s.index}`;
    a.textContent = `[${s.index}] ${s.title || "(untitled passage)"}`;
    const where = s.doc_id === null ? `given passage ${s.passage + 1}` : `${s.doc_id}, passage ${s.passage + 1}`;
    const score = s.score === null ? "" : `, score ${s.score.toFixed(3)}`;
    li.append(a, ` — ${where}${score}`);
    if (s.text) {
      const quote = document.createElement("blockquote");
      quote.className = "source-text";
      quote.textContent = s.text + (s.truncated ? " …" : "");
      li.append(quote);
    }
    list.append(li);
  }
  $("cited").hidden = sources.length === 0;
}

function renderResult(r) {
  renderSources(r.sources || []);
  renderTimings(r.timings);
  const s = r.stats;
  $("stats").textContent = `${r.mode}: ${s.recomputed_tokens} of ${s.context_tokens} prompt tokens recomputed ` +
    `(ratio ${s.recompute_ratio.toFixed(2)}, ${s.ratio_source || "n/a"}); KV cache ${s.cache_hits} hit, ` +
    `${s.cache_misses} miss; ${s.completion_tokens} tokens generated.`;
  if (r.explain) renderExplain(r);
}

// ------------------------------------------------------------------ heatmap
function colourScale(explain) {
  const all = [];
  for (const p of explain.passages) for (const v of p.scores) if (v !== null && v > 0) all.push(Math.log(v));
  const lo = Math.min(...all), hi = Math.max(...all);
  return (v) => {
    if (v === null) return null;
    if (!all.length || hi === lo) return 0.5;
    return v <= 0 ? 0 : Math.min(1, Math.max(0, (Math.log(v) - lo) / (hi - lo)));
  };
}

function viridis(t) {
  return VIRIDIS[Math.round(t * (VIRIDIS.length - 1))];
}

function describe(piece, recomputed, score) {
  const shown = JSON.stringify(piece);
  const sc = score === null ? "not ranked" : "score " + score.toPrecision(3);
  return `token ${shown}: ${sc}, ${recomputed ? "recomputed" : "reused from cache"}`;
}

function visible(piece) {
  return piece.replace(/\n/g, "↵\n");
}

function heatmap(label, tokens, recomputed, scores, scale) {
  const wrap = document.createElement("div");
  const map = document.createElement("div");
  map.className = "heatmap";
  map.setAttribute("role", "group");
  map.setAttribute("aria-label", label + ": tokens; arrow keys move between them");
  const readout = document.createElement("p");
  readout.className = "readout";
  readout.setAttribute("aria-live", "polite");
  readout.textContent = "\u00a0";
  tokens.forEach((piece, i) => {
    const cell = document.createElement("span");
    const score = scores ? scores[i] : null;
    const t = scale(score);
    cell.className = "tok" + (recomputed[i] ? " rc" : "") + (t === null ? " na" : "");
    if (t !== null) {
      cell.style.background = viridis(t);
      cell.style.color = t < 0.6 ? "#fff" : "#000";
    }
    cell.textContent = visible(piece);
    cell.tabIndex = i === 0 ? 0 : -1;
    cell.dataset.recomputed = recomputed[i] ? "1" : "0";
    if (score !== null) cell.dataset.score = String(score);
    const text = describe(piece, recomputed[i], score);
    cell.title = text;
    cell.setAttribute("aria-label", text);
    map.append(cell);
  });
  const show = (ev) => {
    if (ev.target.classList && ev.target.classList.contains("tok")) readout.textContent = ev.target.title;
  };
  map.addEventListener("mouseover", show);
  map.addEventListener("focusin", show);
  map.addEventListener("keydown", (ev) => {
    const cells = map.children;
    const at = Array.prototype.indexOf.call(cells, document.activeElement);
    if (at < 0) return;
    const step = { ArrowRight: 1, ArrowDown: 10, ArrowLeft: -1, ArrowUp: -10, Home: -cells.length, End: cells.length }[ev.key];
    if (step === undefined) return;
    ev.preventDefault();
    const next = Math.max(0, Math.min(cells.length - 1, at + step));
    cells[at].tabIndex = -1;
    cells[next].tabIndex = 0;
    cells[next].focus();
  });
  wrap.append(map, readout);
  return wrap;
}

function badge(cache, tier) {
  const b = document.createElement("span");
  b.className = "badge " + cache;
  b.textContent = cache === "hit" ? "cache hit" + (tier ? " · " + tier : "") : cache === "miss" ? "cache miss" : "cache not used";
  return b;
}

function metaItem(label, value) {
  const span = document.createElement("span");
  const b = document.createElement("b");
  span.append(label + " ");
  b.textContent = value;
  span.append(b);
  return span;
}

function renderExplain(r) {
  const ex = r.explain;
  const scale = colourScale(ex);
  const list = $("passages");
  list.replaceChildren();
  ex.passages.forEach((p, i) => {
    const li = document.createElement("li");
    li.id = `passage-${i + 1}`;
    const h = document.createElement("h3");
    h.textContent = `[${i + 1}] ${p.title || "(untitled passage)"}`;
    const meta = document.createElement("p");
    meta.className = "meta";
    const score = r.passages[i] && r.passages[i].score;
    meta.append(metaItem("retrieval score", score === null || score === undefined ? "— (given)" : score.toFixed(3)),
      badge(p.cache, p.tier), metaItem("recomputed", `${p.recomputed_tokens} of ${p.n_tokens} tokens`));
    const where = r.passages[i] && r.passages[i].location;
    if (where) meta.append(metaItem("from", `${r.passages[i].doc_id}, ${where}`));
    if (p.truncated) meta.append(metaItem("listed", `${p.tokens.length} (cut by the server's explain limit)`));
    li.append(h, meta, heatmap(`Passage ${i + 1}`, p.tokens, p.recomputed, p.scores, scale));
    list.append(li);
  });
  const q = ex.question;
  const qbox = $("question-tokens");
  const qh = document.createElement("h3");
  qh.textContent = "Question (never cached: always recomputed)";
  qbox.replaceChildren(qh, heatmap("Question", q.tokens, q.recomputed, null, scale));
  const sys = ex.system;
  $("truncated").textContent = ex.truncated
    ? `Only the first ${ex.explained_tokens} tokens are listed (server limit ${ex.max_tokens}); the counts cover all tokens.` : "";
  $("truncated").hidden = !ex.truncated;
  $("explain-note").textContent = `System prompt: ${sys.n_tokens} tokens, ${sys.recomputed_tokens} recomputed (cache ${sys.cache}). ` +
    (ex.check_layer !== null ? `Scores: ${ex.metric} at layer ${ex.check_layer}.` : `No scores: ${r.mode} ranks no tokens.`);
  $("sources").hidden = false;
}

// ------------------------------------------------------------------ compare
function words(text) {
  return text.match(/\s+|[^\s]+/g) || [];
}

// Word-level longest common subsequence: which words of a and b are shared, in order.
function commonWords(a, b) {
  const n = a.length, m = b.length;
  const dp = Array.from({ length: n + 1 }, () => new Int32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) {
    for (let j = m - 1; j >= 0; j--) {
      dp[i][j] = a[i] === b[j] ? dp[i + 1][j + 1] + 1 : Math.max(dp[i + 1][j], dp[i][j + 1]);
    }
  }
  const inA = new Array(n).fill(false), inB = new Array(m).fill(false);
  let i = 0, j = 0;
  while (i < n && j < m) {
    if (a[i] === b[j]) { inA[i] = inB[j] = true; i++; j++; }
    else if (dp[i + 1][j] >= dp[i][j + 1]) i++;
    else j++;
  }
  return [inA, inB];
}

function markedAnswer(tokens, shared) {
  const p = document.createElement("p");
  p.className = "ans";
  tokens.forEach((w, i) => {
    if (shared[i] || /^\s+$/.test(w)) p.append(w);
    else {
      const m = document.createElement("mark");
      m.textContent = w;
      p.append(m);
    }
  });
  if (!tokens.length) p.textContent = "(empty answer)";
  return p;
}

async function compare() {
  const results = {};
  $("comparison").hidden = false;
  $("compare-summary").textContent = "";
  for (const mode of ["full_prefill", "blend"]) {
    $(`col-${mode}`).replaceChildren();
  }
  window.blendserve.compare = null;
  for (const mode of ["full_prefill", "blend"]) {
    setStatus(`Compare: running ${mode}…`);
    const resp = await postJSON(buildBody({ mode, stream: false }));
    results[mode] = await resp.json();
  }
  const a = words(results.full_prefill.answer), b = words(results.blend.answer);
  const [inA, inB] = commonWords(a, b);
  for (const [mode, toks, shared] of [["full_prefill", a, inA], ["blend", b, inB]]) {
    const r = results[mode];
    const col = $(`col-${mode}`);
    const h = document.createElement("h3");
    h.textContent = mode;
    const meta = document.createElement("p");
    meta.className = "meta";
    meta.append(metaItem("TTFT", ms(r.timings.ttft_ms)), metaItem("total", ms(r.timings.total_ms)),
      metaItem("recomputed", `${r.stats.recomputed_tokens} of ${r.stats.context_tokens}`));
    col.append(h, meta, markedAnswer(toks, shared));
  }
  const tf = results.full_prefill.timings.ttft_ms, tb = results.blend.timings.ttft_ms;
  const speedup = tf / Math.max(tb, 1e-6);
  const same = results.full_prefill.answer === results.blend.answer;
  const differing = inA.filter((x, i) => !x && !/^\s+$/.test(a[i])).length + inB.filter((x, i) => !x && !/^\s+$/.test(b[i])).length;
  $("compare-summary").textContent = (same ? "The answers are identical." :
    `The answers differ (${differing} highlighted word${differing === 1 ? "" : "s"}).`) +
    (speedup >= 1 ? ` Blend reached the first token ${speedup.toFixed(2)}x faster than full prefill (${ms(tb)} vs ${ms(tf)}).`
      : ` Blend reached the first token later than full prefill here (${ms(tb)} vs ${ms(tf)}).`);
  window.blendserve.compare = results;
  setStatus("Compare done.");
}

// ------------------------------------------------------------------ wiring
async function guarded(fn) {
  if (window.blendserve.busy) return;
  if (!$("question").value.trim()) {
    showError(new ApiError("Type a question first."));
    $("question").focus();
    return;
  }
  window.blendserve.busy = true;
  $("submit").disabled = $("compare").disabled = true;
  clearError();
  try {
    await fn();
  } catch (err) {
    showError(err);
    setStatus("");
  } finally {
    window.blendserve.busy = false;
    $("submit").disabled = $("compare").disabled = false;
  }
}

// ------------------------------------------------------------------ uploads and background ingestion
function authOnly() {
  const key = $("apikey").value.trim();
  return key ? { authorization: "Bearer " + key } : {};
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.append(td);
}

function renderJob(job) {
  $("job").hidden = false;
  $("job-caption").textContent = `Job ${job.id}: ${job.status} (${job.counts.done} done, ${job.counts.failed} failed` +
    `${job.counts.cancelled ? ", " + job.counts.cancelled + " cancelled" : ""} of ${job.files.length} files)`;
  const rows = job.files.map((f) => {
    const tr = document.createElement("tr");
    tr.className = "file " + f.state;
    cell(tr, f.name);
    cell(tr, f.state);
    cell(tr, f.documents ? `${f.processed} / ${f.documents}` : "—");
    cell(tr, f.state === "done" ? `${f.passages} (${f.new_passages})` : "—");
    cell(tr, f.state === "done" ? String(f.kv_computed) : "—");
    cell(tr, f.error || "");
    return tr;
  });
  $("job-files").replaceChildren(...rows);
}

async function pollJob(id) {
  for (;;) {
    const resp = await fetch(`/v1/jobs/${encodeURIComponent(id)}`, { headers: authOnly() });
    if (!resp.ok) throw await apiError(resp);
    const job = await resp.json();
    renderJob(job);
    if (FINAL.includes(job.status)) return job;
    await new Promise((r) => setTimeout(r, 400));
  }
}

async function upload() {
  const files = $("files").files;
  if (!files.length) throw new ApiError("Choose one or more files first.");
  const form = new FormData();
  for (const f of files) form.append("files", f, f.name);
  $("upload-submit").disabled = true;
  clearError();
  try {
    const resp = await fetch("/v1/documents/upload", { method: "POST", headers: authOnly(), body: form });
    if (!resp.ok) throw await apiError(resp);
    const job = await resp.json();
    renderJob(job);
    window.blendserve.job = await pollJob(job.id);
  } finally {
    $("upload-submit").disabled = false;
  }
}

function describeStart(info, blend) {
  const parts = [];
  if (info) {
    const eta = info.eta_s ? `, about ${Math.ceil(info.eta_s)} s left` : "";
    parts.push(`Sample corpus: ${info.processed} of ${info.documents || "?"} documents ingested, ` +
      `${info.passages ?? "?"} passages searchable (${info.status}${eta}${info.error ? ": " + info.error : ""}). ` +
      (info.passages ? "Questions use what is indexed so far." : "Questions can be asked once the first passages are in."));
  }
  if (blend) parts.push(`Blend: ${blend.state}${blend.reason ? " (" + blend.reason + ")" : ""}.`);
  return parts.join(" ");
}

async function watchIngestion() {
  // the first start ingests the sample corpus and checks blend in the background; show both until they end
  for (let idle = 0; idle < 5;) {  // a ready server with nothing in progress for 5 s: stop polling
    let info = null, blend = null;
    try {
      const resp = await fetch("/v1/status", { headers: authOnly() });
      if (resp.ok || resp.status === 503) {
        const body = await resp.json();
        info = body.ingestion || null;
        blend = body.blend || null;
      } else if (resp.status === 401) { /* no key yet: try again */ } else return;
    } catch (e) { /* the server restarts: try again */ }
    window.blendserve.ingestion = info;
    window.blendserve.blend = blend;
    $("ingestion").textContent = describeStart(info, blend);
    const busy = (info && !FINAL.includes(info.status)) || (blend && blend.state === "checking") || (!info && !blend);
    if (!busy) idle += 1;
    await new Promise((r) => setTimeout(r, 1000));
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const key = $("apikey");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("input", () => sessionStorage.setItem(KEY_STORE, key.value.trim()));
  $("ask").addEventListener("submit", (ev) => {
    ev.preventDefault();
    guarded(ask);
  });
  $("compare").addEventListener("click", () => guarded(compare));
  $("upload").addEventListener("submit", (ev) => {
    ev.preventDefault();
    upload().catch((err) => showError(err));
  });
  watchIngestion();
  $("question").focus();
});
