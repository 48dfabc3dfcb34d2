"""Reading one plane template from the tensors: the grammar's axes of a template
(``NL_X_NB_BS_NH_HS``...) matched against a tensor's shape and strides, giving the byte
strides of block, token, head and chunk (:func:`_read_template`), and the nested list
levels walked down to the leaf tensors (:func:`walk_leaves`). Used by
:class:`kvcore.spec.Spec`; raises :class:`~kvcore.GeometryError` for tensors the
template does not describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcore.aliasing import _check_no_alias, _describe_tensor
from kvcore.errors import GeometryError
from kvcore.strides import PlaneStrides


def walk_leaves(node: Any, depth: int, where: str = "kv_caches") -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Flatten ``depth`` list levels into ``[(index_path, tensor), ...]`` in container order.

    Raises:
        GeometryError: a level is not a list/tuple, is empty, or a leaf is not a tensor.
    """
    if depth == 0:
        if not isinstance(node, torch.Tensor):
            raise GeometryError(f"{where} should be a torch.Tensor here, got {type(node).__name__}")
        return [((), node)]
    if not isinstance(node, (list, tuple)) or len(node) == 0:
        kind = type(node).__name__ if not isinstance(node, (list, tuple)) else "an empty list"
        raise GeometryError(f"{where} should be a non-empty list here ({depth} list level(s) left), got {kind}")
    out = []
    for i, child in enumerate(node):
        for path, t in walk_leaves(child, depth - 1, f"{where}[{i}]"):
            out.append(((i,) + path, t))
    return out


_QUANTIZED = tuple(d for d in (getattr(torch, n, None) for n in ("quint8", "qint8", "qint32", "quint4x2", "quint2x4")) if d is not None)


def _refuse_quantized(dt: Any, what: str) -> None:
    """Torch's quantized dtypes keep their bytes behind a quantizer (scale, zero point) that a
    byte-moving kernel cannot honour; refuse them at the door."""
    if dt in _QUANTIZED:
        raise GeometryError(
            f"{what} is {dt}, a torch quantized dtype: its values live behind a quantizer (scale and zero point) that a byte "
            "transfer cannot carry. Pass the engine's plain tensors instead (uint8/int8 values, and their scales and zeros as "
            "planes of their own: K=...+KS=...)"
        )


@dataclass
class _Read:
    """What the tensors of one tensor template say: sizes, the byte strides of one K/V
    plane, and the deltas between layers and between K and V inside a tensor."""

    sizes: dict[str, int]
    strides: PlaneStrides
    num_layers: int
    num_heads: int
    head_size: int
    esz: int
    isz: int
    num_blocks: int | None
    block_size: int | None
    num_slots: int
    layer_delta: int
    kv_delta: int
    ref: torch.Tensor


def _head_runs(axes: list[tuple[int, int]], esz: int, at: str, ref: torch.Tensor) -> tuple[int, int, int, int, int]:
    """A head's element axes ``[(count, byte stride)]`` (outermost first) as
    ``(chunk stride, chunk_bytes, n_chunks, sub stride, n_sub)``: axes that continue each other
    merge, a contiguous innermost run is one chunk's run, and at most two strided levels may
    remain (chunks, and strided runs inside a chunk: :class:`PlaneStrides`)."""
    stack: list[tuple[int, int]] = []  # innermost first
    for n, s in reversed([(n, s) for n, s in axes if n > 1]):
        if stack and s == stack[-1][0] * stack[-1][1]:
            stack[-1] = (stack[-1][0] * n, stack[-1][1])
        else:
            stack.append((n, s))
    run = esz
    if stack and stack[0][1] == esz:
        run = stack[0][0] * esz
        stack = stack[1:]
    if not stack:
        return 0, run, 1, 0, 1
    if len(stack) == 1:
        return stack[0][1], run, stack[0][0], 0, 1
    if len(stack) == 2:
        (n_sub, sub), (n_chunks, chunk) = stack
        return chunk, run, n_chunks, sub, n_sub
    raise GeometryError(
        f"{at}: a head's elements form {len(stack)} strided levels ({_describe_tensor(ref)}); kvcore addresses a head as chunks "
        "of strided runs of contiguous elements (two strided levels at most)"
    )


