"""Operating a server: settings from a TOML file, the status table, Prometheus metrics.

Writes a small ``server.toml``, starts ``wstream-server --config server.toml`` (with a metrics
port), trains a job for a few steps in this process, then prints what an operator sees:
``wstream status`` and a few lines of the ``/metrics`` page. See docs/operating.md.

    python examples/watch_server.py [--steps 4]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import torch
from torch import nn

from wstream.client import AdamW, Client, local_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        address, port = f"ipc://{tmp}/server.sock", free_port()
        config = Path(tmp) / "server.toml"
        config.write_text(
            f'bind = ["{address}"]\nmemory_limit = "1GiB"\nstore = "{tmp}/store"\nsnapshot_every = 2\n'
            f"metrics_port = {port}\nlease_s = 10\n"
        )
        print(f"--- {config.name}\n{config.read_text()}")
        with local_server(address, "--config", str(config), memory_limit=None, reuse=False), Client(address) as client:
            torch.manual_seed(0)
            stages = [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)]
            job = client.create_job("watched", stages, optimizer=AdamW(lr=1e-3), token="t")
            with job.trainer() as trainer:
                for _ in range(args.steps):
                    trainer.step(torch.randn(32, 64), torch.randn(32, 64), nn.functional.mse_loss)
                status = subprocess.run(
                    [sys.executable, "-m", "wstream.client.admin", "status", "--server", address],
                    capture_output=True, text=True, check=True,
                ).stdout
                print(f"--- wstream status\n{status}")
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            wanted = ("wstream_job_step{", "wstream_job_workers{", "wstream_gradients_received_total{")
            print("--- /metrics (a few lines)")
            for line in page.splitlines():
                if line.startswith(wanted):
                    print(line)


if __name__ == "__main__":
    main()
