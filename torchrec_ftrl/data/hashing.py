"""Stable value -> row-id hashing and the dense log transform (no Python ``hash()``: it is salted)."""

from __future__ import annotations

import hashlib
import math


def hex_id(value: str, num_embeddings: int) -> int:
    """``int(value, 16) % num_embeddings`` (Criteo's 8-hex-digit categorical values).

    Raises:
        ValueError: ``value`` is not a base-16 integer (e.g. ``"zz"``, ``"-1f"`` is accepted by int()
            so a sign is rejected explicitly).
    """
    if not value or value[0] in "+-" or value.strip() != value:
        raise ValueError(f"not a hex value: {value!r}")
    return int(value, 16) % num_embeddings


def string_id(value: str, num_embeddings: int) -> int:
    """First 8 bytes of BLAKE2b(UTF-8 value) as a little-endian unsigned int, mod ``num_embeddings``.

    Stable across processes, platforms and Python versions (unlike ``hash(str)``).
    """
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_embeddings


def log_transform(x: float) -> float:
    """``log(1 + max(x, 0))`` (natural log): the usual Criteo dense transform; negatives clip to 0."""
    return math.log1p(x) if x > 0 else 0.0
