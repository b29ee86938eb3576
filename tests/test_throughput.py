"""Throughput in trainer stats: samples and token ids per second over the last steps."""

from __future__ import annotations

import pytest
import torch

import models
from wstream.client import Client
from wstream.client.models import GPTConfig, gpt_stages, lm_loss
from wstream.client.throughput import Throughput, work_of


def test_rates_are_work_over_time_in_a_window_of_recent_steps() -> None:
    t = Throughput(window=2)
    assert t.samples_per_s is None and t.tokens_per_s is None
    t.add(8, 8 * 16, 2.0)
    t.add(8, 8 * 16, 2.0)
    assert t.samples_per_s == 4.0 and t.tokens_per_s == 64.0
    t.add(4, None, 1.0)  # the first step leaves the window; this one has no token count
    assert t.samples_per_s == pytest.approx(12 / 3) and t.tokens_per_s is None
    ids = torch.zeros(3, 5, dtype=torch.long)
    assert work_of(ids) == (3, 15) and work_of((torch.zeros(3, 5), ids)) == (3, None) and work_of(7) == (0, None)


def test_a_language_model_reports_tokens_per_second_and_a_regression_only_samples(client: Client) -> None:
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    job = client.create_job("lm", gpt_stages(cfg), token="t")
    ids = torch.randint(0, 32, (4, 8))
    with job.trainer() as trainer:
        assert trainer.stats().samples_per_s is None
        for _ in range(2):
            trainer.step(ids, ids, lm_loss)
        stats = trainer.stats()
    assert stats.samples_per_s is not None and stats.samples_per_s > 0
    assert stats.tokens_per_s == pytest.approx(8 * stats.samples_per_s)  # 8 token ids per sample

    reg = client.create_job("reg", models.mixed(), token="t")
    with reg.trainer() as trainer:
        trainer.step(*models.batch("mixed", 0), models.loss_fn)
        assert trainer.stats().samples_per_s is not None and trainer.stats().tokens_per_s is None


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "copy"])
def test_trainer_stats_read_as_a_summary_that_names_the_zero_copy_path(client: Client, zero_copy: bool) -> None:
    """``repr(stats)`` is a short summary in units; a zero-copy worker copies no weight bytes, so
    it says how many it read in place instead of "0 B fetched"."""
    job = client.create_job("s", models.mixed(), token="t")
    stage_bytes = sum(s.numel * 4 for s in job.specs)
    with job.trainer(zero_copy=zero_copy) as trainer:
        for step in range(2):
            trainer.step(*models.batch("mixed", step), models.loss_fn)
        stats = trainer.stats()
    text = repr(stats)
    lines = text.splitlines()
    assert lines[0].startswith("TrainerStats: 2 steps, ") and "samples/s" in lines[0]
    weights = next(line for line in lines if line.strip().startswith("weights:"))
    assert stats.zero_copy is zero_copy
    if zero_copy:
        assert stats.bytes_fetched == 0 and stats.bytes_read_in_place >= 2 * stage_bytes
        assert "read in place (zero-copy, nothing copied)" in weights and "0 B" not in weights
    else:
        assert stats.bytes_read_in_place == 0 and stats.bytes_fetched >= 2 * stage_bytes
        assert "copied" in weights and "in place" not in weights
    assert any(line.strip().startswith("gradients: ") and "pushes" in line for line in lines)
    assert "LatencyWindow object" not in text and len(lines) <= 6
