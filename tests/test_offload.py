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


def test_round_trip_keeps_each_tensors_layout() -> None:
    """A channels_last or permuted boundary comes back with its strides (a stage after it may
    ``view`` it, and a GPU kernel's speed depends on the layout)."""
    mover = HostMover(torch.device("cpu"))
    try:
        image = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
        permuted = torch.randn(4, 5, 6).permute(2, 0, 1)
        host = mover.to_host((image, permuted))
        back = mover.to_device(host).result()
        for original, copied in [*zip((image, permuted), host.result()), *zip((image, permuted), back)]:
            assert copied.stride() == original.stride()
            assert torch.equal(copied, original)
    finally:
        mover.close()


def test_an_offload_waits_for_the_one_before_it() -> None:
    """NOTE [Ordering of offload copies] rule 5: when copies fall behind compute, the executor's
    next OFFLOAD waits, so at most one source waits for its copy (the plan's budget counts one),
    instead of every offloaded input staying alive on the device."""
    import wstream.client.offload as offload_module

    mover = HostMover(torch.device("cpu"))
    copied = peak = 0
    lock = threading.Lock()
    original = offload_module._copy

    def slow_copy(b: tuple, *args: object) -> tuple:  # a link slower than compute
        nonlocal copied
        threading.Event().wait(0.02)
        out = original(b, *args)
        with lock:
            copied += 1
        return out

    offload_module._copy = slow_copy  # type: ignore[assignment]
    try:
        for issued in range(1, 7):
            mover.to_host((torch.ones(1024),))
            with lock:
                peak = max(peak, issued - copied)  # sources still waiting for their copy
        assert peak <= 1
    finally:
        offload_module._copy = original  # type: ignore[assignment]
        mover.close()
