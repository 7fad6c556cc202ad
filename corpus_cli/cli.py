"""`python -m corpus_tools COMMAND` (or `python -m corpus_cli`): ingest, stats, verify, delete, gc.

Exit codes: 0 success; 1 finished but something failed (skipped input, broken entries, unknown
document); 2 the run stopped (usage error, --strict input error, fatal error); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import logsafe
from blendserve_config.settings import Settings
from corpus_tools.documents import InputError, Reader
from corpus_tools.ingest import IngestSummary

logger = logging.getLogger("corpus_tools")

EXIT_OK, EXIT_PARTIAL, EXIT_FATAL, EXIT_INTERRUPTED = 0, 1, 2, 130


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def err(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m corpus_tools", description="Blendserve corpus tools")
    p.add_argument("--data-dir", type=Path, help="overrides BLENDSERVE_DATA_DIR")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    ing = sub.add_parser("ingest", help="index files, folders and JSONL; precompute every passage's KV")
    ing.add_argument("paths", nargs="+", help=".txt/.md files, folders, .jsonl/.json (records, HotpotQA, MuSiQue)")
    ing.add_argument("--strict", action="store_true", help="stop at the first malformed record or unreadable file")
    ing.add_argument("--no-progress", action="store_true", help="no progress bars")
    ing.add_argument("--batch-size", type=int, help="passages per transaction (BLENDSERVE_INGEST_BATCH_SIZE)")
    ing.add_argument("--json", action="store_true", help="print the summary as JSON")
    st = sub.add_parser("stats", help="corpus, index and KV store numbers")
    st.add_argument("--json", action="store_true")
    ver = sub.add_parser("verify", help="check every stored KV cache and index entry")
    ver.add_argument("--repair", action="store_true", help="recompute what is broken")
    ver.add_argument("--no-progress", action="store_true")
    dl = sub.add_parser("delete", help="delete documents (passages, vectors, KV entries)")
    dl.add_argument("doc_ids", nargs="+")
    sub.add_parser("gc", help="drop KV entries no passage references (when the store can list keys)")
    return p.parse_args(argv)


def load_settings(args: argparse.Namespace) -> Settings:
    overrides: dict = {}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    if getattr(args, "batch_size", None):
        overrides["ingest"] = {"batch_size": args.batch_size}
    return Settings(**overrides)


def print_summary(s: IngestSummary, as_json: bool) -> None:
    if as_json:
        out(json.dumps({**s.__dict__, "errors": list(s.errors), "doc_ids": len(s.doc_ids)}))
        return
    secs = max(s.seconds, 1e-9)
    share = 100 * s.kv_seconds / secs
    out(f"documents      {s.documents}")
    out(f"passages       {s.passages} ({s.new_passages} new, {s.skipped} already stored)")
    out(f"tokens         {s.tokens}")
    out(f"KV precomputed {s.kv_computed} passages, {human_bytes(s.kv_bytes)}")
    out(f"time           {s.seconds:.1f} s (KV precompute {share:.0f}%, embedding "
        f"{100 * s.embed_seconds / secs:.0f}%, index+store {100 * s.index_seconds / secs:.0f}%)")
    out(f"rate           {s.passages / secs:.1f} passages/s, {s.tokens / secs:.0f} tokens/s")
    if s.errors:
        out(f"errors         {len(s.errors)} (see stderr)")


def cmd_ingest(stack, args: argparse.Namespace) -> int:
    reader = Reader(strict=args.strict, on_error=lambda m: err(f"warning: {m}"))
    try:
        summary = stack.pipeline.ingest(reader.read(args.paths), progress=not args.no_progress)
    except InputError as exc:
        err(f"error: {exc}")
        err("stopped (--strict); batches before the error are stored, re-run to resume")
        return EXIT_FATAL
    errors = [*reader.errors, *summary.errors]
    for e in summary.errors:
        err(f"warning: {e}")
    print_summary(summary, args.json)
    if reader.files == 0 and not summary.documents:
        err("error: nothing was ingested")
        return EXIT_FATAL
    return EXIT_PARTIAL if errors else EXIT_OK


def cmd_stats(stack, args: argparse.Namespace) -> int:
    stats = stack.pipeline.stats()
    if args.json:
        out(json.dumps(stats, default=str))
        return EXIT_OK
    out(f"documents      {stats['documents']}")
    out(f"passages       {stats['passages']}")
    out(f"tokens         {stats['tokens']}")
    ix = stats["index"]
    out(f"index          {ix['vectors']} vectors, {ix['kind']} (configured {ix['configured']}), dim {ix['dim']}")
    kv = stats["kv"]
    out(f"KV             {kv['format']}, {kv['bytes_per_token']} bytes/token, ~{human_bytes(kv['bytes_estimate'])} "
        f"for the corpus; store {kv['store'].get('name')}: {kv['store'].get('entries')} entries, "
        f"{human_bytes(kv['store'].get('bytes_used', 0))}")
    out(f"model          {stats['model']}, chunk_tokens {stats['chunk_tokens']}")
    return EXIT_OK


def cmd_verify(stack, args: argparse.Namespace) -> int:
    report = stack.pipeline.verify(repair=args.repair, progress=not args.no_progress)
    for p in report.problems:
        err(f"problem: {p}")
    out(f"passages {report.passages}, KV ok {report.kv_ok}, problems {len(report.problems)}, "
        f"repaired {report.repaired}, index missing {report.index_missing}, extra {report.index_extra}, "
        f"incomplete documents {len(report.incomplete)}")
    for doc_id in report.incomplete:
        out(f"incomplete: {logsafe.printable(doc_id)}")
    if not report.problems:
        out("verify: OK")
        return EXIT_OK
    if args.repair:
        again = stack.pipeline.verify(repair=False)
        out("verify after repair: " + ("OK" if not again.problems else f"{len(again.problems)} problems remain"))
        return EXIT_OK if not again.problems else EXIT_PARTIAL
    if report.incomplete:
        err("re-run the ingestion of the incomplete documents to complete them (or `verify --repair` drops them)")
    err("run `python -m corpus_tools verify --repair` to recompute what is broken")
    return EXIT_PARTIAL


def cmd_delete(stack, args: argparse.Namespace) -> int:
    missing = 0
    for doc_id in args.doc_ids:
        if stack.pipeline.delete_document(doc_id):
            out(f"deleted {doc_id}")
        else:
            err(f"error: no document {doc_id!r}")
            missing += 1
    return EXIT_PARTIAL if missing else EXIT_OK


def cmd_gc(stack, args: argparse.Namespace) -> int:
    result = stack.pipeline.gc()
    if not result["supported"]:
        out(result["message"])
        out(f"referenced KV entries: {result['referenced']}")
        return EXIT_OK
    out(f"dropped {result['dropped']} unreferenced KV entries ({human_bytes(result['freed_bytes'])}) from "
        f"{', '.join(result['tiers'])}; {result['referenced']} referenced")
    if result["unlisted_tiers"]:
        out(f"not collected (cannot list keys): {', '.join(result['unlisted_tiers'])}")
    return EXIT_OK


COMMANDS = {"ingest": cmd_ingest, "stats": cmd_stats, "verify": cmd_verify, "delete": cmd_delete, "gc": cmd_gc}


def _quiet_libraries() -> None:
    """No weight-loading progress bars from transformers in CLI output; our own bars stay."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logsafe.install()
    _quiet_libraries()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(args)
    except Exception as exc:  # pydantic ValidationError names the field
        err(f"error: bad configuration: {exc}")
        return EXIT_FATAL
    stack = None
    try:
        from blendserve_config.stack import build_stack

        stack = build_stack(settings)
        return COMMANDS[args.command](stack, args)
    except KeyboardInterrupt:
        err("interrupted; committed batches are kept, re-run to resume")
        return EXIT_INTERRUPTED
    except (OSError, RuntimeError, ValueError) as exc:
        logger.debug("fatal", exc_info=True)
        err(f"error: {exc}")
        return EXIT_FATAL
    finally:
        if stack is not None:
            stack.close()
