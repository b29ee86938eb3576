"""(2) The server's per-stage update vs torch.optim.AdamW(fused=True) on a flat tensor.

Runs the server's own per-stage work of one step on a real `Job`, as the job hands it to its pool
(NOTE [Held gradient slots] in server/step_commit.py):

* *held* (a lone worker's push that sent its norm, where the ring allows: always for the step's
  last pushes): no gather; `UpdateTask.run` reads the gradient in place from the worker's slot
  (mean and clip folded into fused AdamW on the fp32 master, publication);
* *gathered, worker's norm* (a lone worker's earlier pushes when its ring is smaller than the
  step: since protocol 8 a lone CPU worker's step ring holds every push (the *held* line), so
  this is a GPU worker's, or one with ``step_ring=False`` or no room for a step ring):
  `GatherTask.run` copies the slot into the stage's accumulator, then the update;
* *gathered, server's norm* (before protocol 7, or a push without its norm): the copy and a norm
  pass over the accumulator, then the update;
* W workers: the pushes parked until the last one comes, then one gather sums them into the
  accumulator (``torch.add(a, b, out=grad)``) and takes the norm of the sum, then the update on
  the mean (before session 12: each gradient copied or added into the accumulator as it came).

Each case runs twice where the server's native kernels are built (NOTE [Native kernels] in
server/native.py): with them (the default) and with torch's paths (``native.turned_off()``, as on a
host without a C compiler).

As the baseline, a bare `torch.optim.AdamW([p], fused=True).step()` on a flat tensor of the same
size, alternately in this process. Ratio = baseline time / wstream time (1.0 = as fast as bare fused AdamW).

Where DeepSpeed is installed (``pip install deepspeed``; its CPU Adam op is built by its JIT with
the host's C++ compiler on first use, about a minute), its bare ``DeepSpeedCPUAdam`` step on the
same flat tensor (AdamW mode, fp32) is a second baseline, measured in the same run next to each
case: ratio = DeepSpeed's time / wstream's time, i.e. wstream's parameters per second as a
fraction of DeepSpeed's (issue 17 asks >= 0.9).

    python bench/optimizer_throughput.py [--mparams 32] [--repeat 9]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

import torch
import zmq

from common import machine, median_time, parse_args
from wstream.protocol import AdamW
from wstream.protocol import messages as m
from wstream.protocol.grad_norm import squared_norm
from wstream.protocol.layout import build_stage_spec
from wstream.protocol.shm import create_segment, map_segment, unlink_segment
from wstream.server import native
from wstream.server.job import Job
from wstream.server.pool_tasks import GatherTask, UpdateTask
from wstream.server.memory import MemoryAccount


def make_job(
    numel: int, *, double_buffer: bool, workers: int, path: str = "held", dtype: str = "float32"
) -> tuple[Job, Callable[[], None]]:
    """``path``: "held", "gathered" (the worker's norm) or "measured" (the server's norm); W > 1
    workers are always gathered. ``dtype``: the published weights'."""
    options = m.JobOptions(optimizer=AdamW(lr=1e-4), double_buffer=double_buffer, dtype=dtype)  # type: ignore[arg-type]
    created = m.CreateJob(name="b", token="t", nonce=b"n" * 32, client_nonce=b"c" * 16, options=options)
    job = Job.create(created, MemoryAccount(2**40))
    spec = build_stage_spec("0", [("w", (numel,))])
    job.add_stage(m.AddStage(session=b"s" * 16, index=0, spec=spec), [zmq.Frame(torch.randn(spec.numel).numpy().tobytes())])
    job.seal()
    # each worker's gradient in a shared-memory slot, as in its ring (unlinked at once: mapped)
    grads = []
    for _ in range(workers):
        segment = create_segment(spec.numel * 4)
        grads.append(map_segment(segment, spec.numel * 4)[: spec.numel * 4].view(torch.float32))
        unlink_segment(segment)
        grads[-1].copy_(torch.randn(spec.numel) * 1e-3)
    st = job.stages[0]
    held = workers == 1 and path == "held"
    sumsq = float(torch.linalg.vector_norm(grads[0])) ** 2 if workers == 1 and path == "gathered" else None
    if held:
        gathers = []
    elif workers == 1:
        gathers = [GatherTask(job, st, (0,), (grads[0],), job.attempt, 1, sumsq)]
    else:  # the pushes are parked until the last one comes, then summed in one task
        gathers = [GatherTask(job, st, tuple(range(workers)), tuple(grads), job.attempt, workers)]
    update = UpdateTask(job, st, grad_scale=float(workers), lr=1e-4, source=grads[0] if held else None)

    def one_stage_step() -> None:
        """Everything the server does to one stage in one step: add each worker's gradient into
        the accumulator (the last one also takes its norm) unless the slot is held, then the
        update and its publication. run() does not flip the version (the loop does), so this
        can be repeated."""
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

    print(f"native kernels (NOTE [Native kernels] in server/native.py): {'built' if native.available() else 'off'}")
    cases = [
        ("1 worker, held (read in place), fp32 in place", False, 1, "held", "float32"),
        ("1 worker, gathered, worker's norm", False, 1, "gathered", "float32"),
        ("1 worker, gathered, server's norm (protocol 6)", False, 1, "measured", "float32"),
        ("1 worker, held, double-buffered publish", True, 1, "held", "float32"),
        ("1 worker, held, bf16 published", False, 1, "held", "bfloat16"),
        ("2 workers (mean of gradients)", False, 2, "gathered", "float32"),
    ]
    for label, double, workers, path, dtype in cases:
        job, one_stage_step = make_job(numel, double_buffer=double, workers=workers, path=path, dtype=dtype)
        for kernels in ("native", "torch") if native.available() else ("torch",):
            with contextlib.nullcontext() if kernels == "native" else native.turned_off():
                t = median_time(one_stage_step, repeat=args.repeat)
            t_base = median_time(opt.step, repeat=args.repeat)  # re-measured next to each case
            line = f"wstream update, {label:48} {kernels:6}: {numel / t / 1e9:5.2f} G params/s   ratio {t_base / t:.2f}"
            if ds_step is not None:
                line += f"   vs DeepSpeed {median_time(ds_step, repeat=args.repeat) / t:.2f}"
            print(line)
        job.close()
    norm_accuracy(numel, args.repeat)


def norm_accuracy(numel: int, repeat: int) -> None:
    """The gradient norm a push carries and the server takes (NOTE [Gradient norms]): time and
    relative error against a float64 sum, next to the float32 ``vector_norm`` it replaced."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3
    g[::7] *= 50
    exact = float(torch.sum(torch.square(g.double())))
    t_old = median_time(lambda: torch.linalg.vector_norm(g), repeat=repeat)
    t_new = median_time(lambda: squared_norm(g), repeat=repeat)
    err_old = abs(float(torch.linalg.vector_norm(g)) ** 2 - exact) / exact
    err_new = abs(squared_norm(g) - exact) / exact
    print(
        f"gradient norm of {numel:,} fp32: float32 vector_norm {t_old * 1e3:.2f} ms (rel. error {err_old:.1e}); "
        f"squared_norm {t_new * 1e3:.2f} ms (rel. error {err_new:.1e}); time ratio {t_old / t_new:.2f}"
    )


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
