"""The job secret: made, and read from a --token-file or RECYCLE_JOB_TOKEN (torch-free: `recycle train` checks it
before the runtime is imported)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from recycle.errors import ConfigError

__all__ = ["TOKEN_ENV", "new_token", "read_token"]

TOKEN_ENV = "RECYCLE_JOB_TOKEN"
_TOKEN_BYTES = 24  # 192 bits: the key of every peer's handshake and of every frame's MAC


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
