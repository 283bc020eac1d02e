"""Start a real PostgreSQL server for the storage tests, as an unprivileged user, in a temporary directory.

initdb refuses to run as root, so under root (CI containers) the server runs as the ``postgres`` user that Debian's
package creates. Where no server can start, the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass

import pytest


@dataclass
class PostgresServer:
    root: str
    port: int
    run_as: list[str]
    pg_ctl: str

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://qevict@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=qevict dbname=postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://qevict@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        subprocess.run([*self.run_as, self.pg_ctl, "-D", f"{self.root}/data", "-m", "immediate", "stop"],
                       capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PostgresServer:
    bindirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    if not bindirs:
        pytest.skip("PostgreSQL is not installed here (Debian: apt-get install -y postgresql); .ci/run installs it")
    pytest.importorskip("psycopg", reason="the psycopg driver is not installed (it is in requirements.txt)")
    bindir = bindirs[-1]
    root = tempfile.mkdtemp(prefix="qevict-pg-")
    run_as: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser: cannot start PostgreSQL as an unprivileged user")
        run_as = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres", "postgres")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    steps = [
        [*run_as, f"{bindir}/initdb", "-D", f"{root}/data", "-U", "qevict", "-A", "trust", "-E", "UTF8", "--no-sync"],
        [*run_as, f"{bindir}/pg_ctl", "-D", f"{root}/data", "-l", f"{root}/log", "-w", "-t", "60", "-o",
         f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off", "start"],
    ]
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log = open(f"{root}/log").read()[-800:] if os.path.exists(f"{root}/log") else ""
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip(f"PostgreSQL could not start ({os.path.basename(command[len(run_as)])}: "
                        f"{(done.stderr or done.stdout).strip()[-400:]} {log})")
    return PostgresServer(root, port, run_as, f"{bindir}/pg_ctl")
