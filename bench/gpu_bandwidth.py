"""GPU figure 1: host <-> device bandwidth, raw pinned copies against wstream's data path.

* Baselines: ``Tensor.copy_`` between a page-locked host buffer (plain memory registered with
  ``cudaHostRegister``, as wstream does, not PyTorch's caching pinned allocator) and a device
  buffer: host -> device, device -> host, both directions at once on two streams (PCIe is full
  duplex: this is what the choice of fp32 gradients rests on, DESIGN.md "GPU data path"), and
  host -> device from pageable memory for contrast.
* wstream fetch: a job of ``--stages`` bf16 stages on a real server; the worker's prefetch thread
  asks for each stage and copies it from the registered shared-memory segment into the device
  ring on its own stream (and, for remote workers, from data frames through the receive ring).
  Ratio = wstream / pinned host -> device copy_.
* wstream gradients: a stage's gradient staged in fp32 on the device and copied into a
  registered gradient slot (``GradientStager``). Ratio = wstream / pinned device -> host copy_.
* Registration: ``cudaHostRegister`` of a shared-memory segment on 4 KiB pages, and on huge
  pages when a hugetlbfs mount has enough free pages (bench/gpu_all.sh tries to reserve some).

    python bench/gpu_bandwidth.py [--stage-mib 256] [--stages 8] [--rounds 4] [--register-gib 8]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from common import FlatStage, parse_args, server
from gpu_common import gb_per_s, gpu_seconds, header, require_cuda
from wstream.client import SGD, Client
from wstream.client.device import HostRegistration, copy_engine
from wstream.client.gradient_write import GradientStager
from wstream.client.stages import spec_of
from wstream.protocol import shm


def registered(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, HostRegistration]:
    host = torch.empty(numel, dtype=dtype)
    host.fill_(1)  # fault the pages in before timing anything
    return host, HostRegistration(host, device, what="benchmark buffer")


def raw_copies(device: torch.device, numel: int, rounds: int, repeat: int) -> dict[str, float]:
    """GB/s of plain copy_ in each direction (bf16 elements)."""
    host, reg = registered(numel, torch.bfloat16, device)
    back, reg_back = registered(numel, torch.bfloat16, device)
    pageable = torch.ones(numel, dtype=torch.bfloat16)
    dev = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dev2 = torch.ones(numel, dtype=torch.bfloat16, device=device)
    nbytes = numel * 2 * rounds
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def h2d(src: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for _ in range(rounds):
                dev.copy_(src, non_blocking=True)
        return run

    def d2h() -> None:
        for _ in range(rounds):
            back.copy_(dev2, non_blocking=True)

    def duplex() -> None:
        with torch.cuda.stream(up):
            h2d(host)()
        with torch.cuda.stream(down):
            d2h()

    out = {
        "h2d": gb_per_s(nbytes, gpu_seconds(h2d(host), repeat=repeat)),
        "d2h": gb_per_s(nbytes, gpu_seconds(d2h, repeat=repeat)),
        "duplex": gb_per_s(2 * nbytes, gpu_seconds(duplex, repeat=repeat)),
        "h2d_pageable": gb_per_s(nbytes, gpu_seconds(h2d(pageable), repeat=max(1, repeat // 2))),
    }
    torch.cuda.synchronize()
    reg.unregister()
    reg_back.unregister()
    return out


def wstream_fetch(device: torch.device, numel: int, stages: int, rounds: int, repeat: int, prefetch: int) -> dict[str, float]:
    """GB/s of the worker's real fetch path into the device ring (shm and data frames)."""
    out: dict[str, float] = {}
    limit = f"{max(8, 4 * stages * numel * 4 // 2**30 + 4)}GiB"
    with server("--memory-limit", limit) as address, Client(address) as client:
        job = client.create_job(
            "bw", (FlatStage(numel) for _ in range(stages)), optimizer=SGD(lr=0.0), token="b", dtype="bfloat16"
        )
        order = list(range(stages)) * rounds
        for mode in ("shm", "frames"):
            with job.trainer(device, prefetch=prefetch, shm=mode == "shm") as trainer:
                pf = trainer.connection.prefetcher  # the worker's fetch path, driven without compute

                def fetch_all() -> None:
                    pf.start(0, order)
                    for s in order:
                        pf.release(pf.get(s))

                t = gpu_seconds(fetch_all, repeat=repeat)
                st = trainer.stats()
                out[mode] = gb_per_s(len(order) * numel * 2, t)
                out[f"{mode}_registered_bytes"] = st.registered_bytes
                out[f"{mode}_registration_s"] = st.registration_s
    return out


