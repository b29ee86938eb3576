"""A job published in bfloat16 (fp32 master and optimizer state on the server) is computed in
bfloat16 by the worker, end to end, and trains close to the same job in fp32."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import models
from conftest import ServerThread
from rawwire import RawPeer, RawSession
from test_equivalence import reference_train
from wstream.client import AdamW, Client, LayoutError, JobOptions
from wstream.protocol.auth import secret_key, session_key

STEPS = 8


def _train(
    client: Client, name: str, dtype: str, seen: list[torch.dtype], **trainer_kw: object
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train a fresh job of ``dtype``; the losses and the final (fp32 master) weights."""
    job = client.create_job(name, models.mixed(seed=6), optimizer=AdamW(lr=3e-3), token="t", dtype=dtype)  # type: ignore[arg-type]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append(out.dtype)
        return models.loss_fn(out.float(), target)

    with job.trainer(**trainer_kw) as trainer:  # type: ignore[arg-type]
        assert trainer.compute_dtype == getattr(torch, dtype)
        batch = models.batch("mixed", 0, size=64)  # one batch, fitted: the loss must fall
        losses = [trainer.step(*batch, loss_fn) for _ in range(STEPS)]
    return losses, job.state_dict()


@pytest.mark.parametrize("mode", ["zero-copy", "shm-copy", "frames"])
def test_bfloat16_job_computes_in_bfloat16_and_trains_close_to_float32(client: Client, mode: str) -> None:
    seen32: list[torch.dtype] = []
    seen16: list[torch.dtype] = []
    fp32, w32 = _train(client, "fp32", "float32", seen32)
    kw = {"frames": {"shm": False}, "shm-copy": {"zero_copy": False}, "zero-copy": {"zero_copy": True}}[mode]
    bf16, w16 = _train(client, "bf16", "bfloat16", seen16, **kw)  # frames: bf16 weights as data frames
    assert set(seen32) == {torch.float32} and set(seen16) == {torch.bfloat16}  # activations in bf16
    start = reference_train(models.mixed(seed=6), lambda p: torch.optim.AdamW(p, lr=3e-3), "mixed", 0)
    assert fp32[-1] < 0.9 * fp32[0] and bf16[-1] < 0.9 * bf16[0]  # both learn
    assert bf16 == pytest.approx(fp32, rel=5e-3)  # measured: within 0.1%
    # how far bf16 training strays, against how far training went (updates as vectors; measured 2.2%)
    d32 = torch.cat([(w32[k] - start[k]).flatten() for k in start])
    d16 = torch.cat([(w16[k] - start[k]).flatten() for k in start])
    stray = ((d16 - d32).norm() / d32.norm()).item()
    assert w16[next(iter(w16))].dtype == torch.float32  # the fp32 master is what state_dict reads
    assert stray < 0.06, f"bf16 updates differ from fp32's by {stray:.1%} of their size"


def test_a_float64_model_is_refused_naming_the_stage_and_parameter(client: Client) -> None:
    """The server keeps an fp32 master: a float64 model would be trained in float32 with no word."""
    stages = [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)).double(), nn.Linear(4, 2)]
    with pytest.raises(
        LayoutError,
        match=r"stage 1: parameter '0.weight' is float64; wstream trains float32, bfloat16 or float16: "
        r"call model.float\(\) first",
    ):
        client.create_job("f64", stages, token="t")
    for options in ({"dtype": "float64"}, {"options": JobOptions(dtype="float64")}):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="dtype 'float64': a job computes in float32, bfloat16 or float16"):
            client.create_job("f64", [nn.Linear(4, 4)], token="t", **options)  # type: ignore[arg-type]
    assert client.status().jobs == []
    # a 16-bit model is taken: its weights are exact in the fp32 master
    job = client.create_job("bf16", [nn.Linear(4, 4).to(torch.bfloat16)], token="t", dtype="bfloat16")
    assert job.options.dtype == "bfloat16"


def test_the_server_refuses_float64_on_the_wire(server: ServerThread) -> None:
    """Below the client: a float64 compute dtype, and float64 weights for a stage."""
    peer = RawPeer(server.address)
    try:
        nonce, mine = peer.nonce(), os.urandom(32)
        reply, _ = peer.request("create_job", name="raw", token="t", options={"dtype": "float64"}, nonce=nonce, client_nonce=mine)
        assert reply["op"] == "error" and reply["code"] == "bad_message" and "$.options.dtype" in reply["message"], reply

        nonce, mine = peer.nonce(), os.urandom(32)
        reply, _ = peer.request("create_job", name="raw", token="t", options={}, nonce=nonce, client_nonce=mine)
        assert reply["op"] == "attached", reply
        session = RawSession(peer, reply["session"], session_key(secret_key("t"), nonce, mine))
        spec = {"name": "0", "numel": 16, "params": [["w", [4, 4], 0, 0, False]]}
        reply, _ = session.request("add_stage", torch.zeros(16, dtype=torch.float64).numpy().tobytes(), index=0, spec=spec)
        assert reply["op"] == "error" and reply["code"] == "bad_layout", reply
        assert "got 128 bytes of weights, the layout needs 64 (16 float32 elements)" in reply["message"]
        reply, _ = session.request("drop_job")
        assert reply["op"] == "ok", reply
    finally:
        peer.close()



