"""Model transforms (``nnx_es.transforms``): each is recorded in the checkpoint's topology, rebuilt on a fresh net by
``NNModel.load`` and by a resume, and a run SIGKILLed after a transform resumes bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from crashkit import kill_at_event, run_killed
from nnx_es import NNModel, Trainer
from nnx_es.audit import audit_run
from nnx_es.errors import ConfigError, CorruptCheckpointError, ResumeError
from nnx_es.transforms import LoRA, LoRALinear, Prune, Quantize, ReplaceHead, TransformAt, applications, topology
from nnx_es.transforms.core import pending
from nnx_es.evaluation import weights_fingerprint
from trainkit import kinds, loaders, of_kind, small_net

torch.set_num_threads(1)  # fork-safe parent

EPOCHS = 3

#: case -> (transforms declared before training, callbacks' transforms at an epoch boundary)
CASES = {
    "prune_masked_mid_run": ((), lambda: [TransformAt(1, Prune(amount=0.5))]),
    "prune_permanent": ((lambda: [Prune(["0"], amount=0.5, permanent=True)]), lambda: []),
    "lora": ((lambda: [LoRA(["0", "2"], rank=2, alpha=4.0)]), lambda: []),
    "new_head": ((lambda: [ReplaceHead("2", 5)]), lambda: []),
    "quantized_backbone": ((lambda: [Quantize(["0"])]), lambda: []),
}
#: case -> the event kind and occurrence just before which the run is killed (after its transform)
KILLS = {
    "prune_masked_mid_run": [("history_appended", 1), ("microbatch_done", 3 * 2 + 1)],  # before / after epoch 1's LAST
    "prune_permanent": [("update_committed", 4)],
    "lora": [("update_committed", 4)],
    "new_head": [("microbatch_done", 5)],
    "quantized_backbone": [("update_committed", 5)],
}


def _history(run) -> list:
    return [msgspec.structs.replace(r, wall_time_s=0.0) for r in run.history]


def train(case: str, runs, run_id: str | None, *, net: nn.Module | None = None, **kw):
    declared, at_epochs = CASES[case]
    model = NNModel(net if net is not None else small_net(5))
    run = model.train(*loaders(batch_size=16, n_train=48), epochs=EPOCHS,
                      optimizer=lambda ps: torch.optim.SGD([p for p in ps if p.requires_grad], lr=0.2, momentum=0.9),
                      transforms=declared() if declared else [], callbacks=at_epochs(), runs_root=runs, run_id=run_id,
                      seed=3, progress=False, **kw)
    return model, run


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """case -> its uninterrupted run, trained on first use (one per case for the whole module)."""
    made: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in made:
            runs = tmp_path_factory.mktemp("ref")
            model, run = train(case, runs, "ref")
            made[case] = {"case": case, "run": run, "model": model, "weights": weights_fingerprint(model.net),
                          "kinds": kinds(run.run_dir)}
        return made[case]
    return get


@pytest.fixture(params=sorted(CASES))
def reference(request, references):
    return references(request.param)


def test_each_transform_is_an_event_in_the_checkpoint_topology_and_the_run_audits_clean(reference):
    run, model = reference["run"], reference["model"]
    events = of_kind(run.run_dir, "model_transformed")
    done = applications(model.net)
    assert done and [e.transform for e in events] == [a.transform for a in done]
    assert all(e.before.sha256 != e.after.sha256 or e.transform["target"].endswith("Prune") for e in events)
    assert events[-1].after == topology(model.net)
    assert audit_run(run.run_dir).ok
    if reference["case"] == "prune_masked_mid_run":  # applied by the callback at epoch 1's end, before its history
        k = reference["kinds"]
        at = k.index("model_transformed")
        assert events[0].epoch == 1 and events[0].origin == "callback"
        assert k[at - 1] in ("epoch_summarized", "monitor_decided", "scheduler_stepped")
        assert k[at + 1] == "history_appended" and k.count("model_transformed") == 1
        pruned = model.net[0].weight
        assert (pruned == 0).float().mean().item() == pytest.approx(0.5, abs=0.05)


def test_load_rebuilds_the_transforms_on_a_fresh_net_and_predicts_as_in_training(reference):
    fresh = NNModel(small_net(11))  # other initial weights: everything must come from the checkpoint
    fresh.load(reference["run"].run_dir, "last", weights="raw")
    assert [a.transform for a in applications(fresh.net)] == [a.transform for a in applications(reference["model"].net)]
    assert all(a.origin == "checkpoint" for a in applications(fresh.net))
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fresh.outputs(x), reference["model"].outputs(x))
    if reference["case"] == "lora":
        assert isinstance(fresh.net[0], LoRALinear) and not fresh.net[0].base.weight.requires_grad


@pytest.mark.parametrize("case,kill", [(c, i) for c in sorted(KILLS) for i in range(len(KILLS[c]))])
def test_a_run_killed_after_a_transform_resumes_bitwise_equal_to_the_uninterrupted_run(references, case, kill, tmp_path):
    reference = references(case)
    kind, occurrence = KILLS[case][kill]
    at = [i for i, k in enumerate(reference["kinds"]) if k == kind][occurrence]
    assert at > reference["kinds"].index("model_transformed")
    runs = tmp_path / "runs"
    assert run_killed(lambda: train(case, runs, "r"), kill_at_event(at)) == "killed"
    model, run = train(case, runs, None, resume_from=runs / "r")
    assert run.status == "completed" and "run_resumed" in kinds(run.run_dir)
    assert _history(run) == _history(reference["run"])
    # keys, dtypes, shapes and bytes of every value of the state (a quantized layer's int8 weights and scale too)
    assert weights_fingerprint(model.net) == reference["weights"]
    assert audit_run(run.run_dir).ok


def test_a_resume_that_does_not_declare_the_runs_transforms_is_refused_naming_them(tmp_path):
    runs = tmp_path / "runs"
    train("lora", runs, "r")
    model = NNModel(small_net(5))  # no LoRA declared: its optimizer could not hold the adapters
    with pytest.raises(ResumeError, match="LoRA.*declare it"):
        model.train(*loaders(batch_size=16, n_train=48), epochs=EPOCHS + 1, runs_root=runs, seed=3, progress=False,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9), resume_from=runs / "r")


def test_a_recorded_transform_that_cannot_be_reapplied_is_refused_naming_it():
    hostile = {"transforms": [{"epoch": -1, "transform": {"@type": "recipe", "target": "os:system", "kwargs": {}}}]}
    with pytest.raises(CorruptCheckpointError, match="system"):
        pending(small_net(), hostile, where="the checkpoint", training=False)
    absent = {"transforms": [{"epoch": 2, "transform": {"@type": "recipe", "target": "nnx_es.transforms.kinds:LoRA",
                                                        "kwargs": {"targets": ["encoder.*"], "rank": 2}}}]}
    (todo,) = pending(small_net(), absent, where="the checkpoint", training=False)
    with pytest.raises(ConfigError, match=r"LoRA: targets \['encoder\.\*'\] match no submodule"):
        todo[0].apply(small_net())
    with pytest.raises(ConfigError, match="changes the net's parameters.*declare it"):
        pending(small_net(), absent, where="the checkpoint", training=True)


def test_transforms_that_would_train_silently_wrong_are_refused_before_training(tmp_path):
    net = small_net()
    stale = torch.optim.SGD(net.parameters(), lr=0.1)  # built before the adapters exist
    with pytest.raises(ConfigError, match="no optimizer holds.*lora_a"):
        Trainer(net, stale, nn.CrossEntropyLoss(), transforms=[LoRA(["0"], freeze="targets")], runs_root=tmp_path)
    with pytest.raises(ConfigError, match="TransformAt: LoRA.*changes the net's parameters"):
        TransformAt(1, LoRA(["0"]))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model = NNModel(net)  # the first layer trains and feeds a quantized one: no gradient would reach it
    with pytest.raises(ConfigError, match="no gradient flows through int8 quantization"):
        model.train(*loaders(), epochs=1, transforms=[Quantize(["2"])], runs_root=tmp_path, progress=False)


def test_a_transform_at_a_later_epoch_that_would_refuse_the_net_is_refused_before_any_update(tmp_path):
    model = NNModel(small_net(5))
    with pytest.raises(ConfigError, match=r"Prune: targets \['encoder\.\*'\] match no submodule"):
        model.train(*loaders(batch_size=16, n_train=48), epochs=EPOCHS, runs_root=tmp_path, run_id="r", seed=3,
                    progress=False, callbacks=[TransformAt(2, Prune(["encoder.*"], amount=0.5))],
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2))
    recorded = kinds(tmp_path / "r")
    assert "run_failed" in recorded and not {"train_began", "microbatch_done", "update_committed"} & set(recorded)
    assert applications(model.net) == []  # nothing was applied to the net either
    net = small_net(5)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    Prune(amount=0.5).check(net)  # a transform that fits: check changes nothing
    LoRA(["0"], rank=2).check(net)  # (the default check applies to a copy)
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items()) and applications(net) == []


def test_a_spec_run_with_transforms_records_them_and_resumes_from_its_own_spec(tmp_path, monkeypatch, capsys):
    from nnx_es.cli.main import main
    from nnx_es import load_result
    from nnx_es.recipes import to_spec
    from nnx_es.recipes.runspec import build_run, scaffold, spec_hash

    spec = msgspec.structs.replace(scaffold(epochs=1, batch_size=128), transforms=[to_spec(LoRA(["layers.0"], rank=2))])
    (tmp_path / "spec.json").write_bytes(msgspec.json.encode(spec))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "spec.json", "--run-id", "r"]) == 0
    run_dir = tmp_path / "runs" / "r"
    started = of_kind(run_dir, "run_started")[0]
    assert started.spec["transforms"] == [msgspec.to_builtins(to_spec(LoRA(["layers.0"], rank=2)))]
    assert started.spec_hash == spec_hash(started.spec)
    assert main(["resume", "runs/r", "--epochs", "2"]) == 0, capsys.readouterr().err  # was refused: no LoRA declared
    result = load_result(run_dir)
    assert len(result.history) == 2 and result.status == "completed"
    assert audit_run(run_dir).ok
    plain = build_run(scaffold(epochs=1, batch_size=128), runs_root=tmp_path / "other").trainer.spec
    assert "transforms" not in plain and "model" in plain  # a run without transforms records its spec as before
