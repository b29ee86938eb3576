"""The client API under misuse (found by review): each mistake is refused by name, before the
server's state changes, and the caller loses nothing (its model keeps its weights)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

from wstream.client import SGD, AdamW, Client, LayoutError, StateError

if TYPE_CHECKING:
    from wstream.server.inprocess import InProcessServer


def on_device(stages: list[nn.Module]) -> list[str]:
    return [next(s.parameters()).device.type for s in stages]


def test_a_refused_create_job_leaves_the_callers_model_as_it_was(client: Client) -> None:
    stages = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4).double()]
    want = [s.weight.detach().clone() for s in stages]
    with pytest.raises(LayoutError, match="float"):
        client.create_job("refused", stages, optimizer=SGD(), token="t")
    assert on_device(stages) == ["cpu", "cpu", "cpu"] and all(torch.equal(s.weight, w.to(s.weight.dtype)) for s, w in zip(stages, want))
    assert client.status().jobs == []
    stages[2].float()  # what the error says to do
    job = client.create_job("refused", stages, optimizer=SGD(), token="t")
    assert torch.equal(job.state_dict()["0.weight"], want[0])


def test_a_refused_attach_or_exist_ok_leaves_the_callers_model_as_it_was(client: Client) -> None:
    client.create_job("there", [nn.Linear(4, 4), nn.Linear(4, 4)], optimizer=AdamW(), token="t")
    mine = [nn.Linear(4, 4), nn.Linear(4, 4)]
    with pytest.raises(LayoutError, match="other options"):
        client.create_job("there", mine, optimizer=SGD(), token="t", exist_ok=True)
    assert on_device(mine) == ["cpu", "cpu"]
    three = [nn.Linear(4, 4) for _ in range(3)]
    with pytest.raises(LayoutError, match="do not match"):
        client.attach_job("there", token="t", stages=three)
    assert on_device(three) == ["cpu", "cpu", "cpu"]
    job = client.attach_job("there", token="t", stages=mine)  # matching: now they are the job's skeletons
    assert on_device(mine) == ["meta", "meta"] and job.num_stages == 2


def test_a_module_given_twice_or_built_on_meta_is_refused_by_name(client: Client) -> None:
    layer = nn.Linear(4, 4)
    with pytest.raises(LayoutError, match=r"Tied\(0"):
        client.create_job("twice", [layer, layer], optimizer=SGD(), token="t")
    with pytest.raises(LayoutError, match="Tied"):  # a generator cannot be checked first: caught at upload
        client.create_job("twice-gen", (s for s in [layer, layer]), optimizer=SGD(), token="t")
    with torch.device("meta"):
        built = [nn.Linear(4, 4)]
    with pytest.raises(LayoutError, match="meta device.*materialize"):
        client.create_job("meta", built, optimizer=SGD(), token="t")
    assert client.status().jobs == []


@pytest.mark.parametrize(
    ("items", "words"),
    [
        ([nn.Linear(2, 2), None], "stage 1 is a NoneType"),
        ([nn.Linear], "stage 0 is the class Linear.*instance"),
        ([1, 2], "stage 0 is a int"),
    ],
)
def test_items_that_are_not_modules_are_refused_by_position(client: Client, items: list, words: str) -> None:
    with pytest.raises(LayoutError, match=words):
        client.create_job("items", items, optimizer=SGD(), token="t")
    with pytest.raises(LayoutError, match=words):
        client.create_job("items", iter(items), optimizer=SGD(), token="t")
    assert client.status().jobs == []


def test_an_empty_chain_is_refused_before_anything_is_sent(client: Client) -> None:
    with pytest.raises(ValueError, match="stages is empty"):
        client.create_job("empty", [], optimizer=SGD(), token="t")
    assert client.status().jobs == []


def test_a_trainer_that_fails_after_joining_leaves_the_job(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer whose construction failed after it joined stayed a live, heart-beating worker,
    and every later step of the job waited for its gradients (up to wait_timeout)."""
    import wstream.client.trainer as trainer_module

    job = client.create_job("left", [nn.Linear(4, 4), nn.Linear(4, 4)], optimizer=SGD(), token="t")

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("injected: the executor could not be made")

    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "PlanExecutor", broken)
        with pytest.raises(RuntimeError, match="injected"):
            job.trainer()
    assert [j.workers for j in client.status().jobs] == [[]]
    with job.trainer() as trainer:  # trains alone: nobody else is waited for
        trainer.step(torch.randn(2, 4), torch.randn(2, 4), torch.nn.functional.mse_loss)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"shm": "no"}, "shm must be bool or None"),
        ({"prefetch": 1.5}, "prefetch must be int or None"),
        ({"grad_slots": 0}, "grad_slots must be 1..64"),
        ({"reconnect_s": -5}, "reconnect_s must be a finite number >= 0"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"loss_scale": "yes"}, "loss_scale must be LossScale or bool or None"),
        ({"preserve_rng": "yes"}, "preserve_rng must be bool"),
    ],
)
def test_trainer_options_of_the_wrong_type_or_range_are_refused_before_joining(
    client: Client, options: dict, words: str
) -> None:
    job = client.create_job("opts", [nn.Linear(4, 4)], optimizer=SGD(), token="t")
    with pytest.raises((TypeError, ValueError), match=words):
        job.trainer(**options)
    assert [j.workers for j in client.status().jobs] == [[]]


