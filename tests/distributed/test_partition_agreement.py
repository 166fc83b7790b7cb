"""Under DDP the ranks' train partitions must be one partition: refused before training otherwise.

Found in review (issue 13): a loader seeded per rank (``seed=rank``), or one built for another
rank or another world size, gives every rank the same number of steps -- so the length check
passed -- and the run completed on overlapping, incomplete partitions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import results, torchrun

SCRIPT = Path(__file__).resolve().parent / "scenarios.py"


@pytest.fixture(scope="module")
def mismatch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mismatch")
    proc = torchrun(SCRIPT, str(out), "partition_mismatch,validation_mismatch,evaluate_record,plain_loader,evaluate_whole,"
                   "evaluate_mixed_weights,not_alike", timeout_s=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return out


def test_train_partitions_the_ranks_do_not_share_are_refused_on_every_rank_before_training(
        mismatch_run: Path) -> None:
    r0, r1 = results(mismatch_run, "partition_mismatch")
    assert r0["ok"] and r1["ok"], (r0, r1)
    for name, named in (("seed_per_rank", "'seed': 0"), ("rank_zero_everywhere", "rank 0"),
                        ("one_process_loader", "world_size=1")):
        for r in (r0, r1):
            assert r[name] is not None, f"{name} trained"
            assert r[name][0] == "ConfigError" and "ValueError" in r[name], r[name]
            assert "train_loader" in r[name][1] and named in r[name][1], r[name][1]
        assert r0[name][1] == r1[name][1]  # the same refusal on every rank
    assert r0["wrote"] == r1["wrote"] == []  # refused before a run directory was made


def test_validation_loaders_that_would_score_a_row_twice_or_never_are_refused_on_every_rank(
        mismatch_run: Path) -> None:
    """Found in review: a padded validation partition (a train_loader, a DistributedSampler on 7 rows
    and 2 ranks) completed with the repeated row counted twice in the agreed metrics."""
    r0, r1 = results(mismatch_run, "validation_mismatch")
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r0["fine"] == r1["fine"] == "completed"
    assert r0["own_partition"] == r1["own_partition"] == "completed"  # DDP(own_partition=True): its own shards
    for name, named in (("train_loader_as_val", "training partition"), ("distributed_sampler", "scores 1 twice"),
                        ("shard_for_rank_zero", "built for rank 0"),
                        ("plain", "rank 0's validation loader (a DataLoader with a SequentialSampler over 7 rows) "
                                  "deals no shard of the rows: every rank would score every row"),
                        ("mixed", "rank 1's validation loader (a DataLoader with a SequentialSampler over 7 rows)")):
        assert r0[name] == r1[name], name  # the same refusal on every rank
        assert r0[name][0] == "ConfigError" and "validation_loader(dataset, batch_size)" in r0[name][1], r0[name]
        assert named in r0[name][1], r0[name][1]


def test_a_recorded_evaluation_in_a_group_is_refused_saying_why_and_what_to_do(mismatch_run: Path) -> None:
    """Found in review: after a DDP train, evaluate(record=True) on every rank recorded one
    evaluation_recorded per rank. A fresh user then read the refusal ("each rank would score only the
    rows its loader gives it") against the README ("returns the whole set's metrics"): the metrics are
    agreed; the refusal is about who writes the run."""
    r0, r1 = results(mismatch_run, "evaluate_record")
    assert r0["ok"] and r1["ok"], (r0, r1)
    for r in (r0, r1):
        assert r["plain"] == ["accuracy", "loss"]  # an unrecorded evaluation still runs
        assert r["recorded"][0] == "ConfigError" and "inside a group of 2 ranks" in r["recorded"][1], r["recorded"]
        # why, in the README's terms (the metrics ARE the whole set's in a group), and what to do
        for what in ("the metrics are the whole set's on every rank", "only the writer rank may write it",
                     "without record=True here", "record from one process", "nothing was scored or recorded"):
            assert what in r["recorded"][1], (what, r["recorded"][1])
        assert "each rank would score only" not in r["recorded"][1]
    assert r0["evaluations"] == r1["evaluations"] == 0


def test_a_train_loader_that_deals_no_partition_is_refused_on_every_rank_unless_declared(mismatch_run: Path) -> None:
    """Found in review (issue 13): a plain DataLoader under DDP trained every rank on the same rows,
    silently (duplicated work, a global batch of world_size copies)."""
    r0, r1 = results(mismatch_run, "plain_loader")
    assert r0["ok"] and r1["ok"], (r0, r1)
    for name, named in (("plain", "a DataLoader with a SequentialSampler over 24 rows"),
                        ("shuffled", "a DataLoader with a RandomSampler over 24 rows"), ("list_of_batches", "a list")):
        assert r0[name] == r1[name], name  # the same refusal on every rank
        assert r0[name][0] == "ConfigError" and named in r0[name][1], r0[name]
        for what in ("same rows", "nnx_es.distributed.train_loader(dataset, batch_size", "DistributedSampler",
                     "DDP(own_partition=True)", "nothing was trained"):
            assert what in r0[name][1], (what, r0[name][1])
    assert r0["distributed_sampler"] == r1["distributed_sampler"] == "completed"
    assert r0["own_partition"] == r1["own_partition"] == "completed"  # declared: the rows are the user's
    assert r0["wrote"] == r1["wrote"] == ["distributed_sampler", "own_partition"]  # refused before a run directory


def test_evaluate_under_ddp_returns_the_whole_sets_metrics_on_every_rank(mismatch_run: Path) -> None:
    """Found in review (issue 13): NNModel.evaluate(loader) without record=True returned each rank's
    shard's metrics; now the ranks' sums are agreed once and every rank returns the whole set's."""
    r0, r1 = results(mismatch_run, "evaluate_whole")
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r0["gathered"] == r1["gathered"]  # bitwise the same on every rank
    assert r0["whole"] == r1["whole"]
    assert r0["gathered"].keys() == {"loss", "accuracy"}
    for k, v in r0["whole"].items():
        assert r0["gathered"][k] == pytest.approx(v, rel=1e-6)  # float32 sums in other batches
    assert r0["shard"]["loss"] != pytest.approx(r0["whole"]["loss"], rel=1e-3)  # the shard alone is another answer
    for name, named in (("padded", "scores 1 twice"), ("training_partition", "training partition")):
        assert r0[name] == r1[name], name  # the same refusal on every rank
        assert r0[name][0] == "ConfigError" and named in r0[name][1] and "validation_loader" in r0[name][1], r0[name]


def test_a_run_declared_otherwise_on_one_rank_is_refused_on_every_rank_naming_what_differs(mismatch_run: Path) -> None:
    # found by a fresh user: each of these completed, rank 1 training something else than rank 0
    r0, r1 = results(mismatch_run, "not_alike")
    assert r0["ok"] and r1["ok"], (r0, r1)
    for name, field, shown in (("loss", "objective['loss']", "label_smoothing=0.5"),
                               ("lr", "optimizer hyperparameters['sgd'][0]['lr']", "rank 1: 0.4"),
                               ("accumulation", "accumulation", "rank 1: 2"), ("epochs", "epochs", "rank 1: 2"),
                               ("data", "train data", "rank 1: "), ("callback", "callbacks", '"name":"extra"'),
                               # a second fresh user's: each completed (or diverged an epoch later) before
                               ("partial_loss", "loss functions['loss']['keywords']['label_smoothing']", "rank 1: 0.3"),
                               ("train_step_fn", "step functions['train_step_fn']['defaults'][0]", "rank 1: 2.0"),
                               ("dropout", "modules['1']['p']", "(rank 0: 0.0; rank 1: 0.5)"),
                               ("ema", "update hooks[0]['decay']", "rank 1: 0.5"),
                               ("patience", "callbacks[0]['patience']", "rank 1: 1"),
                               ("gamma", "scheduler settings['steplr']['gamma']", "rank 1: 0.5")):
        for r in (r0, r1):
            assert r[name] != "completed", f"{name} trained"
            assert r[name][0] == "ConfigError", r[name]
            message = r[name][1]
            assert message.startswith("the ranks do not declare the same run: ") and f" {field}" in message, message
            assert shown in message and "nothing was trained or written" in message, message
        assert r0[name][1] == r1[name][1]  # the same refusal on every rank
    assert r0["writer_callback"] == r1["writer_callback"] == "completed"  # the writer's own: no difference
    assert r0["own_partition"] == r1["own_partition"] == "completed"  # each rank's own rows: no difference
    assert r0["recipe"] == r1["recipe"] == "completed"  # metadata (a per-host path): logged, not refused
    # a module's start time and process id, a loss's captured clock: the process's own, not the recipe's
    assert r0["process_specific"] == r1["process_specific"] == "completed"
    assert [n for n in r0["wrote"] if not n.startswith(".")] == ["own_partition", "process_specific", "recipe",
                                                                 "writer_callback"]


def test_evaluate_in_a_group_refuses_weights_that_differ_between_ranks_on_every_rank(mismatch_run: Path) -> None:
    """A fresh user's eval_mixed.py: the writer loaded BEST, rank 1 did not, and NNModel.evaluate
    silently returned the metrics of two models mixed, on every rank. The ranks now agree a digest
    of their weights first; equal weights still return the same metrics on every rank."""
    r0, r1 = results(mismatch_run, "evaluate_mixed_weights")
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r0["equal"] == r1["equal"] and r0["equal"].keys() == {"loss", "accuracy"}
    assert r0["mixed"] == r1["mixed"]  # the same refusal on every rank
    name, msg = r0["mixed"][0], r0["mixed"][1]
    assert name == "DivergenceError" and "RuntimeError" in r0["mixed"], r0["mixed"]
    for what in ("rank(s) [1] hold weights that differ from the writer rank 0's", "mix different models",
                 "load the same weights on every rank", "model.load(run_dir, 'best') on every rank",
                 "nothing was scored"):
        assert what in msg, (what, msg)
    assert r0["reloaded"] == r1["reloaded"] == r0["equal"]  # the same weights again: the same metrics
