"""The trainer under a 2-rank torchrun: one exact update per window, agreed decisions, one writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ddpkit
from launch import results, torchrun

from events.schema import DigestCadence

SCRIPT = Path(__file__).resolve().parent / "scenarios.py"
CASES = ["equivalence", "ignored_targets", "masked_window", "nonfinite_window", "refusals", "decisions", "local_stop", "writer_only",
         "commit_fault", "resume_other_world", "resume_auto", "sha_refusal", "callback_roles",
         "divergence", "digest_every", "digest_beyond_run", "resume_killed", "fused_hook", "rank_streams",
         "staging_ways"]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A launch in which rank 1 dies mid-epoch 1 (exit 0, so torchrun does not stop rank 0 itself)."""
    from nnx_es.result import load_result

    out = tmp_path_factory.mktemp("killed")
    torchrun(SCRIPT, str(out), "killed", timeout_s=90)
    before = load_result(out / "runs" / "killed")  # before ddp_run resumes it
    (out / "before.txt").write_text(f"{before.status} {[h.epoch for h in before.history]}")
    return out


@pytest.fixture(scope="module")
def peer_error_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A launch in which rank 1's callback raises mid-epoch 1 and rank 1 leaves; rank 0 fails on the group."""
    out = tmp_path_factory.mktemp("peer_error")
    torchrun(SCRIPT, str(out), "peer_error", timeout_s=90)
    return out


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory, reference, killed_run: Path) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    proc = torchrun(SCRIPT, str(out), ",".join(CASES), timeout_s=180,
                    env={"NNX_TEST_REF": str(reference[1]), "NNX_TEST_KILLED": str(killed_run / "runs" / "killed")})
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out


def _ok(out: Path, case: str) -> list[dict]:
    rs = results(out, case)
    for r in rs:
        assert r.get("ok"), r.get("traceback") or r
    return rs


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """One process trained on the union of the ranks' batches (same windows, same schedulers)."""
    root = tmp_path_factory.mktemp("ref")
    model = ddpkit.net()
    t = ddpkit.trainer(model, runs_root=root, run_id="ref")
    t.fit(ddpkit.UnionLoader(ddpkit.dataset()), epochs=2)
    return model, root / "ref"


def test_two_ranks_commit_the_parameters_of_one_process_on_the_union_of_their_batches(ddp_run: Path,
                                                                                       reference) -> None:
    r0, r1 = _ok(ddp_run, "equivalence")
    assert r0["digest"] == r1["digest"]  # identical parameters on every rank, bitwise
    model, _ = reference
    ref = ddpkit.params(model)
    assert r0["keys"] == sorted(ref)  # the canonical keys: no "module." prefix
    for k, v in ref.items():
        assert torch.allclose(torch.tensor(r0["params"][k]), torch.tensor(v), rtol=1e-5, atol=1e-6), k
    assert r0["status"] == r1["status"] == "completed"
    assert r0["wrapped"] == "Sequential"  # DDP wraps per fit; the net is never replaced


def test_ignored_targets_are_left_out_of_the_unions_mean_on_every_rank(ddp_run: Path) -> None:
    """torch's mean CE over the union's kept targets, each update: rank r holds rows r, r+2, ... (2 a batch)."""
    r0, r1 = _ok(ddp_run, "ignored_targets")
    assert r0["digest"] == r1["digest"]
    x, y = ddpkit.ignored_data()
    ref = ddpkit.net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i in range(0, len(x), 4):  # the union of the ranks' batch i: rows 4i .. 4i+3
        opt.zero_grad()
        torch.nn.CrossEntropyLoss()(ref(x[i:i + 4]), y[i:i + 4]).backward()
        opt.step()
    for k, v in ddpkit.params(ref).items():
        assert torch.allclose(torch.tensor(r0["params"][k]), torch.tensor(v), rtol=1e-5, atol=1e-6), k
    assert r0["steps"] == 4


def test_learning_rates_and_receipts_do_not_depend_on_world_size(ddp_run: Path, reference) -> None:
    _ok(ddp_run, "equivalence")
    _, ref_dir = reference
    ref = ddpkit.receipts(ref_dir)
    got = ddpkit.receipts(ddp_run / "runs" / "equiv")
    assert [r["kind"] for r in got] == [r["kind"] for r in ref]
    assert [r["lrs"] for r in got] == [r["lrs"] for r in ref]  # both clocks, after every committed update
    assert [r["global"] for r in got] == [r["global"] for r in ref]  # W: the union's valid weight
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-6)
    assert any(g["local"] != g["global"] for g in got)
    # the window's agreement: float32 parts in the gradients' own all-reduce (66 float32 parameters: 264
    # bytes, + 2 x 13 parts), never a second collective; the trailing no_sync window: one float64 agreement
    assert {g["bytes"] for g in got} == {264 + 104, 264 + 24}