def test_micro_batches_of_inputs_and_targets_of_different_batch_sizes_are_refused(client: Client) -> None:
    """Inputs of 8 rows and targets of 2 trained silently with micro_batches=2 (each micro-batch's
    4 outputs broadcast against 1 target row); a float count failed inside tensor_split."""
    job = client.create_job("mb", [nn.Linear(4, 4)], optimizer=SGD(), token="t")
    before = job.state_dict()
    with job.trainer() as trainer:
        with pytest.raises(ValueError, match="batch of 8 and targets of 2"):
            trainer.step(torch.randn(8, 4), torch.randn(2, 4), torch.nn.functional.mse_loss, micro_batches=2)
        with pytest.raises(TypeError, match="micro_batches must be an int"):
            trainer.step(torch.randn(8, 4), torch.randn(8, 4), torch.nn.functional.mse_loss, micro_batches=2.0)  # type: ignore[arg-type]
        assert all(torch.equal(v, job.state_dict()[k]) for k, v in before.items())
        trainer.step(torch.randn(8, 4), torch.randn(8, 4), torch.nn.functional.mse_loss, micro_batches=2)  # still trains


def test_a_state_dict_read_while_the_job_trains_is_of_one_step() -> None:
    """Found by review: ``state_dict``/``export`` pulled stage after stage while a trainer stepped,
    and 18 of 32 reads mixed steps (stages at [0, 0, 1, 1, 1, 1]). A stage read at an older step
    than another is read again (its update was still to come) until all agree."""
    from wstream.client.job_handle import CONSISTENT_PULL_ROUNDS, pull_consistent

    at = [1, 0, 1, 0]  # stages 1 and 3 are read before their update of step 0 -> 1
    calls: list[int] = []

    def pull(j: int) -> tuple[int, dict[str, torch.Tensor]]:
        calls.append(j)
        version = at[j]
        at[j] = 1
        return version, {"w": torch.full((1,), float(version))}

    counted: list[int] = []
    step, got = pull_consistent(pull, 4, "j", pulled=counted.append)
    assert calls == [0, 1, 2, 3, 1, 3] and step == 1 and all(t["w"].item() == 1.0 for t in got)
    assert counted == [0, 1, 2, 3]  # a progress bar counts a stage read again once (it counted 6)

    ahead = iter(range(10**6))  # a job that trains faster than it is read

    def racing(j: int) -> tuple[int, dict[str, torch.Tensor]]:
        return next(ahead), {}

    with pytest.raises(StateError, match=f"kept training while its weights were read.*{CONSISTENT_PULL_ROUNDS} rounds"):
        pull_consistent(racing, 3, "j")


