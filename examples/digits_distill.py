"""Distillation on scikit-learn's digits: a teacher trained first, a smaller student distilled from it.

    python examples/digits_distill.py [--epochs 30] [--runs runs] [--seed 0]

* teacher: the main job's 64-128-10 MLP, trained with BEST on validation loss (run ``<id>-teacher``);
* student: a 64-16-10 MLP trained on a keyed objective -- 0.7 x the temperature-softened KL to the
  teacher's logits (Hinton et al. 2015, times T^2) + 0.3 x cross-entropy on the labels. The teacher is
  loaded from its run's BEST, frozen (no optimizer: eval mode, no gradients), declared once by the
  hash of its weights and verified on a resume; its logits reach the loss through a
  ``loss_target_assembler`` (run ``<id>-student``);
* prints both BEST's test accuracy, then audits both runs (``nnx_es.audit.audit_run``, what
  ``tools/replay`` runs) and exits 1 unless both are clean.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from digits import digits_splits, make_net  # noqa: E402

from nnx_es import NNModel, Objective, Trainer  # noqa: E402
from nnx_es.audit import audit_run  # noqa: E402
from nnx_es.models import Keyed  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
T = 4.0  # the softening temperature


def soft_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-row KL(teacher || student) of the T-softened distributions, times T^2: ``(B, 10) x2 -> (B,)``."""
    log_p = torch.log_softmax(student / T, dim=1)
    log_q = torch.log_softmax(teacher / T, dim=1)
    return (log_q.exp() * (log_q - log_p)).sum(dim=1) * T * T


def training_fn(models, batch):
    """Both models on the same inputs; the teacher without gradients."""
    x = batch[0]
    with torch.no_grad():
        teacher = models["teacher"](x)
    return {"student": models["student"](x), "teacher": teacher}


def teacher_targets(loss, predictions, batch, *, workflow=None, target_keys=None):
    """The targets: the teacher's logits (from the predictions) and the labels (from the batch)."""
    return {"teacher": predictions["teacher"], "y": batch[1]}


def make_student() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def student_trainer(teacher: nn.Module, *, runs: Path, run_id: str, seed: int) -> Trainer:
    torch.manual_seed(seed)
    student = make_student()
    objective = Objective({"kd": Keyed(soft_kl, prediction="student", target="teacher", weight=0.7),
                           "ce": Keyed(nn.CrossEntropyLoss(), prediction="student", target="y", weight=0.3)})
    return Trainer({"student": student, "teacher": teacher},
                   {"student": torch.optim.Adam(student.parameters(), lr=3e-3)}, objective,
                   training_fn=training_fn, loss_target_assembler=teacher_targets, monitor="val_ce",
                   runs_root=runs, run_id=run_id, seed=seed, progress=False)


def test_accuracy(net: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = data
    with torch.no_grad():
        return float((net.eval()(x).argmax(1) == y).float().mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--runs", type=Path, default=REPO / "runs")
    ap.add_argument("--run-id", default=None, help="prefix of both run ids (default: a timestamp)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prefix = args.run_id or time.strftime("%Y%m%d-%H%M%S")
    data = digits_splits(args.seed)

    def loader(part: str, shuffle: bool) -> DataLoader:
        return DataLoader(TensorDataset(*data[part]), batch_size=32, shuffle=shuffle,
                          generator=torch.Generator().manual_seed(args.seed) if shuffle else None)

    torch.manual_seed(args.seed)
    teacher = NNModel(make_net())
    t_run = teacher.train(loader("train", True), loader("val", False), epochs=args.epochs,
                          runs_root=args.runs, run_id=f"{prefix}-teacher", seed=args.seed, progress=False)
    teacher.load(t_run.run_dir, "best")
    print(f"teacher {t_run.run_id}: BEST epoch {t_run.best_epoch}, test accuracy "
          f"{test_accuracy(teacher.net, data['test']):.4f}")

    trainer = student_trainer(teacher.net, runs=args.runs, run_id=f"{prefix}-student", seed=args.seed)
    s_run = trainer.fit(loader("train", True), loader("val", False), epochs=args.epochs)
    student = NNModel(make_student())
    student.load(s_run.run_dir, "best", model="student")  # the student's keys of the run's model component
    print(f"student {s_run.run_id}: BEST epoch {s_run.best_epoch}, test accuracy "
          f"{test_accuracy(student.net, data['test']):.4f} "
          f"({sum(p.numel() for p in student.net.parameters())} parameters against the teacher's "
          f"{sum(p.numel() for p in teacher.net.parameters())})")
    ok = True
    for run in (t_run, s_run):
        report = audit_run(run.run_dir)
        print(f"audit {run.run_id}: {'clean' if report.ok else 'VIOLATIONS'}")
        for v in report.violations:
            print(f"  {v}")
        ok = ok and report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
