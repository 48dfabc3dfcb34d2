"""Specs for the vLLM layouts whose token rows have no single address pattern.

Returned by the ``kvcore_spec`` hook (see :mod:`kvcore_vllm.plugin`); every other vLLM
format is served by kvcore's generic spec, which reads the tensors' own strides.

* :class:`PagedAttentionSpec` -- ``NL_X_TWO_NB_NH_HS_BS``: vLLM 0.11's CPU backend
  (``TORCH_SDPA``) allocates ``(2, NB, BS*NH*HS)`` and its paged-attention kernels read
  V as ``(NB, NH, HS, BS)`` (the name's order: V is transposed) and K as
  ``(NB, NH, HS/x, BS, x)`` with ``x = 16 // element_size``: K is cut into 16-byte
  chunks interleaved across the block's tokens. Source: vLLM 0.11.0
  ``vllm/v1/attention/backends/cpu_attn.py::_PagedAttention.get_kv_cache_shape`` and
  ``::_PagedAttention.split_kv_cache`` (engine_layouts.md §1.9).
* :class:`BlockedScaleSpec` -- ``NL_X_NB_BSV_BSS``: blocked-scale records (DeepSeek-V3.2
  lightning indexer ``(NB, BS, 132)`` uint8, DeepSeek-V4 fp8_ds_mla MLA pages): per block all
  BS tokens' value bytes, then all BS tokens' scale bytes. A token's staged row is
  ``[values | scales]`` (``W = V + S`` bytes). Sources: vLLM 0.11.0
  ``vllm/v1/attention/backends/mla/indexer.py`` and
  ``vllm/model_executor/models/deepseek_v2.py::DeepseekV32IndexerCache`` (head_size
  ``128 + 128 // 128 * 4 = 132``, dtype uint8); record/scale widths from LMCache
  ``specs/nl_x_nb_bsv_bss.py::BLOCKED_SCALE_RECORDS`` (lmcache_kv_format.md §6.4).
"""

from __future__ import annotations

import torch

from kvcore import GeometryError, Spec
from kvcore.spec import PlaneStrides, Segment, StrideTable

__all__ = ["PagedAttentionSpec", "BlockedScaleSpec", "BLOCKED_SCALE_RECORDS", "PAGED_ATTENTION_FORMAT", "BLOCKED_SCALE_FORMAT"]

PAGED_ATTENTION_FORMAT = "NL_X_TWO_NB_NH_HS_BS"
BLOCKED_SCALE_FORMAT = "NL_X_NB_BSV_BSS"

#: record bytes per token -> scale bytes per token (lmcache_kv_format.md §6.4).
BLOCKED_SCALE_RECORDS = {584: 8, 528: 16, 352: 32, 132: 4, 68: 4}

#: the paged-attention kernels' K chunk, in bytes (``x = 16 // element_size``).
K_CHUNK_BYTES = 16


class PagedAttentionSpec(Spec):
    """``NL_X_TWO_NB_NH_HS_BS``: tensors ``[2, NB, NH, HS, BS]`` (V's natural view of
    vLLM 0.11 CPU's ``(2, NB, BS*NH*HS)``). V is read through the generic strides (a
    transposed head: its HS elements are BS elements apart); K's plane is replaced by the
    16-byte-chunk pattern: token stride 16 B, chunk stride ``BS*16`` B, ``HS*esz/16``
    chunks of 16 B.

    Raises:
        GeometryError: the tensors are not ``[2, NB, NH, HS, BS]`` with a contiguous
            ``(NH, HS, BS)`` block, or ``HS * element_size`` is not a multiple of 16.
    """

    def _build(self) -> None:
        super()._build()
        tb = self.table
        esz = torch.empty(0, dtype=self.dtype).element_size()
        bs, hs, nh = self.block_size_, self.head_size_, self.num_heads_
        ref = self.leaves[0][1]
        if ref.element_size() != esz:
            raise GeometryError(
                f"format {self.format.name}: the CPU paged layout stores elements as themselves; got a {ref.dtype} view of {self.dtype}"
            )
        _, _, s_nh, s_hs, s_bs = ref.stride()
        if (bs > 1 and s_bs != 1) or (hs > 1 and s_hs != bs) or (nh > 1 and s_nh != hs * bs):
            raise GeometryError(
                f"format {self.format.name}: a block must be one contiguous [NH, HS, BS] run as vLLM 0.11 CPU allocates it "
                f"(strides {tuple(ref.stride())}); these strides are not that layout"
            )
        if (hs * esz) % K_CHUNK_BYTES:
            raise GeometryError(
                f"format {self.format.name}: K is stored in {K_CHUNK_BYTES}-byte chunks, so head_size*element_size must be a "
                f"multiple of {K_CHUNK_BYTES}; got head_size {hs} of {self.dtype}"
            )
        blk, head = tb.planes[1].block, hs * bs * esz
        # V (NB, NH, HS, BS): one element per chunk, HS chunks BS elements apart
        v = PlaneStrides(block=blk, token=esz, head=head, chunk=bs * esz, chunk_bytes=esz, n_chunks=hs)
        # K (NB, NH, HS/x, BS, x): 16-byte chunks, BS * 16 bytes apart
        k = PlaneStrides(
            block=blk,
            token=K_CHUNK_BYTES,
            head=head,
            chunk=bs * K_CHUNK_BYTES,
            chunk_bytes=K_CHUNK_BYTES,
            n_chunks=hs * esz // K_CHUNK_BYTES,
        )
        if bs == 1:  # one token per block: each head's run is contiguous
            v = PlaneStrides(block=blk, token=0, head=head, chunk=0, chunk_bytes=hs * esz, n_chunks=1)
            k = v
        self.table = StrideTable(
            num_layers=tb.num_layers,
            kv_size=tb.kv_size,
            block_size=tb.block_size,
            num_slots=tb.num_slots,
            num_heads=tb.num_heads,
            head_bytes=tb.head_bytes,
            dtype=tb.dtype,
            device=tb.device,
            planes=(k, v),
            bases=tb.bases,
        )


