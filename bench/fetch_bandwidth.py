"""(1) Stage fetch bandwidth from shared memory vs a plain memcpy of the same bytes.

The wstream figure runs the real worker path: the prefetch thread asks the server for each stage
(`fetch`), then copies the stage out of the mapped published segment into a ring buffer, while the
consumer takes and releases buffers. The baseline copies the same number of bytes between two
private tensors in this process (`Tensor.copy_`, i.e. memcpy), timed before and after the wstream
runs; the faster of the two is used, so the ratio is conservative. Ratio = wstream / memcpy.

    python bench/fetch_bandwidth.py [--stage-mib 64] [--stages 8] [--rounds 4]
"""

from __future__ import annotations

import argparse

import torch

from common import FlatStage, machine, median_time, parse_args, server, time_fetches
from wstream.client import AdamW, Client


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage-mib", type=int, default=64)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="passes over all stages per measurement")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    args = parse_args(p, smoke=dict(stage_mib=1, stages=2, rounds=1, repeat=1))
    numel = args.stage_mib * 2**20 // 4
    total_bytes = args.stages * args.rounds * numel * 4
    print(f"machine: {machine()}")
    print(f"{args.stages} stages x {args.stage_mib} MiB, {args.rounds} rounds per measurement, prefetch {args.prefetch}")

    src = torch.randn(numel)
    dst = torch.empty(numel)

    def memcpy() -> None:
        for _ in range(args.stages * args.rounds):
            dst.copy_(src)

    initial_threads = torch.get_num_threads()
    t_memcpy_before = median_time(memcpy, repeat=args.repeat)
    results = {}
    with server("--memory-limit", "16GiB") as address, Client(address) as client:
        job = client.create_job("fetch", (FlatStage(numel) for _ in range(args.stages)), optimizer=AdamW(), token="b")
        for mode, shm in (("shm", True), ("frames", False)):
            # the copying path: on a GPU this copy is the host-to-device transfer (CPU workers
            # default to zero_copy, which moves no bytes at all)
            trainer = job.trainer(prefetch=args.prefetch, shm=shm, zero_copy=False if shm else None)
            worker_threads = torch.get_num_threads()  # a co-located worker's share (client/threads.py)
            results[mode] = time_fetches(trainer, args.stages, rounds=args.rounds, repeat=args.repeat)
            trainer.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, initial_threads))
    t_memcpy = min(t_memcpy_before, median_time(memcpy, repeat=args.repeat))
    torch.set_num_threads(worker_threads)  # the same copy on the threads the worker was given
    t_memcpy_worker = median_time(memcpy, repeat=args.repeat)
    torch.set_num_threads(threads)
    gbs = lambda t: total_bytes / t / 1e9  # noqa: E731
    print(f"memcpy (Tensor.copy_, private -> private, {max(threads, initial_threads)} threads): {gbs(t_memcpy):6.2f} GB/s")
    print(f"memcpy on the worker's {worker_threads} thread(s):                {gbs(t_memcpy_worker):6.2f} GB/s")
    for mode, t in results.items():
        print(
            f"wstream fetch ({mode:6}):                  {gbs(t):6.2f} GB/s   ratio {t_memcpy / t:.2f} "
            f"(to memcpy on the worker's threads: {t_memcpy_worker / t:.2f})"
        )


if __name__ == "__main__":
    main()