def test_state_dicts_read_from_another_thread_during_training_hold_one_step_each(client: Client) -> None:
    """Six one-weight stages that start equal and get the same gradient each step (the loss
    -out / out.detach() gives every w_i the gradient -1 / w_i): every stage holds the same value at
    every step (to rounding), so a read that mixed steps would hold two values."""
    stages = [nn.Linear(1, 1, bias=False) for _ in range(6)]
    for s in stages:
        nn.init.ones_(s.weight)
    job = client.create_job("live", stages, optimizer=SGD(lr=0.1), token="t", unit_bytes=None)
    stop = threading.Event()
    seen: list[set[float]] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            with Client(client.address, timeout=30) as reader:
                handle = reader.attach_job("live", token="t")
                while not stop.is_set():
                    seen.append({t.item() for t in handle.state_dict().values()})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def loss_fn(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return -(out / out.detach()).sum()

    thread = threading.Thread(target=read)
    with job.trainer() as trainer:
        thread.start()
        try:
            for _ in range(30):
                trainer.step(torch.ones(1, 1), torch.zeros(1, 1), loss_fn)
        finally:
            stop.set()
            thread.join(60)
    assert not errors, errors
    mixed = [v for v in seen if max(v) - min(v) > 1e-4]  # a step moves every weight by >= 0.03; rounding by 1e-7
    assert len(seen) > 1 and not mixed, mixed[:3]


def test_a_trainer_refuses_a_second_call_while_one_runs(client: Client) -> None:
    """Found by review: two threads stepping one trainer (or a step from inside loss_fn) failed
    with "prefetch order broken (a bug in wstream)" and left the step count off the job's. The
    second call is now refused at once, by name, and the trainer goes on."""
    job = client.create_job("busy", [nn.Linear(4, 4), nn.Linear(4, 4)], optimizer=SGD(), token="t")
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    inside, release = threading.Event(), threading.Event()
    refused: list[BaseException] = []

    with job.trainer() as trainer:

        def slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            inside.set()
            release.wait(30)
            return torch.nn.functional.mse_loss(out, target)

        def other() -> None:
            inside.wait(30)
            try:
                trainer.step(x, y, torch.nn.functional.mse_loss)
            except StateError as exc:
                refused.append(exc)
            finally:
                release.set()

        thread = threading.Thread(target=other)
        thread.start()
        trainer.step(x, y, slow_loss)
        thread.join(30)
        assert len(refused) == 1 and "busy with another call: step()" in str(refused[0])

        def reentrant_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            trainer.forward(x)
            return torch.nn.functional.mse_loss(out, target)

        with pytest.raises(StateError, match=r"forward\(\) came from another thread or from inside loss_fn"):
            trainer.step(x, y, reentrant_loss)
        trainer.step(x, y, torch.nn.functional.mse_loss)  # still trains
        assert trainer.step_index == 2 == trainer.wait_updates()


def test_a_closed_client_says_so_and_one_client_serves_several_threads(server: object) -> None:
    """Found by review: a closed Client (and its Job handles) raised ZMQError 'Socket operation on
    non-socket'; two threads using one Client mixed their replies, then every call failed."""
    address = server.address  # type: ignore[attr-defined]
    client = Client(address, timeout=30)
    job = client.create_job("threads", [nn.Linear(4, 4) for _ in range(4)], optimizer=SGD(), token="t", unit_bytes=None)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(20):
                assert len(job.state_dict()) == 8
                assert client.status().jobs[0].name == "threads"
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:1]
    client.close()
    with pytest.raises(StateError, match="this Client is closed"):
        client.status()
    with pytest.raises(StateError, match="this Client is closed"):
        job.state_dict()


