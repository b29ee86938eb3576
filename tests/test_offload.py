"""The asynchronous host mover behind the ``offload`` plan (CPU worker: a copy thread)."""

from __future__ import annotations

import threading

import torch

from wstream.client.offload import HostMover


def test_round_trip_copies_and_keeps_order_after_the_source_is_dropped() -> None:
    mover = HostMover(torch.device("cpu"))
    try:
        src = torch.randn(1 << 20)
        expected = src.clone()
        mask = torch.ones(3, dtype=torch.bool)
        on_host = mover.to_host((src, mask, "side", None))
        del src  # rule 2 of the NOTE: the move keeps its source alive until copied
        back = mover.to_device(on_host)  # queued behind the offload; reads its finished copy
        got = back.result()
        assert torch.equal(got[0], expected) and torch.equal(got[1], mask)
        assert got[2:] == ("side", None)
        host = on_host.result()
        assert host[0].data_ptr() != got[0].data_ptr()  # two copies, not one shared buffer
        assert on_host.nbytes == back.nbytes == expected.numel() * 4 + 3
    finally:
        mover.close()


def test_copies_run_off_the_calling_thread() -> None:
    seen: list[str] = []

    mover = HostMover(torch.device("cpu"))
    try:
        caller = threading.current_thread().name
        original = torch.Tensor.copy_

        def spy(self: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            return original(self, *a, **k)

        torch.Tensor.copy_ = spy  # type: ignore[method-assign]
        try:
            mover.to_host((torch.ones(4),)).result()
        finally:
            torch.Tensor.copy_ = original  # type: ignore[method-assign]
        assert seen and all(name != caller and name.startswith("wstream-offload") for name in seen)
    finally:
        mover.close()
