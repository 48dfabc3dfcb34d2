"""The DSA/NSA indexer key cache: blocked-scale pages, format ``NL_X_NB_BSV_BSS``.

SGLang allocates, per layer, one ``torch.uint8`` tensor
``(num_pages, page_size * (index_head_dim + index_head_dim // 128 * 4))`` =
``(num_pages, page_size * 132)``. Inside page ``p`` the first ``page_size * 128`` bytes
are the fp8 keys of its tokens (token ``t``: bytes ``[t*128, (t+1)*128)``), the rest
the fp32 scales (token ``t``: bytes ``page_size*128 + [t*4, (t+1)*4)``).
Sources: SGLang 0.5.3 ``python/sglang/srt/mem_cache/memory_pool.py::NSATokenToKVPool.__init__``
(comment "buf[i, :page_size * head_dim] for fp8 data, buf[i, page_size * head_dim:]
.view(float32) for scale"; ``index_head_dim`` must be 128, ``page_size`` 64 on CUDA);
0.5.23 ``DSATokenToKVPool`` / ``index_key_cache.py::IndexKeyCache``
(``../shared/reference/engine_layouts.md`` §2.3).

A token has no single address pattern (its 128 key bytes and its 4 scale bytes live in
two regions of the page), so :class:`IndexerSpec` describes each token row as a main
run (the 128 key bytes, token stride 128) plus one :class:`kvcore.spec.Segment` (the 4
scale bytes at page offset ``page_size * 128``, token stride 4). A staged row is
``[128 key bytes | 4 scale bytes]``: uint8, kv_size 1, one head, head_size 132.
The detector hands the spec each page re-viewed as ``[page_size, 132]`` bytes (a view:
same storage, same offsets), the shape vLLM's DeepSeek-V3.2 indexer cache has.
Gather by page with :func:`kvcore.gather_blocks`, or by token slot (``loc``) with
:func:`kvcore.gather`.
"""

from __future__ import annotations

import torch

from kvcore import GeometryError
from kvcore.spec import PlaneStrides, Segment, Spec, StrideTable, _check_no_alias

__all__ = ["IndexerSpec", "RECORD_SCALE_BYTES", "index_page_view"]

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


class IndexerSpec(Spec):
    """Spec for ``NL_X_NB_BSV_BSS``: a list of NL uint8 tensors ``[NB, BS, W]`` whose
    pages hold ``BS`` records' value bytes, then their scale bytes.

    ``params``: ``scale_bytes`` (default from :data:`RECORD_SCALE_BYTES` by ``W``).

    Raises:
        GeometryError: tensors that are not uint8 ``[NB, BS, W]`` with contiguous pages,
            an unknown record width without ``scale_bytes``, a dtype other than uint8,
            or pages that overlap or reach past the storage.
    """

    def _build(self) -> None:
        fmt = self.format
        if self.syntax.list_levels != ("NL",):
            raise GeometryError(f"format {fmt.name}: IndexerSpec serves a list of per-layer tensors (NL_X_...)")
        if self.storage_dtype != torch.uint8 or self.dtype != torch.uint8:
            raise GeometryError(
                f"format {fmt.name}: blocked-scale pages are bytes (torch.uint8: fp8 values and fp32 scales together), "
                f"got tensors of {self.storage_dtype} read as {self.dtype}"
            )
        ref = self.leaves[0][1]
        for path, t in self.leaves:
            if t.dim() != 3:
                raise GeometryError(
                    f"format {fmt.name}: kv_caches{list(path)} should be [NB, BS, record] bytes, got shape {tuple(t.shape)}"
                )
            if tuple(t.shape) != tuple(ref.shape) or tuple(t.stride()) != tuple(ref.stride()):
                raise GeometryError(
                    f"format {fmt.name}: kv_caches{list(path)} shape {tuple(t.shape)} stride {tuple(t.stride())} differs from the first "
                    f"layer's {tuple(ref.shape)} / {tuple(ref.stride())}; use detect_per_layer for mixed caches"
                )
        nb, bs, w = (int(x) for x in ref.shape)
        scale = int(self.params.get("scale_bytes") or RECORD_SCALE_BYTES.get(w, 0))
        if not (0 < scale < w) or scale % 4:
            known = ", ".join(f"{k} (scales {v})" for k, v in RECORD_SCALE_BYTES.items())
            raise GeometryError(
                f"format {fmt.name}: record width {w} bytes has no known scale width; known widths: {known}, "
                "or pass params={'scale_bytes': n} (a positive multiple of 4 below the record width)"
            )
        vals = w - scale
        if ref.stride(2) != 1 or ref.stride(1) != w:
            raise GeometryError(
                f"format {fmt.name}: a page must be {bs * w} contiguous bytes (strides (*, {w}, 1)), got strides {tuple(ref.stride())}"
            )
        block = int(ref.stride(0))
        plane = PlaneStrides(
            block=block,
            token=vals,
            head=0,
            chunk=0,
            chunk_bytes=vals,
            n_chunks=1,
            extra=(Segment(offset=bs * vals, token=scale, head=0, nbytes=scale),),
        )
        nl = len(self.leaves)
        self.num_layers_, self.kv_size_, self.num_heads_ = nl, 1, 1
        self.num_blocks_, self.block_size_, self.num_slots_ = nb, bs, nb * bs
        self.head_size_ = w
        self.axis_sizes = {"NL": nl, "NB": nb, "BS": bs, "VALS": vals, "SCALES": scale}
        self.table = StrideTable(
            num_layers=nl,
            kv_size=1,
            block_size=bs,
            num_slots=nb * bs,
            num_heads=1,
            head_bytes=w,
            dtype=torch.uint8,
            device=self.device,
            planes=(plane,),
            bases=tuple(((t, t.storage_offset()),) for _, t in self.leaves),
        )
        _check_no_alias(fmt.name, [("block", nb, block)], bs * w, ref)
