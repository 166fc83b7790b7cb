"""Units of nnx_es.distributed that need no process group: one process's World, the refusals made
at construction, callback roles, how a refusal travels, the follower's memory store and log."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from events.schema import EpochBegan
from nnx_es import Callback, EarlyStopping, LambdaCallback, Trainer
from nnx_es.distributed import DDP, writer_only
from nnx_es.distributed.follower import FollowerBlobStore, FollowerLog
from nnx_es.distributed.roles import check_declared, for_rank
from nnx_es.distributed.verdict import agree_outcome, describe_error, raise_described
from nnx_es.errors import CheckpointWriteError, ConfigError, CorruptCheckpointError, ResumeError
from nnx_es.runtime.run_state import World


def test_one_process_world_agrees_with_itself_without_a_group() -> None:
    w = World()
    t = torch.tensor([1.0, 2.0])
    assert w.agree(t) is t and t.tolist() == [1.0, 2.0]
    assert w.agree_flag(True) is True and w.agree_flag(False) is False
    assert w.gather("x") == ["x"] and w.share(3) == 3 and w.gather_tensor(t)[0] is t
    assert not w.distributed and w.is_writer


@pytest.mark.parametrize("kwargs,word", [(dict(writer_rank=-1), "writer_rank"), (dict(timeout_seconds=0), "timeout"),
                                         (dict(digest_every=0), "digest_every")])
def test_ddp_arguments_are_checked(kwargs: dict, word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        DDP(**kwargs)


@pytest.mark.parametrize("value,named", [("0", "got str '0'"), (1.0, "got float 1.0"), (True, "got bool True")])
def test_ddp_writer_rank_of_another_type_names_the_type_received(value: object, named: str) -> None:
    with pytest.raises(ConfigError, match="must be an int") as err:
        DDP(writer_rank=value)  # type: ignore[arg-type]
    assert named in str(err.value) and "DDP(writer_rank=0)" in str(err.value)


def _trainer(net: nn.Module, **kw) -> Trainer:
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), distributed=DDP(), **kw)


def test_batchnorm_and_fp16_and_a_custom_step_are_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match="SyncBatchNorm"):
        _trainer(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    with pytest.raises(ConfigError, match="fp16"):
        _trainer(nn.Linear(3, 2), precision="fp16")
    with pytest.raises(ConfigError, match="trainer_step_fn"):
        _trainer(nn.Linear(3, 2), trainer_step_fn=lambda ctx, batch: None)
    with pytest.raises(ConfigError, match="DDP"):
        Trainer(nn.Linear(3, 2), torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1), nn.CrossEntropyLoss(),
                distributed="ddp")


def test_the_batchnorm_refusal_says_syncbatchnorm_is_for_gpus_and_what_to_do_on_cpu() -> None:
    """A fresh user on CPU followed the advice to convert to SyncBatchNorm and got torch's
    'SyncBatchNorm layers only work with GPU modules' at the first batch."""
    with pytest.raises(ConfigError) as err:
        _trainer(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    msg = str(err.value)
    for what in ("on GPUs (nccl) convert them with torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)",
                 "on CPU (gloo) SyncBatchNorm does not run: remove them", "GroupNorm", "LayerNorm"):
        assert what in msg, (what, msg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="SyncBatchNorm runs on CUDA")
def test_syncbatchnorm_without_cuda_is_refused_at_construction_not_at_the_first_batch() -> None:
    net = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    with pytest.raises(ConfigError, match=r"refuses SyncBatchNorm layers \(1\): they only run on CUDA") as err:
        _trainer(net)
    assert "remove them, or replace them" in str(err.value)


def test_an_undeclared_callback_is_refused_and_roles_pick_the_ranks() -> None:
    class Plain(Callback):
        pass

    with pytest.raises(ConfigError, match="declares nothing"):
        check_declared([EarlyStopping(patience=1), Plain()])
    built: list[int] = []

    def factory() -> Callback:
        built.append(1)
        return LambdaCallback(name="w", distributed="writer")

    every = LambdaCallback(name="a", distributed="all")
    writes = LambdaCallback(name="b", distributed="writer")
    assert for_rank([writer_only(factory), every, writes], is_writer=False) == [every] and built == []
    mine = for_rank([writer_only(factory), every, writes], is_writer=True)
    assert [c.name for c in mine] == ["w", "a", "b"] and built == [1]


def test_a_refusal_travels_as_its_class_and_message() -> None:
    with pytest.raises(ResumeError, match=r"corrupt LAST \(decided by the writer rank\)"):
        raise_described(describe_error(ResumeError("corrupt LAST")))
    with pytest.raises(CheckpointWriteError):
        agree_outcome(World(), CheckpointWriteError("disk full"))
    agree_outcome(World(), None)


def test_the_follower_keeps_blobs_in_memory_and_no_event() -> None:
    store = FollowerBlobStore(__import__("pathlib").Path("/nonexistent/blobs"))
    digest = store.put(b"abc")
    assert store.get(digest) == b"abc" and store.exists(digest)
    store.delete([digest])
    with pytest.raises(CorruptCheckpointError, match="writer rank"):
        store.get(digest)
    log = FollowerLog(7)
    assert log.append(EpochBegan(epoch=0)) == 7
    log.flush(sync=True)
    assert log.durable_seq == 8 and list(log.read()) == [] and log.syncs == 1



def test_the_declarations_the_ranks_compare_leave_out_what_differs_by_process_not_by_recipe() -> None:
    """nnx_es.distributed.alike: a repr's memory address and a tensor's device differ between ranks running
    the same recipe; a tensor data set is fingerprinted whole (a rank's Subset shard is its own)."""
    import numpy as np
    from torch.utils.data import Subset, TensorDataset

    from nnx_es.distributed.alike import _plain, data_fingerprint

    class Loss:
        pass

    a, b = _plain({"fn": Loss(), "lr": torch.tensor(0.1), "eps": np.float32(2.0)}), _plain(
        {"fn": Loss(), "lr": torch.tensor(0.1), "eps": np.float32(2.0)})
    assert a == b and " at 0x" not in a["fn"] and a["eps"] == 2.0 and a["lr"] == pytest.approx(0.1)
    assert _plain(torch.tensor(0.2)) != _plain(torch.tensor(0.1))
    assert _plain({"device": "cuda:1", "r": "Net(device='cuda:1')"}) == _plain({"device": "cuda:0", "r": "Net(device='cuda:0')"})
    assert _plain("cuda:0") != _plain("cpu")  # the kind of device is a setting; its index is the rank's
    data = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))
    assert data_fingerprint(Subset(data, range(0, 20, 2))) == data_fingerprint(Subset(data, range(1, 20, 2))) \
        == data_fingerprint(data)
    other = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))
    other.tensors[0][19, 1] += 1  # the last row: sampled
    assert data_fingerprint(other) != data_fingerprint(data)
    assert data_fingerprint(TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20) % 3)) != data_fingerprint(data)
    assert data_fingerprint([(1, 2)]) is None  # another data set: its __getitem__ is never called