def test_a_window_without_valid_rows_on_any_rank_is_skipped_on_every_rank(ddp_run: Path) -> None:
    r0, r1 = _ok(ddp_run, "masked_window")
    assert r0["digest"] == r1["digest"]
    got = ddpkit.receipts(ddp_run / "runs" / "masked")
    assert [(r["kind"], r["reason"]) for r in got][:2] == [("update_skipped", "masked"), ("update_committed", None)]
    assert got[1]["local"] == 0.0 and got[1]["global"] == 2.0  # rank 0 had no valid row: W is the union's
    assert r0["steps"] == r1["steps"] == 2


def test_a_nonfinite_loss_on_one_rank_skips_the_update_on_every_rank(ddp_run: Path) -> None:
    r0, r1 = _ok(ddp_run, "nonfinite_window")
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]
    got = ddpkit.receipts(ddp_run / "runs" / "nonfinite")
    assert [(r["kind"], r["reason"]) for r in got] == [("update_committed", None), ("update_skipped", "nonfinite"),
                                                       ("update_committed", None)]
    # the NaN loss makes its parts non-finite on both ranks: that window alone sums [numerator, W] in float64 too
    assert [r["bytes"] for r in got] == [264 + 104, 264 + 104 + 16, 264 + 104]
    assert r0["steps"] == r1["steps"] == 2


def test_batchnorm_and_a_single_process_fit_in_a_group_are_refused_on_every_rank(ddp_run: Path) -> None:
    for r in _ok(ddp_run, "refusals"):
        assert r["batchnorm"][0] == "ConfigError" and "SyncBatchNorm" in r["batchnorm"][1]
        assert r["single"][0] == "ConfigError" and "distributed=nnx_es.distributed.DDP()" in r["single"][1]
        assert r["wrote"] is False


def test_records_monitor_plateau_and_best_agree_on_every_rank_and_with_the_union(ddp_run: Path) -> None:
    r0, r1 = _ok(ddp_run, "decisions")
    assert r0["seen"] == r1["seen"]  # each rank's own validation, decision and lr, epoch by epoch
    assert r0["digest"] == r1["digest"]
    assert [s["val"] for s in r0["seen"]] == [h["val"] for h in r0["history"]]
    # the agreed validation is the union's: every one of the 7 rows scored once (4 on rank 0, 3 on rank 1)
    assert (r0["shard_rows"], r1["shard_rows"]) == (4, 3)
    for r in (r0, r1):
        whole, shards = r["whole"], r["shards"]
        assert shards[1] == whole[1] == 7
        assert shards[0].keys() == whole[0].keys() == {"val_loss", "val_accuracy"}
        for k in whole[0]:
            assert shards[0][k] == pytest.approx(whole[0][k], rel=1e-6)  # float32 sums in other batches
    assert any(s["improved"] is False for s in r0["seen"])  # the monitor, plateau and early stopping were exercised
    assert len({tuple(s["lrs"]) for s in r0["seen"]}) > 1
    assert r0["epochs"] >= 2


def test_a_stop_asked_on_one_rank_from_a_local_quantity_stops_every_rank(ddp_run: Path) -> None:
    r0, r1 = _ok(ddp_run, "local_stop")
    assert len(r0["seen"]) == len(r1["seen"]) == 2  # both ranks ended after epoch 1
    assert r0["status"] == r1["status"] == "stopped"
    assert r0["epochs"] == 2


def test_only_the_writer_touches_the_run_directory(ddp_run: Path) -> None:
    r0, r1 = _ok(ddp_run, "writer_only")
    assert r0["own_root_exists"] is True and r1["own_root_exists"] is False
    assert not (ddp_run / "roots-rank1").exists()
    run = ddp_run / "roots-rank0" / "wo"
    assert (run / "events.lmdb").is_dir() and (run / "views").is_dir()
    assert r0["run_dir"] == r1["run_dir"] == str(run)  # every rank returns the writer's run
    assert r0["last"] == r1["last"] and r0["digest"] == r1["digest"]
    from nnx_es.result import load_result

    assert load_result(run).status == "completed"


