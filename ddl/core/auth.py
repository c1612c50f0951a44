"""Job secret and HMAC helpers shared by the control plane and the data plane.

The launcher makes a fresh 256-bit secret per job and hands it to its children in the
environment (``DDL_JOB_SECRET``), never on a command line. gRPC calls carry
:func:`grpc_token`; data-plane connections run a challenge over nonces
(:mod:`ddl.dataplane.transports.tcp`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

GRPC_METADATA_KEY = "ddl-auth"


def new_secret() -> str:
    """A fresh job secret, 64 hex characters."""
    return secrets.token_hex(32)


def new_job_id() -> str:
    """A fresh job id, 16 hex characters (not secret)."""
    return secrets.token_hex(8)


def secret_bytes(secret_hex: str) -> bytes:
    try:
        key = bytes.fromhex(secret_hex)
    except ValueError:
        key = b""
    if len(key) < 16:
        from ddl.core.errors import ConfigError
        raise ConfigError("DDL_JOB_SECRET must be at least 32 hex characters",
                          variable="DDL_JOB_SECRET", value="<hidden>")
    return key


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the length-prefixed concatenation of ``parts``."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def grpc_token(secret_hex: str, job_id: str) -> str:
    """The ``ddl-auth`` metadata value of a job: hex HMAC of ``ddl-grpc-v1:<job_id>``."""
    return hmac.new(secret_bytes(secret_hex), b"ddl-grpc-v1:" + job_id.encode(),
                    hashlib.sha256).hexdigest()


def check_grpc_token(secret_hex: str, job_id: str, presented: str) -> bool:
    """Constant-time check of a presented ``ddl-auth`` value."""
    return hmac.compare_digest(grpc_token(secret_hex, job_id), presented or "")
