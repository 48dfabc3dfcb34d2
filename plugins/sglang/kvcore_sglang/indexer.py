"""The DSA/NSA indexer key cache: blocked-scale pages, format ``NL_X_NB_BSV_BSS``.

SGLang allocates, per layer, one ``torch.uint8`` tensor
``(num_pages, page_size * (index_head_dim + index_head_dim // 128 * 4))`` =
``(num_pages, page_size * 132)``. Inside page ``p`` the first ``page_size * 128`` bytes
are the fp8 keys of its tokens (token ``t``: bytes ``[t*128, (t+1)*128)``), the rest
the fp32 scales (token ``t``: bytes ``page_size*128 + [t*4, (t+1)*4)``).
Sources: SGLang 0.5.3 ``python/sglang/srt/mem_cache/memory_pool.py::NSATokenToKVPool.__init__``
(comment "buf[i, :page_size * head_dim] for fp8 data, buf[i, page_size * head_dim:]
.view(float32) for scale"; ``index_head_dim`` must be 128, ``page_size`` 64 on CUDA);
0.5.23 ``DSATokenToKVPool`` / ``index_key_cache.py::IndexKeyCache``.

A token has no single address pattern (its 128 key bytes and its 4 scale bytes live in
two regions of the page): kvcore's core spec for ``NL_X_NB_BSV_BSS`` describes each token
row as a main run (the 128 key bytes, token stride 128) plus one segment (the 4 scale
bytes at page offset ``page_size * 128``, token stride 4), given the scale width, which
detection passes as ``params={"scale_bytes": 4}`` (:data:`RECORD_SCALE_BYTES`). A staged
row is ``[128 key bytes | 4 scale bytes]``: uint8, kv_size 1, one head, head_size 132.
The detector hands the core each page re-viewed as ``[page_size, 132]`` bytes (a view:
same storage, same offsets), the shape vLLM's DeepSeek-V3.2 indexer cache has.
Gather by page with :func:`kvcore.gather_blocks`, or by token slot (``loc``) with
:func:`kvcore.gather`.
"""

from __future__ import annotations

import torch

from kvcore import GeometryError

__all__ = ["RECORD_SCALE_BYTES", "index_page_view"]

#: bytes of one token's record -> bytes of its scales, for the record widths SGLang's
#: indexer allocates: index_head_dim 128 fp8 + 128 // 128 * 4 scale bytes.
RECORD_SCALE_BYTES: dict[int, int] = {132: 4}


def index_page_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """View SGLang's 2-D indexer buffer ``(num_pages, page_size * W)`` as
    ``[num_pages, page_size, W]`` (no copy; the page's bytes keep their order).

    Raises:
        GeometryError: the page is not ``page_size`` whole records or not contiguous.
    """
    if buf.dim() != 2 or buf.shape[1] % page_size:
        raise GeometryError(
            f"SGLang indexer buffer of shape {tuple(buf.shape)} is not (num_pages, page_size * record) for page_size {page_size}"
        )
    if buf.stride(1) != 1:
        raise GeometryError(f"SGLang indexer buffer pages must be contiguous bytes, got strides {tuple(buf.stride())}")
    return buf.unflatten(1, (page_size, buf.shape[1] // page_size))
