"""SGLang's DSA/NSA indexer pool: uint8 rows of a page's fp8 keys then their scales, read in
the kernel's pages."""

from __future__ import annotations

import torch

from kvcore import AmbiguousLayoutError, Candidate, Detection, DetectionError
from kvcore_sglang.deciding import _decide, _same
from kvcore_sglang.formats import INDEXER_FORMAT
from kvcore_sglang.hints import SGLangHints, element_dtype
from kvcore_sglang.indexer import RECORD_SCALE_BYTES, index_page_view

_SKIP_TOPK_REASON = (
    "SGLang DSA indexer placeholders: 0-row (0, W) index-K tensors of layers that reuse the previous layer's top-k "
    "(0.5.23 index_key_cache.py::IndexKeyCache._layer_num_pages, skip_topk_layers); they hold no tokens"
)


def _indexer(ts: list[torch.Tensor], h: SGLangHints) -> Detection:
    """A DSA/NSA indexer pool. 0-row layers (skip-top-k placeholders) are left out of the
    layout: ``Detection.layer_ids`` names the layers that hold index keys."""
    keep = [i for i, t in enumerate(ts) if t.shape[0] > 0]
    if not keep:
        return Detection(format=None, excluded=_SKIP_TOPK_REASON)
    det = _indexer_rows([ts[i] for i in keep], h)
    if len(keep) < len(ts):
        det.layer_ids = tuple(keep)
        det.note = f"{det.note}; layers {[i for i in range(len(ts)) if i not in keep]} are 0-row skip-top-k placeholders"
    return det


def _kernel_pages_per_row(row_tokens: int, h: SGLangHints) -> int:
    """How many kernel pages SGLang views one indexer buffer row as (0.5.23
    ``IndexKeyCache._kernel_view``: ``page_size // index_kpool // index_page_size``).

    Raises:
        DetectionError: a hint does not divide the row or contradicts another.
        AmbiguousLayoutError: nothing given decides (a 0.5.23 pool may split rows under
            decode-context parallelism; the tensors cannot show it).
    """
    dcp, repl = h.attn_dcp_size, h.dcp_replicated
    derived = None
    if repl is False or dcp == 1:
        derived = 1
    elif repl and dcp is not None:
        derived = dcp
    if h.index_page_size is not None:
        ips = h.index_page_size
        if row_tokens % ips:
            raise DetectionError(
                f"sglang: hint index_page_size={ips} does not divide the indexer buffer row of {row_tokens} records "
                "(page_size // index_kpool); SGLang's kernel view re-views each row as whole kernel pages"
            )
        if derived is not None and row_tokens // ips != derived:
            raise DetectionError(
                f"sglang: hint index_page_size={ips} contradicts attn_dcp_size={dcp}, dcp_replicated={repl}: those give "
                f"kernel pages of {row_tokens // derived} tokens for rows of {row_tokens} records"
            )
        return row_tokens // ips
    if derived is not None:
        if row_tokens % derived:
            raise DetectionError(
                f"sglang: attn_dcp_size={dcp} does not divide the indexer buffer row of {row_tokens} records; "
                "SGLang's index_page_size = page_size // index_kpool // attn_dcp_size needs it to"
            )
        return derived
    v = h.version() if repl is None else None
    if v is not None and v[:3] <= (0, 5, 3):
        return 1  # 0.5.3 NSATokenToKVPool: one page per row, no kernel-page split
    raise AmbiguousLayoutError(
        f"sglang: a DSA indexer buffer row of {row_tokens} records is one kernel page, or several under decode-context "
        "parallelism (0.5.23 DSATokenToKVPool: index_page_size = page_size // index_kpool, divided by attn_dcp_size when "
        "dcp_replicated; IndexKeyCache._kernel_view), and the tensors cannot show which. Pass index_page_size, or "
        "attn_dcp_size with dcp_replicated, or sglang_version='0.5.3'",
        candidates=[f"{INDEXER_FORMAT} pages of {row_tokens // r} tokens" for r in range(1, row_tokens + 1) if row_tokens % r == 0][:4],
        hints=["index_page_size", "attn_dcp_size", "dcp_replicated", "sglang_version"],
    )


def _indexer_rows(ts: list[torch.Tensor], h: SGLangHints) -> Detection:
    ref = _same(ts, "kv_caches")
    width = int(ref.shape[1])
    if ref.dtype != torch.uint8:
        if h.page_size is None or width % h.page_size:
            raise DetectionError(
                f"sglang: 2-D per-layer tensors {tuple(ref.shape)} {ref.dtype} look like a bf16 DSA indexer pool "
                "(num_pages, page_size * index_head_dim); pass the page_size hint to split its pages"
            )
        ps = h.page_size
        views = [t.unflatten(1, (ps, 1, width // ps)) for t in ts]
        return _decide(
            [
                Candidate(
                    "NL_X_NB_BS_ONE_HS", views, element_dtype(ref.dtype, h), note="SGLang DSA indexer pool (bf16 keys)", label="indexer"
                )
            ],
            "indexer pool",
            [],
        )
    if h.index_kpool not in (None, 1):
        raise DetectionError(
            f"sglang: index_kpool={h.index_kpool} pools one index key per {h.index_kpool} tokens, so token locs do not address "
            "its records (0.5.23 IndexKeyCache.move asserts index_kpool == 1); kvcore moves token-addressed indexer pools only"
        )
    if h.page_size is not None:
        ps = h.page_size
        if width % ps or (width // ps) not in RECORD_SCALE_BYTES:
            raise DetectionError(
                f"sglang: indexer pages of {width} bytes are not page_size {ps} records of "
                f"{' or '.join(map(str, RECORD_SCALE_BYTES))} bytes (index_head_dim 128 fp8 + fp32 scale per token)"
            )
    else:
        fits = [w for w in RECORD_SCALE_BYTES if width % w == 0]
        if not fits:
            raise DetectionError(
                f"sglang: 2-D uint8 tensors {tuple(ref.shape)} are not a DSA/NSA indexer pool: a page holds page_size records of "
                f"{' or '.join(map(str, RECORD_SCALE_BYTES))} bytes; pass page_size if the record width differs"
            )
        ps = width // fits[0]
    r = _kernel_pages_per_row(ps, h)
    ips = ps // r
    if r > 1:
        try:  # IndexKeyCache._kernel_view: buffer.view(-1, row // r), a view of the caller's tensor
            ts = [t.view(-1, width // r) for t in ts]
        except RuntimeError:
            raise DetectionError(
                f"sglang: indexer buffers {tuple(ref.shape)} with strides {tuple(ref.stride())} cannot be re-viewed as kernel pages "
                f"of {ips} tokens (SGLang allocates them contiguous); pass the pool's own tensors"
            ) from None
    views = [index_page_view(t, ips) for t in ts]
    note = f"SGLang DSA/NSA indexer pool: pages of {ips} tokens, fp8 keys then fp32 scales"
    if r > 1:
        note += f" ({r} kernel pages per buffer row of {ps} records)"
    params = {"scale_bytes": RECORD_SCALE_BYTES[width // ps]}
    return _decide([Candidate(INDEXER_FORMAT, views, None, params=params, note=note, label="indexer")], "indexer pool", ["page_size"])
