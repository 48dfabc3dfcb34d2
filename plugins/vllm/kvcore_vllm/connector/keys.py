"""Store keys: a chunk of tokens is named by everything before it, as vLLM names blocks.

vLLM's prefix caching names block ``k`` of a request by a hash of (the hash of block
``k - 1``, the block's token ids, its extra keys) -- ``vllm/v1/core/kv_cache_utils.py::
hash_block_tokens`` (0.28-0.32), extra keys from ``generate_block_hash_extra_keys`` (LoRA
name, multimodal inputs, ``cache_salt``, prompt embeddings). The KV of a token depends on
exactly that: every token at or before it and the adapter it ran under. The store keys its
chunks the same way (SHA-256, chained), so two requests share a stored chunk exactly when
vLLM's prefix cache would let them share the block, at the store's own chunk size.

A *partial* chunk (the last ``n < chunk_size`` tokens of a prompt) has its own key, from its
parent's key and its ``n`` tokens; a lookup serves any prefix of a stored chunk's tokens
(the KV of token ``i`` depends on tokens ``<= i`` only), so a partial hit needs the token ids
themselves, which each stored chunk keeps (:mod:`.index`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ROOT", "chunk_key", "RequestKeys"]

#: the parent of a request's first chunk
ROOT = hashlib.sha256(b"kvcore-vllm-connector/root").digest()


def chunk_key(parent: bytes, tokens: Sequence[int], extra: Any = None) -> bytes:
    """SHA-256 of (parent key, the chunk's token ids as int64, ``repr(extra)``).

    Args:
        parent: the previous chunk's key (:data:`ROOT` for the first chunk).
        tokens: the chunk's token ids (a full or a partial chunk).
        extra: the chunk's extra keys as vLLM computes them (None for a plain text request);
            tuples of strings, ints and bytes, whose ``repr`` is stable.
    """
    h = hashlib.sha256(parent)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    h.update(repr(extra).encode())
    return h.digest()


class RequestKeys:
    """The keys of one request's full chunks, extended as its tokens grow.

    Args:
        chunk_size: tokens per chunk.
        extra_of: ``extra_of(start, end)`` -> the extra keys of tokens ``[start, end)``
            (None when the request has none); called once per chunk.
    """

    def __init__(self, chunk_size: int, extra_of: Callable[[int, int], Any] | None = None):
        self.chunk_size = chunk_size
        self._extra_of = extra_of
        self._keys: list[bytes] = []
        self._extra: list[Any] = []

    def __len__(self) -> int:
        return len(self._keys)

    def update(self, tokens: Sequence[int], upto: int | None = None) -> None:
        """Compute the keys of every full chunk among ``tokens[:upto]`` not keyed yet."""
        n = len(tokens) if upto is None else min(upto, len(tokens))
        c = self.chunk_size
        while (len(self._keys) + 1) * c <= n:
            k = len(self._keys)
            extra = self.extra(k * c, (k + 1) * c)
            self._keys.append(chunk_key(self.parent(k), list(tokens[k * c : (k + 1) * c]), extra))
            self._extra.append(extra)

    def extra(self, start: int, end: int) -> Any:
        return self._extra_of(start, end) if self._extra_of is not None else None

    def full(self, k: int) -> bytes:
        """Key of full chunk ``k`` (tokens ``[k*C, (k+1)*C)``); :meth:`update` first."""
        return self._keys[k]

    def parent(self, k: int) -> bytes:
        """Key of the chunk before chunk ``k`` (:data:`ROOT` for ``k == 0``)."""
        return ROOT if k == 0 else self._keys[k - 1]

    def partial(self, k: int, tokens: Sequence[int]) -> bytes:
        """Key of a partial chunk ``k`` holding ``tokens`` (fewer than ``chunk_size``)."""
        start = k * self.chunk_size
        return chunk_key(self.parent(k), list(tokens), self.extra(start, start + len(tokens)))
