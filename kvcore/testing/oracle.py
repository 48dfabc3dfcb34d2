"""The semantic oracle: values that say where they belong, written and read through the
engine's own view (a fixture's ``kv_view``), never through kvcore's stride table.

Every element of a cache is filled with a *code* that encodes (layer, K/V, slot, head,
element). A gather must return exactly the codes of the slots it was asked for; a scatter
must change exactly the bytes the engine's view says those slots occupy. A wrong element
is reported with its coordinates, and when the wrong value is itself a code, with the
coordinates it came from, so "layer 0 K holds layer 0 V" reads as a swapped K/V at once.

All comparisons are on integer views of the element bits (``uint8``/``int16``/``int32``/
``int64`` for 1/2/4/8-byte elements), so float8, NaN payloads and negative zero compare
exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.detection import tensors_in
from kvcore.errors import GeometryError

__all__ = [
    "INT_OF_SIZE",
    "int_view",
    "Encoding",
    "Mismatch",
    "leaves",
    "Snapshot",
    "Plane",
    "PlaneShape",
    "PlanesEncoding",
    "TokenGroups",
    "planes",
    "fill_codes",
    "write_rows",
    "first_mismatch",
    "special_patterns",
]

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

KV_NAMES = ("K", "V")


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width (a view, never a copy)."""
    return t.view(INT_OF_SIZE[t.element_size()])


def _mask(width: int) -> int:
    return (1 << (8 * width)) - 1


def to_unsigned(t: torch.Tensor) -> torch.Tensor:
    """int64 with the element bits as an unsigned number (for comparing and printing)."""
    w = t.element_size()
    return t.to(torch.int64) & _mask(w) if w < 8 else t.to(torch.int64)


