"""kvcore.testing.loopback's mailboxes on the CPU: which mailbox a message uses is counted on
the device (in stream order), so a group replayed from a CUDA graph, which never calls the
wire, keeps the two ends in step. The GPU engine over the wire: tests/test_distributed_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kvcore.testing.loopback import _Mailboxes


def _msg(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_messages_land_in_call_order_and_wrap():
    sizes = [16, 40, 24, 24]  # a header, the first chunk (with its prefix), two more chunks
    mb = _Mailboxes(sizes, torch.device("cpu"))
    for call in range(3):  # the counters wrap after each call's messages
        sent = [_msg(n, 10 * call + i) for i, n in enumerate(sizes)]
        for m in sent:
            mb.move(True, m)
        got = [torch.full((n,), 0xEE, dtype=torch.uint8) for n in sizes]
        for g in got:
            mb.move(False, g)
        assert all(torch.equal(a, b) for a, b in zip(sent, got)), call
        assert mb.pos[True].item() == 0 and mb.pos[False].item() == 0
    # a message shorter than its mailbox moves only its own bytes
    mb.move(True, _msg(16, 99))
    short = torch.zeros(8, dtype=torch.uint8)
    mb.move(False, short)
    assert torch.equal(short, _msg(16, 99)[:8])


def test_a_message_longer_than_every_mailbox_is_refused():
    mb = _Mailboxes([16, 40], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="41 bytes"):
        mb.move(True, torch.zeros(41, dtype=torch.uint8))
    assert mb.pos[True].item() == 0
