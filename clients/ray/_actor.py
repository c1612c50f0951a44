"""What both Ray executors share: the actor that runs a rank or an elastic worker as a
fresh process (:mod:`ddl.launcher.engine_ranks`), the job secret sealed for it, and the
settings (see :mod:`ddl.ray`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Tuple

from ddl._client_api import engine_ranks

_HKDF_INFO = b"ddl-ray-job-secret"


def _seal(secret: str, peer_public: bytes, rank: int) -> Tuple[bytes, bytes, bytes]:
    """(driver public key, nonce, ciphertext) of ``secret`` for the actor of ``rank``."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import (X25519PrivateKey,
                                                                   X25519PublicKey)
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    mine = X25519PrivateKey.generate()
    key = _derive(mine.exchange(X25519PublicKey.from_public_bytes(peer_public)))
    nonce = os.urandom(12)
    sealed = ChaCha20Poly1305(key).encrypt(nonce, secret.encode(), b"rank %d" % rank)
    return mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw), nonce, sealed


def _derive(shared: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=_HKDF_INFO).derive(shared)


class _Worker:
    """One rank's actor (made into a Ray actor class at :meth:`RayExecutor.start`)."""

    def __init__(self, rank: int):
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        self.rank = rank
        self._key = X25519PrivateKey.generate()

    def hello(self) -> Tuple[str, bytes, int, str]:
        """(this node's address, this actor's public key, pid, Ray node id)."""
        import ray
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
        public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return (ray.util.get_node_ip_address(), public, os.getpid(),
                ray.get_runtime_context().get_node_id())

    def free_port(self) -> int:
        return engine_ranks.free_port()

    def _open(self, sealed: Tuple[bytes, bytes, bytes]) -> str:
        """The job secret that :func:`_seal` sealed for this actor."""
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        driver_public, nonce, ciphertext = sealed
        key = _derive(self._key.exchange(X25519PublicKey.from_public_bytes(driver_public)))
        return ChaCha20Poly1305(key).decrypt(nonce, ciphertext, b"rank %d" % self.rank).decode()

    def run(self, payload: bytes, size: int, rendezvous: str, sealed: Tuple[bytes, bytes, bytes],
            start_timeout: float, env: Mapping[str, str]):
        return engine_ranks.run_rank(payload, self.rank, size, self._open(sealed), rendezvous,
                                     start_timeout, env)

    def run_elastic(self, payload: bytes, sealed: Tuple[bytes, bytes, bytes],
                    env: Mapping[str, str]):
        """Elastic worker ``self.rank`` (:class:`ElasticRayExecutor`): ``env`` names its
        driver (``DDL_ELASTIC_ADDR``, ``DDL_ELASTIC_WORKER``, ``DDL_JOB_ID``)."""
        return engine_ranks.run_process(payload, self.rank, env,
                                        {"DDL_JOB_SECRET": self._open(sealed)})


@dataclass(frozen=True)
class Settings:
    """What :meth:`RayExecutor.create_settings` makes: ``timeout_s`` bounds the job's
    start-up (``DDL_START_TIMEOUT``), ``placement_group_timeout_s`` the wait for the
    placement group's resources."""

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0


def create_settings(timeout_s: float = 30.0, placement_group_timeout_s: float = 100.0,
                    **_ignored: Any) -> Settings:
    """Horovod's settings factory (its ssh and NIC arguments mean nothing here)."""
    return Settings(float(timeout_s), float(placement_group_timeout_s))