def from_unsigned(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 unsigned bit patterns -> the integer dtype of that width (wrapping)."""
    w = torch.empty(0, dtype=dtype).element_size()
    if w == 8:
        return codes.to(torch.int64)
    c = codes & _mask(w)
    if dtype != torch.uint8:
        half = 1 << (8 * w - 1)
        c = torch.where(c >= half, c - (1 << (8 * w)), c)
    return c.to(dtype)


@dataclass(frozen=True)
class Encoding:
    """Codes for one cache geometry.

    ``code(layer, kv, slot, head, element) = 1 + index`` where ``index`` enumerates the
    cache in (layer, K/V, slot, head, element) order, so a code can be decoded back to its
    coordinates. Staged source rows for a scatter use a second range (``src_code``). When
    the geometry has more elements than the element width can number (1- or 2-byte
    elements of a large cache), codes are a hash of the index instead: still position
    dependent, no longer decodable.
    """

    num_layers: int
    kv_size: int
    num_slots: int
    num_heads: int
    head_size: int
    width: int  # bytes per element

    @property
    def count(self) -> int:
        return self.num_layers * 2 * self.num_slots * self.num_heads * self.head_size

    @property
    def exact(self) -> bool:
        return 2 * self.count + 2 < _mask(self.width)

    def _index(self, layer, kv, slot, head, elem) -> torch.Tensor:
        return (((layer * 2 + kv) * self.num_slots + slot) * self.num_heads + head) * self.head_size + elem

    def _finish(self, idx: torch.Tensor, base: int) -> torch.Tensor:
        if self.exact:
            return idx + 1 + base
        # splitmix-style mixing of the index: position dependent, never 0
        x = (idx + base * 0x9E3779B9 + 0x632BE59B) & 0x7FFFFFFFFFFF
        x = (x ^ (x >> 17)) * 0x2545F491 & 0x7FFFFFFFFFFF
        x = x ^ (x >> 13)
        return (x & _mask(self.width)) | 1

    def plane(self, layer: int, kv: int, shape: Sequence[int]) -> torch.Tensor:
        """int64 codes of one (layer, K/V) plane, shaped as the engine view ``[A, B, NH, *elem]``
        (slot = a * B + b; the element axes flatten row-major to the head's elements)."""
        a, b, nh = int(shape[0]), int(shape[1]), int(shape[2])
        hs = 1
        for s in shape[3:]:
            hs *= int(s)
        slot = torch.arange(a * b).view(a, b, 1, 1)
        head = torch.arange(nh).view(1, 1, nh, 1)
        elem = torch.arange(hs).view(1, 1, 1, hs)
        codes = self._finish(self._index(layer, kv, slot, head, elem), 0)
        return codes.reshape(tuple(shape))

    def rows(self, layers: Sequence[int], slots: torch.Tensor, *, src: bool = False) -> torch.Tensor:
        """int64 staging rows ``[kv_size, len(layers), T, NH*HS]`` of codes (cache codes, or
        with ``src=True`` the scatter source codes). Rows of negative slots are 0."""
        slots = slots.to("cpu", torch.int64)
        lay = torch.tensor(list(layers), dtype=torch.int64).view(1, -1, 1, 1, 1)
        kv = torch.arange(self.kv_size).view(-1, 1, 1, 1, 1)
        s = slots.clamp(min=0).view(1, 1, -1, 1, 1)
        head = torch.arange(self.num_heads).view(1, 1, 1, -1, 1)
        elem = torch.arange(self.head_size).view(1, 1, 1, 1, -1)
        codes = self._finish(self._index(lay, kv, s, head, elem), self.count if src else 0)
        codes = codes.reshape(self.kv_size, len(layers), slots.numel(), self.num_heads * self.head_size)
        return torch.where((slots >= 0).view(1, 1, -1, 1), codes, torch.zeros_like(codes))

    def decode(self, value: int) -> str | None:
        """Where a code belongs, in words, or None for a value that is no code."""
        if not self.exact or value <= 0:
            return None
        i = value - 1
        what = "the cache value of"
        if i >= self.count:
            i -= self.count
            what = "the staged source value for"
        if not (0 <= i < self.count):
            return None
        e = i % self.head_size
        i //= self.head_size
        h = i % self.num_heads
        i //= self.num_heads
        s = i % self.num_slots
        i //= self.num_slots
        kv = i % 2
        layer = i // 2
        if layer >= self.num_layers or kv >= self.kv_size:
            return None
        return f"{what} layer {layer}, {KV_NAMES[kv] if self.kv_size == 2 else 'latent'}, slot {s}, head {h}, element {e}"


@dataclass(frozen=True)
class Mismatch:
    """The first wrong element of a comparison."""

    layer: int
    kv: int
    token: int | None
    slot: int | None
    head: int
    element: int
    expected: int
    actual: int
    width: int
    expected_means: str | None = None
    actual_means: str | None = None

    def describe(self, kv_size: int = 2) -> str:
        kvn = KV_NAMES[self.kv] if kv_size == 2 else "latent"
        where = f"layer {self.layer}, {kvn}"
        if self.token is not None:
            where += f", token {self.token}"
        if self.slot is not None:
            where += f" (slot {self.slot})" if self.token is not None else f", slot {self.slot}"
        where += f", head {self.head}, element {self.element}"
        hexw = 2 * self.width
        exp = f"0x{self.expected:0{hexw}x}" + (f" ({self.expected_means})" if self.expected_means else "")
        act = f"0x{self.actual:0{hexw}x}" + (f" ({self.actual_means})" if self.actual_means else "")
        return f"{where}: expected {exp}, actual {act}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "kv": KV_NAMES[self.kv] if self.kv < 2 else self.kv,
            "token": self.token,
            "slot": self.slot,
            "head": self.head,
            "element": self.element,
            "expected": self.expected,
            "actual": self.actual,
            "expected_means": self.expected_means,
            "actual_means": self.actual_means,
        }


def first_mismatch(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    layers: Sequence[int],
    slots: torch.Tensor,
    head_size: int,
    enc: Encoding | None,
    width: int,
) -> Mismatch | None:
    """Compare int64 staging-shaped ``[kv, L, T, NH*HS]`` tensors; the first difference."""
    diff = actual != expected
    if not bool(diff.any()):
        return None
    kv, li, t, col = (int(x) for x in torch.nonzero(diff)[0])
    a, e = int(actual[kv, li, t, col]), int(expected[kv, li, t, col])
    s = int(slots[t])
    return Mismatch(
        layer=int(layers[li]),
        kv=kv,
        token=t,
        slot=s if s >= 0 else None,
        head=col // head_size,
        element=col % head_size,
        expected=e,
        actual=a,
        width=width,
        expected_means=enc.decode(e) if enc else None,
        actual_means=enc.decode(a) if enc else None,
    )


# -- memory ------------------------------------------------------------------------------


def leaves(container: Any) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple container."""
    return tensors_in(container)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


class Snapshot:
    """A byte copy of every storage a container's tensors live in (shared storages once)."""

    def __init__(self, container: Any):
        self.views: list[torch.Tensor] = []
        seen: set[tuple[str, int]] = set()
        for t in leaves(container):
            st = t.untyped_storage()
            key = (str(t.device), st.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            self.views.append(_storage_bytes(t))
        self.copies = [v.clone() for v in self.views]

    def restore(self) -> None:
        for v, c in zip(self.views, self.copies):
            v.copy_(c)

    def first_change(self) -> tuple[int, int, int, int] | None:
        """(storage index, byte offset, before, now) of the first changed byte, or None."""
        for i, (v, c) in enumerate(zip(self.views, self.copies)):
            d = v != c
            if bool(d.any()):
                off = int(torch.nonzero(d)[0])
                return i, off, int(c[off]), int(v[off])
        return None

    def same_as(self, other: Snapshot) -> tuple[int, int, int, int] | None:
        """First byte where this snapshot's copy differs from ``other``'s copy."""
        for i, (a, b) in enumerate(zip(self.copies, other.copies)):
            d = a != b
            if bool(d.any()):
                off = int(torch.nonzero(d)[0])
                return i, off, int(b[off]), int(a[off])
        return None


# -- the engine's view -------------------------------------------------------------------


class Plane:
    """One (layer, K/V) plane as the engine reads it: one view ``[A, B, NH, *elem]``, or
    several segment views ``[A, B, NH, *elem_i]`` whose elements, concatenated in order,
    make each head's row (records whose parts live apart, like a block's values and then
    its scales). Slot ``s`` is ``(s // B, s % B)``. All access is through integer views of
    the element bits; writes go to the cache.
    """

    def __init__(self, parts: Sequence[torch.Tensor], *, token_groups: bool = False):
        self.parts = [int_view(p) for p in parts]
        self.grouped = token_groups
        lead_n = 4 if token_groups else 3  # [A, G, E, NH, *elem]: a block's tokens in G groups of E
        lead = {tuple(p.shape[:lead_n]) for p in self.parts}
        if len(lead) != 1 or any(p.dim() < lead_n + 1 for p in self.parts):
            want = (
                "[NB, BSC, BSE, NH, *elem] with the same NB, BSC, BSE, NH" if token_groups else "[A, B, NH, *elem] with the same A, B, NH"
            )
            raise GeometryError(f"kv_view segments must all be {want}; got {[tuple(p.shape) for p in self.parts]}")
        self.widths = [math.prod(int(x) for x in p.shape[lead_n:]) for p in self.parts]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        if self.grouped:
            a, g, e, nh = (int(x) for x in self.parts[0].shape[:4])
            return a, g * e, nh, sum(self.widths)
        a, b, nh = (int(x) for x in self.parts[0].shape[:3])
        return a, b, nh, sum(self.widths)

    @property
    def element_size(self) -> int:
        return self.parts[0].element_size()

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def unsigned(self) -> torch.Tensor:
        """int64 ``[A, B, NH, HS]`` element bits, on the CPU."""
        a, b, nh, _ = self.shape
        return torch.cat([to_unsigned(p).reshape(a, b, nh, -1).cpu() for p in self.parts], dim=-1)

    def fill(self, bits: torch.Tensor) -> None:
        """Write int64 ``[A, B, NH, HS]`` bits everywhere."""
        for p, part in zip(self.parts, bits.split(self.widths, dim=-1)):
            p.copy_(from_unsigned(part, p.dtype).reshape(p.shape).to(p.device))

    def _ab(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = slots.to(self.device, torch.int64)
        b = self.shape[1]
        a, t = torch.div(s, b, rounding_mode="floor"), s % b
        if self.grouped:
            e = int(self.parts[0].shape[2])
            return a, torch.div(t, e, rounding_mode="floor"), t % e
        return a, t

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 ``[T, NH*HS]`` rows of ``slots`` (all >= 0), on the CPU."""
        idx = self._ab(slots)
        t, nh = slots.numel(), self.shape[2]
        return torch.cat([to_unsigned(p[idx]).reshape(t, nh, w).cpu() for p, w in zip(self.parts, self.widths)], dim=-1).reshape(t, -1)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write int64 ``[T, NH*HS]`` rows at ``slots`` (all >= 0)."""
        idx = self._ab(slots)
        t, nh = slots.numel(), self.shape[2]
        for p, part in zip(self.parts, rows.reshape(t, nh, sum(self.widths)).split(self.widths, dim=-1)):
            p[idx] = from_unsigned(part, p.dtype).reshape(t, *p.shape[len(idx) :]).to(p.device)

    def clone(self) -> Plane:
        return Plane([p.clone() for p in self.parts], token_groups=self.grouped)


class TokenGroups:
    """A ``kv_view`` answer for a plane whose block's tokens are split in groups (``BSC``/
    ``BSE``, e.g. a vectorised V ``(NB, NH, BS/x, HS, x)``) so that no single ``[NB, BS, NH,
    *elem]`` view exists: wrap the view ``[NB, BSC, BSE, NH_p, *elem]`` (token =
    group * BSE + index; a tuple of segment views likewise) as ``TokenGroups(view)``."""

    def __init__(self, view: torch.Tensor | Sequence[torch.Tensor]):
        self.view = view


def planes(kv_view: Callable[[Any, int, int], Any], kv_caches: Any, num_layers: int, kv_size: int) -> list[list[Plane]]:
    """``[layer][kv]`` :class:`Plane` s of the engine's views; ``kv_view(kv_caches, layer, kv)``
    (e.g. a bound ``FixtureCase.view``) returns a tensor or a tuple of segment tensors, or
    either wrapped in :class:`TokenGroups`."""
    out = []
    for layer in range(num_layers):
        row = []
        for kv in range(kv_size):
            v = kv_view(kv_caches, layer, kv)
            grouped = isinstance(v, TokenGroups)
            if grouped:
                v = v.view
            row.append(Plane(list(v) if isinstance(v, (tuple, list)) else [v], token_groups=grouped))
        out.append(row)
    return out


def fill_codes(pl: list[list[Plane]], enc: Encoding) -> None:
    """Write every plane's codes through the engine's views."""
    for layer, row in enumerate(pl):
        for kv, v in enumerate(row):
            v.fill(enc.plane(layer, kv, v.shape))


def write_rows(pl: list[list[Plane]], layers: Sequence[int], slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write staging rows ``[kv, L, T, NH*HS]`` (int64 unsigned bits) through the engine's
    views at ``slots``; negative slots are not written (the engine's own scatter)."""
    keep = torch.nonzero(slots.cpu() >= 0).flatten()
    s = slots.cpu()[keep]
    for kv in range(len(pl[0])):
        for li, layer in enumerate(layers):
            pl[layer][kv].write(s, rows[kv, li, keep])


def plane_mismatch(before: list[list[Plane]], after: list[list[Plane]], enc: Encoding | None) -> Mismatch | None:
    """First element where two sets of planes differ, with (layer, K/V, slot, head, element)."""
    for layer, (rb, ra) in enumerate(zip(before, after)):
        for kv, (b, a) in enumerate(zip(rb, ra)):
            ub, ua = b.unsigned(), a.unsigned()
            d = ua != ub
            if bool(d.any()):
                i0, i1, h, e = (int(x) for x in torch.nonzero(d)[0])
                ev, av = int(ub[i0, i1, h, e]), int(ua[i0, i1, h, e])
                return Mismatch(
                    layer=layer,
                    kv=kv,
                    token=None,
                    slot=i0 * b.shape[1] + i1,
                    head=h,
                    element=e,
                    expected=ev,
                    actual=av,
                    width=b.element_size,
                    expected_means=enc.decode(ev) if enc else None,
                    actual_means=enc.decode(av) if enc else None,
                )
    return None


def special_patterns(dtype: torch.dtype) -> list[int]:
    """Bit patterns a transfer must keep: negative zero, NaNs with payloads, all ones,
    the sign bit and the largest magnitude, as unsigned ints of the element width."""
    w = torch.empty(0, dtype=dtype).element_size()
    sign = 1 << (8 * w - 1)
    pats = {sign, _mask(w), sign - 1, 1}
    if dtype.is_floating_point:
        try:
            nan = int(to_unsigned(int_view(torch.full((1,), float("nan"), dtype=dtype)))[0])
            pats |= {nan, nan | 1, nan | sign, (nan | sign) ^ 2}
        except (RuntimeError, TypeError):  # a float type torch cannot fill on this build
            pass
    if w == 8:  # int64 holds 8-byte patterns as signed numbers
        pats = {p - (1 << 64) if p >= 1 << 63 else p for p in pats}
    return sorted(pats)


def random_bits(shape: Iterable[int], width: int, gen: torch.Generator) -> torch.Tensor:
    """int64 unsigned random bit patterns of ``width`` bytes."""
    hi = min(_mask(width), (1 << 62) - 1)
    return torch.randint(0, hi, tuple(shape), generator=gen, dtype=torch.int64)


# -- multi-plane records -----------------------------------------------------------------


@dataclass(frozen=True)
class PlaneShape:
    """One plane of a multi-plane record as the codes see it: its role, heads, elements per
    head and element width in bytes."""

    role: str
    num_heads: int
    head_size: int
    width: int


class PlanesEncoding:
    """Codes for a multi-plane record: ``code(plane, layer, slot, head, element)``, each plane
    in its own element width. ``index`` enumerates the record in (plane, layer, slot, head,
    element) order, so a code of a plane whose width can number every index decodes back to
    its coordinates, including a code found in another plane of the same width; a plane too
    narrow for that (1-byte int8 values of any real cache) gets a position-dependent hash
    instead, as :class:`Encoding` does.

    Staged rows (:meth:`rows`) are int64 ``[L, T, NH_p * HS_p]`` unsigned element bits.
    """

    def __init__(self, num_layers: int, num_slots: int, planes: Sequence[PlaneShape]):
        self.num_layers, self.num_slots, self.planes = num_layers, num_slots, list(planes)
        self.offsets = []
        total = 0
        for p in self.planes:
            self.offsets.append(total)
            total += num_layers * num_slots * p.num_heads * p.head_size
        self.count = total

    def exact(self, p: int) -> bool:
        return 2 * self.count + 2 < _mask(self.planes[p].width)

    def _finish(self, p: int, idx: torch.Tensor, src: bool) -> torch.Tensor:
        w = self.planes[p].width
        if self.exact(p):
            return idx + 1 + (self.count if src else 0)
        base = self.count if src else 0
        x = (idx + base * 0x9E3779B9 + 0x632BE59B) & 0x7FFFFFFFFFFF
        x = (x ^ (x >> 17)) * 0x2545F491 & 0x7FFFFFFFFFFF
        x = x ^ (x >> 13)
        return (x & _mask(w)) | 1

    def _index(self, p: int, layer, slot, head, elem):
        ps = self.planes[p]
        return self.offsets[p] + ((layer * self.num_slots + slot) * ps.num_heads + head) * ps.head_size + elem

    def plane(self, p: int, layer: int, shape: Sequence[int]) -> torch.Tensor:
        """int64 codes of plane ``p`` of ``layer``, shaped as the engine view ``[A, B, NH_p, *elem]``."""
        a, b, nh = int(shape[0]), int(shape[1]), int(shape[2])
        hs = math.prod(int(s) for s in shape[3:])
        slot = torch.arange(a * b).view(a, b, 1, 1)
        head = torch.arange(nh).view(1, 1, nh, 1)
        elem = torch.arange(hs).view(1, 1, 1, hs)
        return self._finish(p, self._index(p, layer, slot, head, elem), False).reshape(tuple(shape))

    def rows(self, p: int, layers: Sequence[int], slots: torch.Tensor, *, src: bool = False) -> torch.Tensor:
        """int64 ``[L, T, NH_p*HS_p]`` codes of plane ``p`` (source codes with ``src``); rows
        of negative slots are 0."""
        ps = self.planes[p]
        slots = slots.to("cpu", torch.int64)
        lay = torch.tensor(list(layers), dtype=torch.int64).view(-1, 1, 1, 1)
        s = slots.clamp(min=0).view(1, -1, 1, 1)
        head = torch.arange(ps.num_heads).view(1, 1, -1, 1)
        elem = torch.arange(ps.head_size).view(1, 1, 1, -1)
        codes = self._finish(p, self._index(p, lay, s, head, elem), src).reshape(len(layers), slots.numel(), ps.num_heads * ps.head_size)
        return torch.where((slots >= 0).view(1, -1, 1), codes, torch.zeros_like(codes))

    def where(self, p: int, value: int, limit: int = 3) -> str | None:
        """For a plane too narrow to number every element (a hashed code): the places of plane
        ``p`` whose cache code is ``value``, in words (the first ``limit`` and the count), or None."""
        ps = self.planes[p]
        every = self.rows(p, list(range(self.num_layers)), torch.arange(self.num_slots))  # [NL, S, NH*HS]
        hits = torch.nonzero(every == value)
        if not len(hits):
            return None
        shown = [
            f"layer {int(li)}, slot {int(s)}, head {int(c) // ps.head_size}, element {int(c) % ps.head_size}" for li, s, c in hits[:limit]
        ]
        more = f" and {len(hits) - limit} more" if len(hits) > limit else ""
        return f"a {ps.width}-byte code of plane {ps.role} that cannot name one place: the cache value of {'; '.join(shown)}{more}"

    def describe_at(self, p: int, layer: int, slot: int, head: int, element: int) -> str:
        """The cache value of one place, in words (what an expected code means, decodable or not)."""
        return f"the cache value of plane {self.planes[p].role}, layer {layer}, slot {slot}, head {head}, element {element}"

    def decode(self, p: int, value: int) -> str | None:
        """Where a value found in plane ``p`` (of that plane's width) belongs, or None."""
        if value <= 0:
            return None
        w = self.planes[p].width
        i = value - 1
        what = "the cache value of"
        if i >= self.count:
            i -= self.count
            what = "the staged source value for"
        if not (0 <= i < self.count):
            return None
        for q in range(len(self.planes) - 1, -1, -1):
            if i >= self.offsets[q]:
                break
        pq = self.planes[q]
        if pq.width != w or not self.exact(q):
            return None
        i -= self.offsets[q]
        e = i % pq.head_size
        i //= pq.head_size
        h = i % pq.num_heads
        i //= pq.num_heads
        s = i % self.num_slots
        layer = i // self.num_slots
        return f"{what} plane {pq.role}, layer {layer}, slot {s}, head {h}, element {e}"