def test_a_write_fault_on_the_writer_stops_every_rank_and_loses_nothing_committed(ddp_run: Path) -> None:
    from nnx_es.result import load_result

    r0, r1 = _ok(ddp_run, "commit_fault")
    assert r0["raised"][0] == r1["raised"][0] == "CheckpointWriteError"
    assert "injected" in r0["raised"][1] and "injected" in r1["raised"][1]
    run = load_result(ddp_run / "runs" / "fault")
    assert run.status == "failed"
    assert [h.epoch for h in run.history] == [0] and run.last is not None and run.last.epoch == 0


def test_a_stateful_resume_on_another_world_size_is_refused_before_anything_is_restored(ddp_run: Path,
                                                                                        reference, tmp_path) -> None:
    r0, r1 = _ok(ddp_run, "resume_other_world")
    for r in (r0, r1):
        assert r["raised"][0] == "ResumeError" and "trained on 1 rank(s) and this run has 2" in r["raised"][1]
    # and the other way: one process resuming the 2-rank run statefully
    from nnx_es.errors import ResumeError

    model = ddpkit.net(5)
    before = ddpkit.digest(model)
    t = ddpkit.trainer(model, runs_root=ddp_run / "runs", run_id="equiv")
    with pytest.raises(ResumeError, match="trained on 2 rank"):
        t.fit(ddpkit.UnionLoader(ddpkit.dataset()), epochs=3, resume="auto")
    assert ddpkit.digest(model) == before
    # weights_only starts fresh from its weights
    t = ddpkit.trainer(model, runs_root=tmp_path, run_id="fresh")
    assert t.fit(ddpkit.UnionLoader(ddpkit.dataset()), epochs=1, resume_from=ddp_run / "runs" / "equiv",
                 resume_mode="weights_only").status == "completed"


def test_resume_auto_under_ddp_continues_bitwise(ddp_run: Path) -> None:
    r0, r1 = _ok(ddp_run, "resume_auto")
    whole = _ok(ddp_run, "equivalence")[0]
    assert r0["digest"] == r1["digest"] == whole["digest"]
    assert r0["history"] == 2 and r0["status"] == "completed"


def test_a_corrupt_resume_point_is_refused_on_every_rank_with_the_same_reason(ddp_run: Path) -> None:
    r0, r1 = _ok(ddp_run, "sha_refusal")
    assert r0["raised"] and r1["raised"]
    assert r0["raised"][0] == r1["raised"][0]
    assert r1["raised"][1].startswith(r0["raised"][1]) and "writer rank" in r1["raised"][1]
    assert "NnxError" in r0["raised"]


def test_callbacks_run_where_they_declare_and_an_undeclared_one_is_refused_on_every_rank(ddp_run: Path) -> None:
    r0, r1 = _ok(ddp_run, "callback_roles")
    for r in (r0, r1):
        for key in ("undeclared", "lambda"):
            assert r[key][0] == "ConfigError" and "declares nothing" in r[key][1] and "writer_only" in r[key][1]
        assert r["undeclared_written"] is False
    assert r0["built"] == [0] and r1["built"] == []  # the factory runs on the writer alone
    assert r0["ran"] == ["logger", "writes", "every"] and r1["ran"] == ["every"]


def test_the_parameter_digest_catches_a_planted_divergence_on_every_rank(ddp_run: Path) -> None:
    from nnx_es.audit import audit_run
    from nnx_es.result import load_result
    from trainkit import of_kind

    r0, r1 = _ok(ddp_run, "divergence")
    for r in (r0, r1):
        assert r["raised"][0] == "DivergenceError"
        assert "rank(s) [1]" in r["raised"][1] and "after 4 committed updates (epoch 1)" in r["raised"][1]
        assert "first differed after step 2" in r["raised"][1]
    run_dir = ddp_run / "runs" / "diverged"
    digests = of_kind(run_dir, "params_digested")
    assert [(d.step, d.diverged, d.since_step) for d in digests] == [(2, False, 0), (4, True, 2)]
    assert digests[1].digests[0] != digests[1].digests[1] and len(set(digests[0].digests)) == 1
    assert load_result(run_dir).status == "failed"
    report = audit_run(run_dir)
    assert not report.ok and {v.invariant for v in report.violations} == {11}