class BlockedScaleSpec(Spec):
    """``NL_X_NB_BSV_BSS``: a list of ``[NB, BS, W]`` byte tensors (uint8/int8), each block's
    ``BS * W`` bytes being ``BS * V`` value bytes then ``BS * S`` scale bytes
    (``W = V + S``; S from :data:`BLOCKED_SCALE_RECORDS`, or ``params={"scale_bytes": S}``).

    Geometry: num_heads 1, head_size W (bytes, dtype uint8), kv_size 1. The block stride
    is the tensor's own (a dim-0 padded pool keeps its padding).

    Raises:
        GeometryError: not 3-D byte tensors, an unknown record width without
            ``scale_bytes``, or a block whose bytes are not contiguous.
    """

    def _build(self) -> None:
        fmt = self.format
        ts = [t for _, t in self.leaves]
        ref = ts[0]
        for t in ts:
            if t.dim() != 3:
                raise GeometryError(f"format {fmt.name} expects 3-D [NB, BS, W] byte tensors, got shape {tuple(t.shape)}")
            if tuple(t.shape) != tuple(ref.shape) or tuple(t.stride()) != tuple(ref.stride()):
                raise GeometryError(
                    f"format {fmt.name}: layers differ (shape {tuple(t.shape)} stride {tuple(t.stride())} vs "
                    f"{tuple(ref.shape)} {tuple(ref.stride())}); use detect_per_layer for mixed caches"
                )
        if ref.element_size() != 1:
            raise GeometryError(f"format {fmt.name}: blocked-scale records are bytes (uint8/int8), got {ref.dtype}")
        if torch.empty(0, dtype=self.dtype).element_size() != 1:
            raise GeometryError(f"format {fmt.name}: blocked-scale records are opaque bytes; dtype {self.dtype} is not a byte type")
        nb, bs, w = (int(x) for x in ref.shape)
        s = int(self.params.get("scale_bytes") or BLOCKED_SCALE_RECORDS.get(w, 0))
        if s <= 0 or s >= w:
            raise GeometryError(
                f"format {fmt.name}: record width {w} B is not a known blocked-scale record "
                f"({', '.join(f'{k} B ({v} B scales)' for k, v in BLOCKED_SCALE_RECORDS.items())}); pass params scale_bytes"
            )
        if ref.stride(2) != 1 or (bs > 1 and ref.stride(1) != w):
            raise GeometryError(
                f"format {fmt.name}: a block's {bs}x{w} bytes must be contiguous (strides {tuple(ref.stride())}), "
                "because its values and scales are laid out block-wise, not per token"
            )
        blk = int(ref.stride(0))
        if nb > 1 and blk < bs * w:
            raise GeometryError(f"format {fmt.name}: block stride {blk} B is smaller than a block's {bs * w} B; blocks would alias")
        v = w - s
        plane = PlaneStrides(
            block=blk,
            token=v,
            head=0,
            chunk=0,
            chunk_bytes=v,
            n_chunks=1,
            extra=(Segment(offset=bs * v, token=s, head=0, nbytes=s),),
        )
        self.num_layers_ = len(ts)
        self.num_blocks_ = nb
        self.block_size_ = bs
        self.num_slots_ = nb * bs
        self.num_heads_ = 1
        self.head_size_ = w
        self.kv_size_ = 1
        self.axis_sizes = {"NL": len(ts), "NB": nb, "BS": bs, "VALS": v, "SCALES": s}
        self.table = StrideTable(
            num_layers=len(ts),
            kv_size=1,
            block_size=bs,
            num_slots=nb * bs,
            num_heads=1,
            head_bytes=w,
            dtype=self.dtype,
            device=self.device,
            planes=(plane,),
            bases=tuple(((t, t.storage_offset()),) for t in ts),
        )


SPECS = {PAGED_ATTENTION_FORMAT: PagedAttentionSpec, BLOCKED_SCALE_FORMAT: BlockedScaleSpec}
