"""The examples in examples/ run end to end (small settings) and say what they promise."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wstream.protocol import PROTOCOL_VERSION
from wstream.protocol.shm import segment_paths

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str) -> str:
    """Run examples/NAME with ARGS to completion (it must exit 0); its standard output."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_gpt_demo_starts_a_server_trains_and_reports_memory(tmp_path: Path) -> None:
    text = run_example(
        "train_gpt.py",
        # 128 wide: embedding + block 0 + block 1 make one 1 MiB transfer unit, the head another
        *("--server", f"ipc://{tmp_path}/demo.sock", "--steps", "12", "--layers", "2", "--embd", "128"),
        *("--micro-batches", "2", "--trace", str(tmp_path / "trace.json")),
    )
    assert "started wstream-server" in text
    assert "job 'gpt-demo-" in text and "4 stages in 2 transfer units" in text
    first, last = (float(v) for v in text.split("\nloss ")[1].split(" in ")[0].split(" -> "))
    assert last < first  # 12 steps from random init already lower the loss
    assert "worker peak: weight ring" in text and "2 of 2 transfer units resident at most, peak 2" in text
    streamed = text.split("streamed per step: ")[1].split("\n")[0]
    assert "of weights read in place (zero-copy)" in streamed and not streamed.startswith("0 B")
    assert "sample:\nShall I " in text
    trace = json.loads((tmp_path / "trace.json").read_text())
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert [e["args"]["step"] for e in steps] == [10, 11] and all(e["args"]["micro_batches"] == 2 for e in steps)
    assert any(e.get("cat") == "optimizer" for e in trace["traceEvents"])  # the server's side
    pid = int(re.search(r"started wstream-server \(pid (\d+)\)", text).group(1))
    assert segment_paths(pid) == []  # the demo's server cleaned up (other servers may be running)


def test_hf_finetune_example_trains_exports_and_reloads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    text = run_example(
        "hf_finetune.py",
        *("--server", f"ipc://{tmp_path}/hf.sock", "--steps", "6", "--seq", "32", "--batch", "4"),
        *("--out", str(tmp_path / "finetuned")),
    )
    assert "5 stages, positions [0, 1, 2, 3, 4, 0]" in text  # the tied head runs on stage 0
    first, last = (float(v) for v in text.split("\nloss ")[1].split(" in ")[0].split(" -> "))
    assert last < first
    diff = float(text.split("gives the streamed logits to ")[1].split()[0])
    assert diff <= 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned")
    assert model.config.n_layer == 4
    pid = int(re.search(r"started wstream-server \(pid (\d+)\)", text).group(1))
    assert segment_paths(pid) == []


def test_hf_finetune_example_lora_trains_adapters_on_a_frozen_base(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    text = run_example(
        "hf_finetune.py",
        *("--lora", "--server", f"ipc://{tmp_path}/lora.sock", "--steps", "6", "--seq", "32", "--batch", "4"),
        *("--out", str(tmp_path / "finetuned")),
    )
    assert "LoRA rank 8 on 'c_attn', 8,192 trained parameters of 224,640" in text  # 4 layers x (8x64 + 192x8)
    first, last = (float(v) for v in text.split("\nloss ")[1].split(" in ")[0].split(" -> "))
    assert last < first
    base, adapters = (int(v.replace(",", "")) for v in re.search(r"base ([\d,]+) B .*adapters ([\d,]+) B", text).groups())
    assert adapters == 8192 * 16 and base < 224_640 * 4 * 1.01  # adapters: master, AdamW, accumulator; base: weights
    assert float(text.split("from_pretrained gives the streamed logits to ")[1].split()[0]) <= 1e-5
    if "peft gives the streamed logits to " in text:
        assert float(text.split("peft gives the streamed logits to ")[1].split()[0]) <= 1e-5
    assert sorted(p.name for p in (tmp_path / "finetuned" / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned" / "merged").config.n_layer == 4
    pid = int(re.search(r"started wstream-server \(pid (\d+)\)", text).group(1))
    assert segment_paths(pid) == []


def test_concepts_example_equals_plain_pytorch(tmp_path: Path) -> None:
    text = run_example("concepts.py", "--server", f"ipc://{tmp_path}/c.sock", "--steps", "3")
    assert "6 stages" in text and "plan revolve: 8 forwards for 6 stages, at most 3 stage inputs live" in text
    diff = float(re.search(r"largest difference from plain PyTorch training: (\S+)", text).group(1))
    assert diff < 1e-6


def test_watch_server_example_shows_status_and_metrics() -> None:
    text = run_example("watch_server.py", "--steps", "3")
    assert re.search(r"watched\s+ready\s+3\s", text), text  # the status table: job, state, step
    assert "of 1.00 GiB" in text  # the TOML file's memory limit applies
    assert 'wstream_job_step{job="watched"} 3.0' in text
    assert 'wstream_gradients_received_total{job="watched"} 3.0' in text  # 3 steps x 1 unit (of the 4 small stages)


def test_raw_protocol_example_talks_msgpack_by_hand() -> None:
    text = run_example("raw_protocol.py")
    assert f"status -> status_reply: protocol {PROTOCOL_VERSION}, jobs ['raw']" in text
    # the job's two small stages are one transfer unit on the wire, its parameters "<stage>.<name>"
    assert "attach -> attached: session" in text and "('0.weight', [4, 4])" in text and "(units [2])" in text
    assert "error auth_failed" in text and "error bad_message" in text
    assert "status again -> status_reply" in text


def test_vgg_batchnorm_example_streams_running_statistics(tmp_path: Path) -> None:
    text = run_example("vgg_batchnorm.py", "--server", f"ipc://{tmp_path}/vgg.sock", "--steps", "12")
    assert "5 stages" in text and "(18 buffers)" in text
    first, last = (float(v) for v in text.split("\nloss ")[1].split(" in ")[0].split(" -> "))
    assert last < first
    assert "BatchNorm updates per layer: 24 (12 steps x 2 micro-batches" in text
    assert "read in place (zero-copy, nothing copied)" in text  # the stats' summary
    diff = float(re.search(r"largest logit difference from the stream (\S+)", text).group(1))
    assert diff <= 1e-5  # the export, loaded into plain PyTorch, computes what the stream did
    pid = int(re.search(r"started wstream-server \(pid (\d+)\)", text).group(1))
    assert segment_paths(pid) == []