def test_digests_every_k_committed_updates_are_compared_at_exactly_those_steps(ddp_run: Path) -> None:
    # the per-update digest call is decided once an epoch (no call per update without digest_every):
    # with digest_every=K it must still come at every K-th committed update, on both ranks alike
    from nnx_es.audit import audit_run
    from trainkit import of_kind

    r0, r1 = _ok(ddp_run, "digest_every")
    assert r0["status"] == r1["status"] == "completed"
    run_dir = ddp_run / "runs" / "digest_every"
    total = max(e.step for e in of_kind(run_dir, "update_committed"))
    digests = of_kind(run_dir, "params_digested")
    assert total == 10 and [(d.step, d.final) for d in digests] == [(3, False), (6, False), (9, False), (10, True)]
    assert all(not d.diverged and len(d.digests) == 2 and len(set(d.digests)) == 1 for d in digests)
    assert of_kind(run_dir, "run_started")[0].digests == DigestCadence(every=3)  # the cadence replay checks
    assert audit_run(run_dir).ok  # (with a digest left out it names the step: tests/unit test_audit_digests)


def test_a_digest_cadence_beyond_the_run_still_compares_the_replicas_at_its_end(ddp_run: Path) -> None:
    from nnx_es.audit import audit_run
    from trainkit import of_kind

    r0, r1 = _ok(ddp_run, "digest_beyond_run")
    assert r0["clean"] == r1["clean"] == "completed"
    clean = of_kind(ddp_run / "runs" / "beyond_clean", "params_digested")
    total = max(e.step for e in of_kind(ddp_run / "runs" / "beyond_clean", "update_committed"))
    assert [(d.step, d.final, d.diverged) for d in clean] == [(total, True, False)]  # one: at the end
    assert audit_run(ddp_run / "runs" / "beyond_clean").ok
    for r in (r0, r1):  # rank 1's drift, never compared before: caught at the end on both ranks
        assert r["nudged"][0] == "DivergenceError" and "rank(s) [1]" in r["nudged"][1], r["nudged"]
    nudged = of_kind(ddp_run / "runs" / "beyond_nudged", "params_digested")
    assert [(d.final, d.diverged) for d in nudged] == [(True, True)]


def test_replay_audits_a_two_rank_run_clean(ddp_run: Path) -> None:
    import subprocess
    import sys

    from launch import REPO

    _ok(ddp_run, "equivalence")
    run_dir = ddp_run / "runs" / "equiv"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "replay"), str(run_dir)], capture_output=True,
                          text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from trainkit import of_kind

    digests = of_kind(run_dir, "params_digested")
    assert [d.step for d in digests] == [2, 4] and all(not d.diverged and len(d.digests) == 2 for d in digests)
    assert of_kind(run_dir, "run_started")[0].digests == DigestCadence(every=None)  # each epoch's end


def test_a_rank_killed_mid_epoch_makes_the_other_fail_within_the_bound_and_the_run_resumes(
        killed_run: Path, ddp_run: Path) -> None:
    r0, r1 = results(killed_run, "killed")
    assert r1 == {"ok": True, "died": True}
    assert r0["raised"] is not None and "RuntimeError" in r0["raised"], r0  # gloo: the peer is gone
    assert r0["elapsed_s"] < 60  # within the group's bound (timeout_seconds=20), never a hang
    assert (killed_run / "before.txt").read_text() == "failed [0]"  # epoch 0 committed, epoch 1 lost
    resumed = _ok(ddp_run, "resume_killed")
    whole = _ok(ddp_run, "equivalence")[0]
    assert resumed[0]["digest"] == resumed[1]["digest"] == whole["digest"]  # as if never interrupted
    assert resumed[0]["status"] == "completed" and resumed[0]["history"] == 2
    from nnx_es.audit import audit_run
    from trainkit import of_kind

    run_dir = killed_run / "runs" / "killed"
    assert [e.digests for e in of_kind(run_dir, "run_resumed")] == [DigestCadence(every=None)]
    assert audit_run(run_dir).ok  # the resumed session's digests: one an epoch from its LAST on


def test_the_fused_agreement_keeps_ddps_gradients_and_sums_the_values_exactly(ddp_run: Path) -> None:
    """The window's [numerator, W] ride in the gradients' bucket without widening it: float32 parts on
    a float32 bucket (issue 13's missed target), appended as they are on a float64 one."""
    for r in _ok(ddp_run, "fused_hook"):
        for way in ("", " host"):  # staged on the device, or from the host (stage_host)
            f32, f64 = r["torch.float32" + way], r["torch.float64" + way]
            for runs in (f32, f64):
                assert all(run["same_grads"] for run in runs)  # bitwise DDP's own hook (divide, then sum)
                assert all(run["sum"] == run["float64"] for run in runs)  # bitwise a float64 all-reduce
            assert [run["fallbacks"] for run in f32] == [0, 1, 2]  # only what float32 parts cannot carry
            assert [run["fallbacks"] for run in f64] == [0, 0, 0]  # a float64 bucket carries the values as they are


