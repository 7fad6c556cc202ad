"""Local services for tests: throwaway PostgreSQL clusters (initdb into a temp dir, pg_ctl on a
free loopback port), a throwaway redis-server, an app served on a thread, waiting for readiness.

PostgreSQL refuses to run as root, and CI runs as root: then every PostgreSQL command runs as an
unprivileged user (`postgres` when the Debian package created it, else `nobody`) through
`runuser`, in a temp dir that user owns.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from benchmarks.common.service import free_port  # the one free-port helper, re-exported for the tests


def pg_bin_dir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres (PATH first, then Debian's layout)."""
    found = shutil.which("pg_ctl")
    candidates = [str(Path(os.path.realpath(found)).parent)] if found else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for folder in candidates:
        if all(os.access(Path(folder) / b, os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
            return Path(folder)
    return None


def _run_as() -> tuple[list[str], int | None, int | None]:
    """(command prefix, uid, gid) for running PostgreSQL: as ourselves unless we are root."""
    if os.geteuid() != 0:
        return [], None, None
    for name in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        return ["runuser", "-u", name, "--"], pw.pw_uid, pw.pw_gid
    raise RuntimeError("running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as")


class PgCluster:
    """A PostgreSQL cluster on 127.0.0.1:<port>, trust authentication, removed by `destroy()`."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.prefix, uid, gid = _run_as()
        self.dir = Path(tempfile.mkdtemp(prefix="blendserve-pg-"))
        if uid is not None:
            os.chown(self.dir, uid, gid)
        self.data = self.dir / "data"
        self.port = free_port()
        self.user = "blendserve"

    def _cmd(self, *args: str, timeout: float = 60) -> None:
        proc = subprocess.run([*self.prefix, *args], capture_output=True, text=True, timeout=timeout, cwd=self.dir)
        if proc.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")

    def init(self) -> PgCluster:
        self._cmd(str(self.bin / "initdb"), "-D", str(self.data), "-U", self.user, "-A", "trust", "-E", "UTF8",
                  "--no-sync", "--no-instructions")
        return self

    def start(self) -> PgCluster:
        opts = (f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off -c synchronous_commit=off "
                f"-c full_page_writes=off -c max_connections=50 -c shared_buffers=16MB")
        self._cmd(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-o", opts,
                  "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._cmd(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def start_cluster() -> PgCluster:
    """A started cluster, or pytest.skip with what is missing."""
    bin_dir = pg_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl, postgres) not found: apt-get install postgresql")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg not installed (pip install 'psycopg[binary]')")
    cluster = PgCluster(bin_dir)
    try:
        return cluster.init().start()
    except Exception:
        cluster.destroy()
        raise


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes (None)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


class RedisProcess:
    """A throwaway redis-server on a free loopback port, no persistence."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisProcess:
        import redis

        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.2)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        if not wait_for(up, timeout=10):
            self.stop()
            raise RuntimeError("redis-server did not start")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def wait_url_ready(url: str, timeout: float, headers: dict | None = None, proc: subprocess.Popen | None = None) -> dict:
    """The service at `url` ready (its /readyz JSON): the benchmarks' wait, polled every 0.1 s."""
    from benchmarks.common.service import wait_ready

    return wait_ready(url, timeout, proc=proc, headers=headers, interval_s=0.1, request_timeout_s=2.0)


class ThreadedServer:
    """An app served by uvicorn on a thread of this process (a real socket); ready on enter."""

    def __init__(self, app, port: int) -> None:
        import uvicorn

        self.app = app  # as a TestClient's, for the helpers that look inside (`tests.helpers.svc`)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 60, 0.02)
        wait_url_ready(self.url, timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