def _rel(u: torch.Tensor, v: torch.Tensor) -> float:
    return ((u - v).norm() / v.norm()).item()


def test_bfloat16_gradients_are_summed_in_float32_across_micro_batches(client: Client) -> None:
    """Found by review: a bf16 job summed its micro-batches' gradients in bf16, doubling the
    gradient's rounding error at 32 micro-batches, while the server's sums, the all-reduce and the
    loss-scaled fp16 path all sum in fp32 (as fp32-master mixed precision does). The applied
    gradient (SGD, lr 1) is now the fp32 sum of the micro-batches' bf16 gradients."""
    from wstream.client import SGD

    def stages() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(16, 64), nn.Tanh()), nn.Sequential(nn.Linear(64, 64), nn.Tanh()), nn.Linear(64, 4)]

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(256, 16, generator=g), torch.randn(256, 4, generator=g)
    k = 32

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out.float() - target) ** 2).mean()

    def reference(acc: torch.dtype) -> torch.Tensor:
        model = nn.Sequential(*stages()).to(torch.bfloat16)
        total = [torch.zeros_like(p, dtype=acc) for p in model.parameters()]
        for xj, yj in zip(x.chunk(k), y.chunk(k)):
            grads = torch.autograd.grad(loss_fn(model(xj.to(torch.bfloat16)), yj) / k, list(model.parameters()))
            for a, gj in zip(total, grads):
                a.add_(gj.to(acc))
        return torch.cat([t.float().flatten() for t in total])

    model = nn.Sequential(*stages())
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    job = client.create_job("bf16-sum", stages(), optimizer=SGD(lr=1.0), token="t", dtype="bfloat16", unit_bytes=None)
    with job.trainer() as trainer:
        trainer.step(x, y, loss_fn, micro_batches=k)
    state = job.state_dict()
    applied = start - torch.cat([state[name].flatten() for name, _ in model.named_parameters()])
    fp32_sum, bf16_sum = reference(torch.float32), reference(torch.bfloat16)
    assert _rel(bf16_sum, fp32_sum) > 1e-4  # the two sums differ measurably
    assert _rel(applied, fp32_sum) < 1e-6, (_rel(applied, fp32_sum), _rel(applied, bf16_sum))


def test_bfloat16_gradients_are_summed_in_float32_across_a_loops_applications(client: Client) -> None:
    """As above, for one stage applied 64 times (``step_loop``): its gradient is the fp32 sum of
    the applications' bf16 gradients (each application a copy of the weights, in the reference)."""
    import copy

    from wstream.client import SGD

    n = 64

    def body() -> nn.Module:
        torch.manual_seed(0)
        lin = nn.Linear(16, 16)
        with torch.no_grad():
            lin.weight.mul_(0.5)
        return nn.Sequential(lin, nn.Tanh())

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g) * 0.1

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), target)

    def reference(acc: torch.dtype) -> torch.Tensor:
        copies = [copy.deepcopy(body()).to(torch.bfloat16) for _ in range(n)]
        h = x.to(torch.bfloat16)
        for c in copies:
            h = c(h)
        grads = torch.autograd.grad(loss_fn(h, y), [p for c in copies for p in c.parameters()])
        per = len(list(body().parameters()))
        total = [torch.zeros_like(grads[i], dtype=acc) for i in range(per)]
        for j in range(n):
            for i in range(per):
                total[i].add_(grads[i + per * j].to(acc))
        return torch.cat([t.float().flatten() for t in total])

    start = torch.cat([p.detach().flatten() for p in body().parameters()])
    job = client.create_job("bf16-loop", [body()], optimizer=SGD(lr=1.0), token="t", dtype="bfloat16")
    with job.trainer() as trainer:
        trainer.step_loop(x, y, loss_fn, halt=lambda h: False, max_steps=n)
    state = job.state_dict()
    applied = start - torch.cat([state[name].flatten() for name in ("0.0.weight", "0.0.bias")])
    fp32_sum, bf16_sum = reference(torch.float32), reference(torch.bfloat16)
    assert _rel(bf16_sum, fp32_sum) > 1e-4
    assert _rel(applied, fp32_sum) < 1e-6, (_rel(applied, fp32_sum), _rel(applied, bf16_sum))
