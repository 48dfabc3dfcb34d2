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
* ``NL_X_NB_BSV_BSS`` -- blocked-scale records (DeepSeek-V3.2 lightning indexer
  ``(NB, BS, 132)`` uint8, DeepSeek-V4 fp8_ds_mla MLA pages): per block all BS tokens'
  value bytes, then all BS tokens' scale bytes. kvcore's core spec reads them from the
  grammar; this plugin supplies the engine fact it needs, the scale width per record width
  (:data:`BLOCKED_SCALE_RECORDS`, passed as ``params={"scale_bytes": S}``). Sources: vLLM
  0.11.0 ``vllm/v1/attention/backends/mla/indexer.py`` and
  ``vllm/model_executor/models/deepseek_v2.py::DeepseekV32IndexerCache`` (head_size
  ``128 + 128 // 128 * 4 = 132``, dtype uint8); record/scale widths from LMCache
  ``specs/nl_x_nb_bsv_bss.py::BLOCKED_SCALE_RECORDS`` (lmcache_kv_format.md §6.4).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvcore import GeometryError, Spec
from kvcore.spec import PlaneStrides

__all__ = ["PagedAttentionSpec", "BLOCKED_SCALE_RECORDS", "PAGED_ATTENTION_FORMAT"]

PAGED_ATTENTION_FORMAT = "NL_X_TWO_NB_NH_HS_BS"

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
        self.table = replace(
            tb,
            planes=(replace(tb.planes[0], strides=k), replace(tb.planes[1], strides=v)),
        )


#: vLLM 0.33 ROCM_ATTN LBHNC: the same K/V runs, the K and V head slots of a block side by side.
PAGED_ATTENTION_SLOTS_FORMAT = "NL_X_NB_TWO_NH_HS_BS"

SPECS = {PAGED_ATTENTION_FORMAT: PagedAttentionSpec, PAGED_ATTENTION_SLOTS_FORMAT: PagedAttentionSpec}
