"""Without a C compiler, or with ``WSTREAM_NATIVE=0``, the server's native kernels are off and
torch's paths run (NOTE [Native kernels] in wstream/server/native.py, rule 5): a warning says why,
and a stage still updates. Runs in subprocesses, whose environment it sets (the library is loaded
once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def test_without_a_compiler_the_torch_paths_run(tmp_path: Path) -> None:
    """No compiler (or WSTREAM_NATIVE=0): a warning names why, and the stage still updates (by torch)."""
    script = textwrap.dedent(
        """
        import logging, torch
        logging.basicConfig(level=logging.INFO)
        from wstream.protocol import AdamW
        from wstream.protocol.layout import build_stage_spec
        from wstream.server import native
        from wstream.server.optimizer import StageOptimizer
        assert not native.available()
        spec = build_stage_spec("0", [("w", (10,))])
        opt = StageOptimizer(AdamW(lr=0.1), torch.ones(spec.numel), spec)
        published = torch.zeros(spec.numel, dtype=torch.bfloat16)
        assert opt.step(torch.ones(spec.numel), publish=published) is False  # nothing written there
        assert (opt.master < 1).all()
        print("ok")
        """
    )
    for extra in ({"CC": str(tmp_path / "no-such-cc")}, {"WSTREAM_NATIVE": "0"}):
        env = {**os.environ, "WSTREAM_NATIVE_CACHE": str(tmp_path), **extra}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "ok", done.stderr
        if "CC" in extra:
            assert "native update kernels are off" in done.stderr and "no-such-cc" in done.stderr
        else:
            assert "WSTREAM_NATIVE=0" in done.stderr
