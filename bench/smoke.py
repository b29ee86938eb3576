"""Run every benchmark in its ``--smoke`` mode (CI does, after the tests), so that none rots.

    python bench/smoke.py

Each script in bench/ runs with ``--smoke`` (its smallest sizes, through its whole code path;
the GPU ones, without CUDA, check their arguments and imports; ``gpu_train.py``
runs its whole path on the CPU) under a time limit; a line per
script says how it went and how long it took. Exits 1 if any failed or ran out of time. A new
script is picked up by its file name, so one without ``--smoke`` fails here until it has one;
the shell scripts are checked for syntax with ``bash -n``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {
    "common.py": "helpers the benchmarks import",
    "gpu_common.py": "helpers the GPU benchmarks import",
    "smoke.py": "this runner",
}
LIMIT_S = 180


def run(cmd: list[str]) -> tuple[bool, float, str]:
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, cwd=HERE.parent)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return False, time.monotonic() - started, f"{out}\n(still running after {LIMIT_S} s)"
    return done.returncode == 0, time.monotonic() - started, done.stdout + done.stderr


def main() -> int:
    jobs = [
        (p.name, [sys.executable, str(p), "--smoke"]) for p in sorted(HERE.glob("*.py")) if p.name not in NOT_BENCHMARKS
    ] + [(p.name, ["bash", "-n", str(p)]) for p in sorted(HERE.glob("*.sh"))]
    failed = []
    for name, cmd in jobs:
        ok, seconds, output = run(cmd)
        print(f"{'ok  ' if ok else 'FAIL'} {name:24} {seconds:6.1f} s", flush=True)
        if not ok:
            failed.append(name)
            print(output[-4000:], flush=True)
    print(f"{len(jobs) - len(failed)} of {len(jobs)} benchmark scripts passed their smoke run")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
