"""Secrets our processes read at start (a token, an API key): from a file a flag names, else from an environment
variable; never from a command-line value, which other users could read in the process list. Light on purpose:
config modules validate their secrets with it without loading gRPC (psrl.replica_auth carries the token)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TOKEN_ENV = "PSRL_REPLICA_TOKEN"
# Keys named by whose they are. The router's admin key: what the router requires on /workers* when it has no
# --admin-api-key, what a replica registers with (POST /workers) when not given by --router-api-key[-file], and
# what the SessionRouter's strategy reads the router with.
ROUTER_API_KEY_ENV = "PSRL_ROUTER_API_KEY"
# The router's data-plane key: what the router requires with no --api-key, what the SessionRouter sends upstream.
DATA_API_KEY_ENV = "PSRL_API_KEY"
# The SessionRouter's own control key, with no --admin-api-key.
SESSION_API_KEY_ENV = "PSRL_SESSION_API_KEY"
TOKEN_FILE_FLAG = "--replica-token-file"
_warned: set[str] = set()


def load_secret(path: str | None, env: str, flag: str) -> str | None:
    """A secret from the file `path` (named by `flag`; its content, surrounding whitespace stripped), else from
    $`env` (None: unset or empty). ValueError for an unreadable or empty file, or a secret a header cannot carry."""
    if path:
        file = Path(path)
        try:
            secret = file.read_text().strip()
            mode = file.stat().st_mode & 0o777
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag} {path}: cannot read it ({e})") from None
        if not secret:
            raise ValueError(f"{flag} {path} is empty")
        if mode & 0o077 and path not in _warned:
            _warned.add(path)  # settings are validated more than once
            logger.warning("%s %s can be read by other users (mode %03o); chmod 600 it", flag, path, mode)
        where = f"{flag} {path}"
    else:
        secret = os.environ.get(env, "").strip()
        if not secret:
            return None
        where = f"${env}"
    if not all("!" <= c <= "~" for c in secret):  # what a metadata or header value may hold, less spaces
        raise ValueError(f"{where}: must be printable ASCII without spaces")
    return secret


def env_secret(env: str) -> str | None:
    """The secret in $`env` (None: unset or empty), checked as `load_secret` checks it."""
    return load_secret(None, env, "")


def load_replica_token(token_file: str | None = None) -> str | None:
    """The replicas' token: the content of `token_file` when given, else $PSRL_REPLICA_TOKEN; None: no token."""
    return load_secret(token_file, TOKEN_ENV, TOKEN_FILE_FLAG)