def test_a_functions_settings_and_where_the_ranks_differ_are_named() -> None:
    import functools

    from nnx_es.distributed.alike import _focus, describe_callable

    scale = 2.0

    def step(net, batch):  # noqa: ANN001, ANN202
        return net(batch[0] * scale), batch[1], None

    d = describe_callable(step)
    assert "captured" not in d and d["function"].endswith("step")  # a closure may hold a clock of its own
    assert describe_callable(lambda x, s=2.0: x * s)["defaults"] == [2.0]  # a default is a setting

    class Mine(nn.Module):  # a class of the user's: its attributes may be a process's own
        def __init__(self) -> None:
            super().__init__()
            import os
            import time

            self.started_at, self.pid, self.p = time.time(), os.getpid(), 0.5

    assert describe_callable(Mine()) == {"class": f"{Mine.__module__}.{Mine.__qualname__}"}
    p = describe_callable(functools.partial(torch.nn.functional.cross_entropy, label_smoothing=0.3))
    assert p["keywords"] == {"label_smoothing": 0.3} and p["partial"]["function"] == "torch.nn.functional.cross_entropy"
    assert describe_callable(nn.Dropout(0.25))["p"] == 0.25 and describe_callable(None) is None
    assert "training" not in describe_callable(nn.Dropout(0.25))  # the loop sets the mode itself
    where, values = _focus([{"a": [1, {"p": 0.0}]}, {"a": [1, {"p": 0.5}]}])
    assert where == "['a'][1]['p']" and values == [0.0, 0.5]
    assert _focus([[1, 2], [1, 2, 3]]) == ("", [[1, 2], [1, 2, 3]])  # of another length: shown whole


def test_a_failure_record_leads_with_the_first_posted_cause_and_keeps_this_ranks_symptom_after_it():
    from nnx_es.distributed.peers import cause_first

    assert cause_first("RuntimeError", "Connection closed by peer", 0, []) == ("RuntimeError", "Connection closed by peer")
    assert cause_first("RuntimeError", "Connection closed by peer", 0,
                       ["rank 1: ValueError: bad: batch 3", "rank 2: KeyError: 'x'"]) == (
        "ValueError", "bad: batch 3 [rank 1 failed first; then rank 2: KeyError: 'x'; then rank 0: RuntimeError: "
                      "Connection closed by peer]")
    assert cause_first("RuntimeError", "timeout", 1, ["rank 0: garbled"])[0] == "RuntimeError"
