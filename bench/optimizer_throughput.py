"""(2) The server's per-stage update vs torch.optim.AdamW(fused=True) on a flat tensor.

Runs the server's own per-stage work of one step on a real `Job`: each worker's gradient added into
the stage's accumulator (`GatherTask.run`, the last one also taking the norm for clipping), then
`UpdateTask.run` (mean and clip folded into fused AdamW on the fp32 master, publication) and, as the baseline, a bare
`torch.optim.AdamW([p], fused=True).step()` on a flat tensor of the same size, alternately in this
process. Ratio = baseline time / wstream time (1.0 = as fast as bare fused AdamW).

Where DeepSpeed is installed (``pip install deepspeed``; its CPU Adam op is built by its JIT with
the host's C++ compiler on first use, about a minute), its bare ``DeepSpeedCPUAdam`` step on the
same flat tensor (AdamW mode, fp32) is a second baseline, measured in the same run next to each
case: ratio = DeepSpeed's time / wstream's time, i.e. wstream's parameters per second as a
fraction of DeepSpeed's (issue 17 asks >= 0.9).

    python bench/optimizer_throughput.py [--mparams 32] [--repeat 9]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import zmq

from common import machine, median_time, parse_args
from wstream.protocol import AdamW
from wstream.protocol import messages as m
from wstream.protocol.layout import build_stage_spec
from wstream.server.job import Job
from wstream.server.stage_state import GatherTask, UpdateTask
from wstream.server.memory import MemoryAccount


def make_job(numel: int, *, double_buffer: bool, workers: int) -> tuple[Job, Callable[[], None]]:
    options = m.JobOptions(optimizer=AdamW(lr=1e-4), double_buffer=double_buffer)
    created = m.CreateJob(name="b", token="t", nonce=b"n" * 32, client_nonce=b"c" * 16, options=options)
    job = Job.create(created, MemoryAccount(2**40))
    spec = build_stage_spec("0", [("w", (numel,))])
    job.add_stage(m.AddStage(session=b"s" * 16, index=0, spec=spec), [zmq.Frame(torch.randn(spec.numel).numpy().tobytes())])
    job.seal()
    grads = [torch.randn(spec.numel) * 1e-3 for _ in range(workers)]
    st = job.stages[0]
    gathers = [GatherTask(job, st, w, g, job.attempt, workers) for w, g in enumerate(grads)]
    update = UpdateTask(job, st, grad_scale=float(workers), lr=1e-4)

    def one_stage_step() -> None:
        """Everything the server does to one stage in one step: add each worker's gradient into
        the accumulator (the last one also takes its norm), then the update and its publication.
        run() does not flip the version (the loop does), so this can be repeated."""
        st.acc = (-1, 0)
        for g in gathers:
            g.run()
        update.run()

    return job, one_stage_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mparams", type=int, default=32, help="stage size in millions of parameters")
    p.add_argument("--repeat", type=int, default=9)
    args = parse_args(p, smoke=dict(mparams=1, repeat=1))
    numel = args.mparams * 1_000_000
    print(f"machine: {machine()}")
    print(f"one stage of {numel:,} fp32 parameters")

    base = torch.randn(numel)
    base.grad = torch.randn(numel) * 1e-3
    opt = torch.optim.AdamW([base], lr=1e-4, fused=True)
    t_base = median_time(opt.step, repeat=args.repeat)
    print(f"torch.optim.AdamW(fused=True), flat tensor: {numel / t_base / 1e9:5.2f} G params/s")
    ds_step = deepspeed_step(numel)
    if ds_step is not None:
        t_ds = median_time(ds_step, repeat=args.repeat)
        print(f"DeepSpeedCPUAdam (adamw_mode), flat tensor: {numel / t_ds / 1e9:5.2f} G params/s")

    cases = [
        ("1 worker, fp32 published in place (default)", False, 1),
        ("1 worker, double-buffered publish", True, 1),
        ("2 workers (mean of gradients)", False, 2),
    ]
    for label, double, workers in cases:
        job, one_stage_step = make_job(numel, double_buffer=double, workers=workers)
        t = median_time(one_stage_step, repeat=args.repeat)
        t_base = median_time(opt.step, repeat=args.repeat)  # re-measured next to each case
        line = f"wstream update, {label:45}: {numel / t / 1e9:5.2f} G params/s   ratio {t_base / t:.2f}"
        if ds_step is not None:
            line += f"   vs DeepSpeed {median_time(ds_step, repeat=args.repeat) / t:.2f}"
        print(line)
        job.close()


def deepspeed_step(numel: int) -> Callable[[], None] | None:
    """A bare DeepSpeedCPUAdam step on a flat fp32 tensor of ``numel``, or None (not installed)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        print("DeepSpeed is not installed: its CPU Adam baseline is left out (pip install deepspeed)")
        return None
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel) * 1e-3
    opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True, fp32_optimizer_states=True)
    return opt.step


if __name__ == "__main__":
    main()