def test_the_agreement_staged_from_the_host_or_on_the_device_trains_the_same_run(ddp_run: Path) -> None:
    """On the CPU the window's [numerator, W] are staged from the host (HOST_PARTS_ON_CPU); the device
    way is what an accelerator runs: the same parameters and receipts bitwise, ignored targets counted
    either way, and the weighted fit equal to the equivalence case's."""
    r0, r1 = (r["runs"] for r in _ok(ddp_run, "staging_ways"))
    for run in r0:
        assert r0[run]["digest"] == r1[run]["digest"], run
    ways = ("ways_11", "ways_10", "ways_01", "ways_00")
    assert len({r0[w]["digest"] for w in ways}) == 1
    assert all(r0[w]["receipts"] == r0["ways_11"]["receipts"] for w in ways)
    assert [r["kind"] for r in r0["ways_11"]["receipts"]] == ["update_committed"] * 2  # windows of 2 batches
    assert r0["equiv_1"] == r0["equiv_0"]
    assert r0["equiv_1"]["digest"] == _ok(ddp_run, "equivalence")[0]["digest"]


def test_dropout_draws_each_ranks_own_stream_the_same_for_the_same_seed(ddp_run: Path) -> None:
    """Spec 000 §3: under a group of several ranks rank r seeds its global streams with
    rank_seed(seed, r) (child r of NumPy's SeedSequence(seed)), so its dropout masks are its own;
    the parameters stay identical on every rank (DDP averages the gradients), and the same seed
    gives every rank the same masks again."""
    from nnx_es.rng import rank_seed

    r0, r1 = (r["runs"] for r in _ok(ddp_run, "rank_streams"))
    for run in ("streams_a", "streams_c"):
        assert r0[run]["masks"] != r1[run]["masks"]  # each rank its own masks
        assert r0[run]["digest"] == r1[run]["digest"]  # identical parameters on every rank all the same
    for rank, runs in enumerate((r0, r1)):
        assert runs["streams_a"]["masks"] == runs["streams_b"]["masks"]  # the same seed: the same masks
        assert runs["streams_a"]["digest"] == runs["streams_b"]["digest"]
        assert runs["streams_a"]["masks"] != runs["streams_c"]["masks"]  # another seed: other masks
        assert 0.3 < runs["streams_a"]["kept"] < 0.7  # dropout p = 0.5 did drop
        assert runs["streams_a"]["initial_seed"] == rank_seed(0, rank)  # the documented derivation
        assert runs["streams_c"]["initial_seed"] == rank_seed(1, rank)


def test_the_writers_record_of_a_failure_names_the_rank_that_failed_first(peer_error_run: Path) -> None:
    from nnx_es.result import load_result
    from trainkit import of_kind

    r0, r1 = results(peer_error_run, "peer_error")
    assert r1["raised"][:2] == ["ValueError", "boom on rank 1"]
    assert r0["raised"] is not None and r0["raised"][0] != "ValueError", r0  # rank 0's own: the broken group
    assert "nnx_es: failed on another rank: rank 1: ValueError: boom on rank 1" in r0["notes"]
    run_dir = peer_error_run / "runs" / "peer_error"
    (failed,) = of_kind(run_dir, "run_failed")
    # the record leads with the cause (it ended with it, after gloo's "Connection closed by peer"): its class,
    # its message, the rank; rank 0's own error (the symptom) after it
    assert failed.error_type == "ValueError", failed
    assert failed.message.startswith("boom on rank 1 [rank 1 failed first; then rank 0: RuntimeError: "), failed
    assert load_result(run_dir).status == "failed"


def test_inspect_summary_of_a_ddp_failure_shows_the_first_failing_ranks_error_first(peer_error_run: Path,
                                                                                   capsys) -> None:
    from nnx_es.cli.inspect import main

    main([str(peer_error_run / "runs" / "peer_error"), "summary"])
    (status,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("status")]
    assert status.split(None, 1)[1].startswith("failed (ValueError: boom on rank 1 [rank 1 failed first"), status