def test_pull_stage_checks_its_index_and_unit_bytes_its_value(client: Client) -> None:
    """Found by review: pull_stage(-1) returned {} with units (a bare IndexError past the end);
    unit_bytes=True cut every stage apart (True is 1 byte), and an explicit size cut a frozen base,
    whose jobs then failed naming a parameter 'not in the base'."""
    job = client.create_job("idx", [nn.Linear(2, 2), nn.Linear(2, 2)], optimizer=SGD(), token="t")
    for bad in (-1, 2, 1.0):
        with pytest.raises(IndexError, match=r"stages 0\.\.1"):
            job.pull_stage(bad)  # type: ignore[arg-type]
    assert set(job.pull_stage(1)) == {"weight", "bias"}
    for bad in (True, 1.5, 0):
        with pytest.raises(ValueError, match="unit_bytes must be"):
            client.create_job("ub", [nn.Linear(2, 2)], optimizer=SGD(), token="t", unit_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="frozen=True"):
        client.create_job("base", [nn.Linear(2, 2)], token="t", frozen=True, unit_bytes="4KiB")
    assert [j.name for j in client.status().jobs] == ["idx"]


def test_the_session_evicted_past_the_limit_is_the_one_idle_longest(tmp_path: object) -> None:
    """Found by review: past --max-sessions-per-job the oldest-made session was closed, even one in
    use all along, while helpers that open a session per call had left idle ones behind."""
    from rawwire import RawPeer
    from wstream.server.inprocess import InProcessServer

    with InProcessServer(bind=[f"ipc://{tmp_path}/s.sock"], memory_limit=2**30, max_sessions_per_job=2) as srv:
        with Client(srv.address, timeout=30) as client:
            job = client.create_job("busy", [nn.Linear(2, 2)], optimizer=SGD(), token="t")  # its session: the oldest
            peer = RawPeer(srv.address)
            try:
                idle = peer.attach("busy", "t")
                job.state_dict()  # the job's handle is used after the idle one was made
                peer.attach("busy", "t")  # one too many: the idle one goes
                assert set(job.state_dict()) == {"0.weight", "0.bias"}
                reply, _ = idle.request("heartbeat")
                assert reply["code"] == "session_expired", reply
            finally:
                peer.close()


def test_a_stage_that_changes_its_input_in_place_is_named(client: Client) -> None:
    """Found by review: a stage whose first op is ReLU(inplace=True) trains in plain PyTorch and
    failed in every wstream schedule with torch's 'a leaf Variable that requires grad is being used
    in an in-place operation', naming no stage."""
    stages = [nn.Linear(4, 4), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))]
    job = client.create_job("inplace", stages, optimizer=SGD(), token="t")
    with job.trainer() as trainer:
        with pytest.raises(RuntimeError, match=r"position 1's stage changes its input in place.*inplace=False"):
            trainer.step(torch.randn(2, 4), torch.randn(2, 4), torch.nn.functional.mse_loss)


def test_job_operations_by_token_reuse_one_session(tmp_path: Path) -> None:
    """Found by review: ``Client.wait_step/save_job/set_schedule`` with a token opened a session
    per call, so a script polling ``wait_step`` crowded out the job's workers' sessions
    (``--max-sessions-per-job``). One handle per (job, token) is kept, and opened again when the
    server has forgotten its session (here: evicted by other sessions)."""
    from wstream.server.inprocess import InProcessServer

    with InProcessServer(bind=[f"ipc://{tmp_path}/s.sock"], max_sessions_per_job=3) as srv:
        with Client(srv.address, timeout=30) as c:
            c.create_job("polled", [nn.Linear(2, 2)], optimizer=SGD(), token="t")

            def sessions() -> int:
                return sum(1 for s in list(srv.server._sessions.all.values()) if s.job.name == "polled")

            before = sessions()
            for _ in range(10):
                assert c.wait_step("polled", 0, token="t") == 0
            c.set_schedule("polled", lr=0.5, token="t")
            assert sessions() == before + 1
            with Client(srv.address, timeout=30) as other:  # newer sessions evict the kept one
                for _ in range(3):
                    other.attach_job("polled", token="t")
            assert c.wait_step("polled", 0, token="t") == 0  # a new handle, transparently
            c.drop_job("polled", token="t")
            assert c.status().jobs == []