def wstream_gradients(device: torch.device, numel: int, rounds: int, repeat: int) -> float:
    """GB/s of bf16 device gradients into a registered fp32 slot through GradientStager."""
    spec = spec_of(0, FlatStage(numel))
    slot, reg = registered(numel, torch.float32, device)
    stager = GradientStager(device, numel, copy_engine(device, "d2h"), staged=True)
    grads = [torch.ones(numel, dtype=torch.bfloat16, device=device)]

    def push_all() -> None:
        for _ in range(rounds):
            stager.write(slot, spec, grads)

    t = gpu_seconds(push_all, repeat=repeat)
    torch.cuda.synchronize()
    reg.unregister()
    return gb_per_s(rounds * numel * 4, t)  # bytes over PCIe: fp32


def registration(device: torch.device, nbytes: int) -> dict[str, tuple[int, float]]:
    """(bytes, seconds) of registering a shared-memory segment, on ordinary and huge pages."""
    out: dict[str, tuple[int, float]] = {}
    mounts = [m for m in shm.hugetlbfs_mounts() if os.access(m.path, os.W_OK)]
    cases: list[tuple[str, shm.HugePagesMode, list[shm.HugePageMount]]] = [("4 KiB pages (/dev/shm)", "off", [])]
    for m in mounts:
        if shm.huge_pages_free(m.page_size) >= shm.round_up(nbytes, m.page_size):
            cases.append((f"{m.page_size // 2**20} MiB huge pages ({m.path})", "on", [m]))
            break
    else:
        print(f"  (no hugetlbfs mount with {nbytes} bytes of free huge pages: {mounts or 'no mount'})")
    for name, mode, ms in cases:
        shm.configure_huge_pages(mode, mounts=ms)
        path = shm.create_segment(nbytes)
        try:
            mapping = shm.map_segment(path, nbytes)
            reg = HostRegistration(mapping, device, what=name)
            out[name] = (reg.nbytes, reg.seconds)
            reg.unregister()
            del mapping
        finally:
            shm.unlink_segment(path)
    shm.configure_huge_pages("off")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage-mib", type=int, default=256, help="bf16 bytes per stage")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="passes over the stages per measurement")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--register-gib", type=float, default=8.0, help="segment size for the registration rate")
    args = parse_args(p, smoke=dict(stage_mib=1, stages=2, rounds=1, repeat=1, register_gib=0.01))
    device = require_cuda("gpu_bandwidth.py", smoke=args.smoke)
    header(device)
    numel = args.stage_mib * 2**20 // 2
    print(f"{args.stages} stages x {args.stage_mib} MiB (bf16), {args.rounds} rounds, prefetch {args.prefetch}")
    raw = raw_copies(device, numel, args.stages * args.rounds, args.repeat)
    print(f"pinned copy_ host->device   {raw['h2d']:7.2f} GB/s")
    print(f"pinned copy_ device->host   {raw['d2h']:7.2f} GB/s")
    print(f"pinned both at once         {raw['duplex']:7.2f} GB/s total ({raw['duplex'] / raw['h2d']:.2f}x one direction)")
    print(f"pageable copy_ host->device {raw['h2d_pageable']:7.2f} GB/s")
    sys.stdout.flush()
    fetch = wstream_fetch(device, numel, args.stages, args.rounds, args.repeat, args.prefetch)
    for mode in ("shm", "frames"):
        print(
            f"wstream fetch ({mode:6})       {fetch[mode]:7.2f} GB/s   ratio {fetch[mode] / raw['h2d']:.2f} "
            f"(registered {fetch[f'{mode}_registered_bytes'] / 2**30:.2f} GiB in {fetch[f'{mode}_registration_s']:.3f} s)"
        )
    grad = wstream_gradients(device, numel, args.rounds, args.repeat)
    print(f"wstream gradients (fp32)    {grad:7.2f} GB/s   ratio {grad / raw['d2h']:.2f}")
    sys.stdout.flush()
    reg = registration(device, int(args.register_gib * 2**30))
    base = None
    for name, (nbytes, seconds) in reg.items():
        if seconds <= 0:
            continue
        base = base or seconds
        print(f"cudaHostRegister {name}: {nbytes / 2**30:.1f} GiB in {seconds:.3f} s ({gb_per_s(nbytes, seconds):.1f} GB/s), "
              f"{base / seconds:.1f}x the 4 KiB rate")


if __name__ == "__main__":
    main()