def _read_template(at: str, syn: Any, leaves: list, node: Any, dtype: torch.dtype, params: dict, where: str) -> _Read:
    """Read one tensor template's geometry from its tensors (all of one shape and stride).

    Args:
        at: ``"format NAME"`` (or ``"format NAME plane 'K'"``), for messages.
        syn: the template's :class:`~kvcore.grammar.Syntax`.
        leaves: ``walk_leaves`` of ``node``.
        dtype: the element dtype (the tensors' own, or the one they are a byte view of).
        where: the container's name in messages (``kv_caches`` or ``kv_caches['K']``).
    """
    sizes: dict[str, int] = {}
    for depth, tok in enumerate(syn.list_levels):
        lens = {len(_node_at(node, p[:depth])) for p, _ in leaves}
        if len(lens) != 1:
            raise GeometryError(f"{at}: list level {tok} has different lengths {sorted(lens)}")
        sizes[tok] = lens.pop()
    if sizes.get("TWO", 2) != 2:
        raise GeometryError(f"{at}: the TWO list level must hold 2 entries (K, V), got {sizes['TWO']}")
    nd = len(syn.axes)
    ref_path, ref = leaves[0]
    for path, t in leaves:
        if t.dim() != nd:
            raise GeometryError(
                f"{at} expects {nd}-D tensors {syn.symbolic()}, but {where}{list(path)} is {t.dim()}-D ({_describe_tensor(t)})"
            )
        if tuple(t.shape) != tuple(ref.shape) or tuple(t.stride()) != tuple(ref.stride()):
            raise GeometryError(
                f"{at}: {where}{list(path)} ({_describe_tensor(t)}) differs from {where}{list(ref_path)} "
                f"({_describe_tensor(ref)}); a layout is uniform across its layers (use detect_per_layer for hybrid models)"
            )
    for i, tok in enumerate(syn.axes):
        n = int(ref.shape[i])
        lit = {"TWO": 2, "ONE": 1}.get(tok)
        if lit is not None and n != lit:
            raise GeometryError(f"{at}: axis {i} ({tok}) must have size {lit}, got {n} ({_describe_tensor(ref)})")
        if n == 0 and tok in ("NB", "NBBS"):
            raise GeometryError(
                f"{at}: axis {i} ({tok}) has size 0 ({_describe_tensor(ref)}): the pool has 0 blocks; a KV cache "
                "needs at least one block: detect it after the engine allocated its blocks"
            )
        if n == 0:
            raise GeometryError(
                f"{at}: axis {i} ({tok}) has size 0 ({_describe_tensor(ref)}); a KV cache needs at least "
                "one block, one token per block, one head and one element"
            )
        if tok not in ("TWO", "ONE"):
            sizes[tok] = n
    isz = ref.element_size()
    esz = torch.empty(0, dtype=dtype).element_size()
    st = {tok: int(ref.stride(i)) * isz for i, tok in enumerate(syn.axes) if tok != "ONE"}
    for tok, s in st.items():
        if s < 0:
            raise GeometryError(f"{at}: negative stride on axis {tok} ({_describe_tensor(ref)}); flip the view first")
    etok = syn.element_token
    if etok is None:  # a plane template without an element axis: one element per head
        if esz != isz:
            raise GeometryError(
                f"{at}: a plane without an element axis holds one element per head, so its tensors must be {dtype} "
                f"themselves, not a {ref.dtype} view of it; add the element axis (HS) to read bytes as {dtype}"
            )
        inner_n, inner_s = 1, esz
    else:
        inner_tok = {"HS": "HS", "CS": "CS", "HSC": "HSE"}[etok]
        e_axis = syn.axis(inner_tok)
        if e_axis is None:
            raise GeometryError(f"{at}: the element axis {inner_tok} must be a tensor axis")
        inner_units, inner_s = sizes[inner_tok], st[inner_tok]
        if esz != isz:
            if inner_s != isz:
                raise GeometryError(
                    f"{at}: the tensors are {ref.dtype} but carry {dtype}; that needs a contiguous "
                    f"element axis, and {inner_tok} has stride {ref.stride(e_axis)}"
                )
            if (inner_units * isz) % esz:
                raise GeometryError(
                    f"{at}: the {inner_tok} axis holds {inner_units * isz} bytes, not a whole number of {dtype} elements ({esz} B)"
                )
            inner_n, inner_s = inner_units * isz // esz, esz
        else:
            inner_n = inner_units
    if etok == "CS":
        hs = int(params.get("head_size") or 0) or (inner_n // 2)
        if inner_n % 2 and not params.get("head_size"):
            raise GeometryError(f"{at}: packed K|V axis CS={inner_n} is odd; K and V head sizes must be given (head_size)")
        if 2 * hs != inner_n:
            raise GeometryError(
                f"{at}: CS={inner_n} elements but head_size={hs}: K and V head sizes differ "
                f"(K {hs}, V {inner_n - hs}); the staging layout [2, NL, T, NH*HS] needs equal K and V head sizes"
            )
        head_axes = [(hs, inner_s)]
    elif etok == "HSC":
        hs = sizes["HSC"] * inner_n
        head_axes = [(sizes["HSC"], st["HSC"]), (inner_n, inner_s)]
    elif etok == "HS":
        hs = inner_n
        head_axes = [(inner_n, inner_s)]
    else:
        hs, head_axes = 1, []
    chunk, chunk_bytes, n_chunks, sub, n_sub = _head_runs(head_axes, esz, at, ref)
    tg = tgs = 0
    if syn.has("NBBS"):
        num_blocks, block_size, num_slots = None, None, sizes["NBBS"]
        blk, tokst = st["NBBS"], 0
        sizes["PBS"] = sizes["NBBS"]
        tok_extents: list[tuple[str, int, int]] = []
    else:
        num_blocks, blk = sizes["NB"], st["NB"]
        if syn.has("BSC"):
            ng, g = sizes["BSC"], sizes["BSE"]
            block_size = ng * g
            tok_e, tok_g = st["BSE"], st["BSC"]
            tok_extents = [("token", g, tok_e), ("token group", ng, tok_g)]
            if ng == 1 or tok_g == g * tok_e:
                tokst = tok_e  # the groups continue each other: one token axis
            elif g == 1:
                tokst = tok_g
            else:
                tokst, tg, tgs = tok_e, g, tok_g
        else:
            block_size, tokst = sizes["BS"], st["BS"]
            tok_extents = [("token", block_size, tokst)]
        num_slots = num_blocks * block_size
    head, nh = st.get("NH", 0), sizes.get("NH", 1)
    strides = PlaneStrides(
        block=blk,
        token=tokst,
        head=head,
        chunk=chunk,
        chunk_bytes=chunk_bytes,
        n_chunks=n_chunks,
        token_group=tg,
        token_group_stride=tgs,
        sub=sub,
        n_sub=n_sub,
    )
    kv_delta = st["TWO"] if syn.axis("TWO") is not None else (hs * inner_s if etok == "CS" else 0)
    num_layers = sizes.get("NL", 1)
    layer_delta = st.get("NL", 0) if syn.axis("NL") is not None else 0
    # axes living inside one tensor must not alias each other
    extents = [
        ("block", num_blocks or num_slots, blk),
        *tok_extents,
        ("head", nh, head),
        ("chunk", n_chunks, chunk),
        ("sub-run", n_sub, sub),
    ]
    if syn.axis("TWO") is not None or etok == "CS":
        extents.append(("K/V", 2, kv_delta))
    if syn.axis("NL") is not None:
        extents.append(("layer", num_layers, layer_delta))
    _check_no_alias(at, extents, chunk_bytes, ref)
    return _Read(
        sizes=sizes,
        strides=strides,
        num_layers=num_layers,
        num_heads=nh,
        head_size=hs,
        esz=esz,
        isz=isz,
        num_blocks=num_blocks,
        block_size=block_size,
        num_slots=num_slots,
        layer_delta=layer_delta,
        kv_delta=kv_delta,
        ref=ref,
    )


def _node_at(node: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        node = node[i]
    return node