def test_secrets_read_from_files_with_their_newline(client: Client, admin_server: InProcessServer) -> None:
    """Found by review: ``token=open(f).read()`` made a job that ``wstream --token-file f`` (which
    strips) could never open, and ``admin_secret=open(f).read()`` never matched the server's
    (stripped) secret. A new job's token with whitespace around it is refused; an admin secret
    given so is stripped, as the server strips its file's."""
    from conftest import ADMIN_SECRET
    from wstream.client import JobExistsError

    with pytest.raises(ValueError, match="whitespace around it"):
        client.create_job("nl", [nn.Linear(2, 2)], token="t\n")
    assert client.status().jobs == []
    client.create_job("exists", [nn.Linear(2, 2)], token="t")
    with pytest.raises(JobExistsError) as exists:
        client.create_job("exists", [nn.Linear(2, 2)], token="t")
    assert "exist_ok=True" in "".join(getattr(exists.value, "__notes__", []))
    from wstream.client import AuthError, SessionExpiredError

    with Client(admin_server.address, admin_secret=ADMIN_SECRET + "\n", timeout=30) as admin:
        old = admin.create_job("a", [nn.Linear(2, 2)], optimizer=SGD(), token="t")
        assert [j.name for j in admin.status().jobs] == ["a"]
        # found by review: a job handle's refused drop named an internal op; it names the client method now
        with pytest.raises(AuthError) as refused:
            old.drop()
        assert "admin_secret=...).drop_job('a'" in "".join(getattr(refused.value, "__notes__", []))
        admin.drop_job("a")
        admin.create_job("a", [nn.Linear(2, 2)], optimizer=SGD(), token="t")  # another job of the name
        # a handle kept past the drop never acts on the new job (its session was the old job's)
        with pytest.raises((AuthError, SessionExpiredError)):
            old.drop()
        with pytest.raises((AuthError, SessionExpiredError)):
            old.set_schedule(lr=0.5)
        assert [j.name for j in admin.status().jobs] == ["a"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_a_cuda_trainer_without_cuda_is_refused_by_name(client: Client) -> None:
    """Found by review: ``job.trainer("cuda")`` on a CPU-only torch failed with torch's bare
    ``AssertionError: Torch not compiled with CUDA enabled``, after joining."""
    job = client.create_job("nocuda", [nn.Linear(2, 2)], optimizer=SGD(), token="t")
    with pytest.raises(ValueError, match="device 'cuda': .*train on 'cpu'"):
        job.trainer("cuda")
    assert [j.workers for j in client.status().jobs] == [[]]


def test_a_cuda_device_without_an_index_gets_the_current_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review of the GPU paths: ``job.trainer("cuda")`` on a torchrun rank kept the device
    without its index, so the helper threads' device guards (which start on device 0) did nothing
    and every rank made a context on GPU 0. The current device's index is taken (the rank's)."""
    from wstream.client import job_handle

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert job_handle.worker_device("cuda") == torch.device("cuda", 3)
    assert job_handle.worker_device("cuda:1") == torch.device("cuda", 1)


def test_a_request_under_way_when_its_client_closes_says_the_client_closed(server: object) -> None:
    """Found by review: a thread waiting in a Job handle's request (``wait_step`` of a step the job
    never reaches) while another thread closed the Client got a bare ZMQError from under its poll
    (the socket was closed beneath it). It now gets the closed Client's StateError, and the
    socket is closed by the thread using it, not from under it."""
    address = server.address  # type: ignore[attr-defined]
    client = Client(address, timeout=30)
    job = client.create_job("held", [nn.Linear(4, 4) for _ in range(2)], optimizer=SGD(), token="t")
    started, errors = threading.Event(), []

    def wait() -> None:
        started.set()
        try:
            job.wait_step(5, timeout=60)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    started.wait(30)
    while not client._chan._lock.locked():  # the request is in its poll  # noqa: ASYNC110
        threading.Event().wait(0.01)
    client.close()
    waiter.join(60)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StateError), errors
    assert "this Client is closed" in str(errors[0])
