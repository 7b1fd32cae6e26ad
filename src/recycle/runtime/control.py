"""The control plane between the coordinator and the workers: the job's store (bound to one address, every key under
a per-job secret prefix) and the key names (the records written under them are in runtime.records)."""

from __future__ import annotations

import datetime
import os
import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from recycle.errors import ConfigError

__all__ = ["TOKEN_ENV", "new_token", "read_token", "host_store", "connect_store", "job_store", "Keys"]

TOKEN_ENV = "RECYCLE_JOB_TOKEN"
_TOKEN_BYTES = 24  # 192 bits: the prefix is the capability to read or write the job's keys


def new_token() -> str:
    return secrets.token_hex(_TOKEN_BYTES)


def read_token(token_file: str = "") -> str:
    """The job secret of a multi-node run: from `token_file` (which must not be readable by others) or the
    RECYCLE_JOB_TOKEN environment variable; "" when neither is given."""
    if token_file:
        path = Path(token_file)
        if not path.is_file():
            raise ConfigError(f"--token-file {token_file!r} does not exist; write the job secret there (e.g. "
                              f"`python -c 'import secrets; print(secrets.token_hex(24))' > {token_file}; "
                              f"chmod 600 {token_file}`) and copy it to every node")
        if path.stat().st_mode & 0o077:
            raise ConfigError(f"--token-file {token_file!r} is readable or writable by other users (mode "
                              f"{path.stat().st_mode & 0o777:o}); run `chmod 600 {token_file}`")
        token = path.read_text().strip()
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if token and (len(token) < 32 or not all(c in "0123456789abcdefABCDEF" for c in token)):
        raise ConfigError(f"the job secret must be at least 32 hex digits (got {len(token)} characters); make one "
                          "with `python -c 'import secrets; print(secrets.token_hex(24))'`")
    return token


def host_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The job's TCPStore server, listening on `address` only (loopback for a single-node run), not on every
    interface as TCPStore does by itself."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port))
    except OSError as exc:
        listener.close()
        raise ConfigError(f"cannot listen on {address}:{port} for the job's store ({exc.strerror}); pick another "
                          "--master-port, or an address of this machine for --master-addr") from None
    listener.listen(512)
    port = listener.getsockname()[1]
    # detach(): the store owns the listening socket from now on (Python must not close it when `listener` goes).
    return dist.TCPStore(address, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listener.detach())


def connect_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def job_store(store: dist.Store, token: str) -> dist.PrefixStore:
    """Every key of the job lives under its secret: a process without the token cannot name, read or forge them."""
    return dist.PrefixStore(f"job-{token}", store)


class Keys:
    """Key names in the job store (relative to the job prefix)."""

    @staticmethod
    def heartbeat(rank: int) -> str:
        return f"hb/{rank}"

    @staticmethod
    def announce(generation: int) -> str:
        return f"gen{generation}/announce"

    @staticmethod
    def plan(generation: int) -> str:
        return f"gen{generation}/plan"

    @staticmethod
    def abort(generation: int) -> str:
        return f"gen{generation}/abort"

    @staticmethod
    def stopped(generation: int, rank: int) -> str:
        return f"gen{generation}/stopped/{rank}"

    @staticmethod
    def respawn(rank: int) -> str:
        return f"respawn/{rank}"

    @staticmethod
    def drain(generation: int) -> str:
        return f"gen{generation}/drain"

    @staticmethod
    def join_ready(rank: int) -> str:
        return f"join/{rank}/ready"

    @staticmethod
    def join_generation(rank: int) -> str:
        return f"join/{rank}/generation"

    @staticmethod
    def transfer(generation: int, rank: int) -> str:
        return f"gen{generation}/transfer/{rank}"

    @staticmethod
    def migration(generation: int, rank: int) -> str:
        """What a worker's layer re-partition moved in this generation (layers in and out, bytes, seconds)."""
        return f"gen{generation}/migration/{rank}"

    @staticmethod
    def stopped_count(generation: int) -> str:
        return f"gen{generation}/stopped_count"

    @staticmethod
    def joined(generation: int, rank: int) -> str:
        return f"gen{generation}/joined/{rank}"

    @staticmethod
    def resumed(generation: int, rank: int) -> str:
        return f"gen{generation}/resumed/{rank}"

    @staticmethod
    def process_groups(generation: int) -> str:
        return f"gen{generation}/pg"

    @staticmethod
    def metrics(step: int, rank: int) -> str:
        return f"metrics/{step}/{rank}"

    @staticmethod
    def checkpointed(done_steps: int, stage: int) -> str:
        return f"ckpt/{done_steps}/{stage}"

    @staticmethod
    def error(rank: int) -> str:
        return f"error/{rank}"

    @staticmethod
    def fault(rank: int) -> str:
        return f"fault/{rank}"

    @staticmethod
    def exited(rank: int) -> str:
        return f"exit/{rank}"

    @staticmethod
    def fence(rank: int) -> str:
        return f"fence/{rank}"

    @staticmethod
    def node_done(node: int) -> str:
        return f"node_done/{node}"

    ABORT_RUN = "abort"
    FINISHED = "finished"
    RUNNING = "running"  # the first step is done: a node launcher that starts now is a repaired node
