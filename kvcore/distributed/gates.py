"""The host twins of the device gates: the slot checks (range, repeats) and the receiver's
gate that decides whether a chunk lands."""

from __future__ import annotations

import torch

from kvcore.distributed.channels import _Agreement
from kvcore.distributed.wire import (
    _F_EPOCH,
    _F_INDEX,
    _F_MAGIC,
    _F_MODE,
    _F_NUM,
    _F_TOKENS,
    _F_VALUE,
    _F_VERDICT,
    CTL_BYTES,
    FAST,
    MAGIC,
    _mismatch,
    _read,
    _src_desc,
)
from kvcore.errors import TransferError


def _check_values(src, src_n, dst, dst_n) -> tuple[int, int, int, int]:
    """The host twin of the device slot check: (kind, index, value, num_slots), kind 0 = ok."""
    if src is not None:
        bad = torch.nonzero(src >= src_n)
        if bad.numel():
            i = int(bad[0])
            return 1, i, int(src[i]), src_n
    if dst is not None:
        bad = torch.nonzero(dst >= dst_n)
        if bad.numel():
            i = int(bad[0])
            return 3, i, int(dst[i]), dst_n
        valid = dst[dst >= 0]
        if valid.numel() > 1:
            srt, _ = torch.sort(valid)
            same = srt[1:] == srt[:-1]
            if bool(same.any()):
                return 2, -1, int(srt[1:][same][0]), dst_n
    return 0, -1, 0, 0


def _gate_host(d: torch.Tensor, buf: torch.Tensor, own: int, ag: _Agreement, host_s, what, layout, side, src):
    """The host twin of the gate kernel: (0 or the TransferError to raise, effective slots)."""
    dr = d[:CTL_BYTES].view(torch.int64).tolist()
    pr = buf[:CTL_BYTES].view(torch.int64).tolist()
    none = torch.full_like(host_s, -1)
    if dr[_F_MAGIC] != MAGIC or pr[_F_MAGIC] != MAGIC:
        return TransferError(f"{what}: a chunk is not kvcore's: both sides must call kvcore.send / kvcore.recv in the same order"), none
    if dr[_F_MODE] != FAST or dr[_F_EPOCH] != ag.epoch or dr[_F_TOKENS] != ag.tokens:
        try:
            _, head = _read(d, "header", True)
        except TransferError:
            head = {}
        if dr[_F_VERDICT] or not head.get("ok", True):
            return TransferError(f"{what}: the sender refused and sent nothing: {head.get('error')}"), none
        mine = f"this {layout.format.name} ({layout.describe()})"
        why, _ = _mismatch(head, side.sig, side.table.num_layers, ag.tokens, _src_desc(head), mine) if head else (None, [])
        return TransferError(
            f"{what}: {why or 'the sender changed the transfer'} (this side repeats the transfer this channel agreed on, {ag.tokens} "
            "token rows; the two calls do not match, both sides raise, nothing was written)"
        ), none
    if pr[_F_VERDICT]:
        return TransferError(
            f"{what}: the sender refused and sent nothing: its slots[{pr[_F_INDEX]}] = {pr[_F_VALUE]} is out of range: it has "
            f"{pr[_F_NUM]} slots per layer"
        ), none
    if own:
        return -1, none
    mask = buf[CTL_BYTES : CTL_BYTES + ag.tokens].bool()
    return 0, torch.where(mask, host_s, none)
