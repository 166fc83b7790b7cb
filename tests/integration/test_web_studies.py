"""The study pages of ``nnx-es serve`` (Starlette's TestClient) over a tiny ``nnx_es.search`` study: each trial's
value is its run's BEST as the run's own log says (:func:`nnx_es.load_result`), each trial links its run, a bad
study name is refused, and nothing under the runs root changes -- no journal lock file, no ``lock.mdb``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("httpx")
pytest.importorskip("optuna")

from nnx_es.result import load_result  # noqa: E402
from nnx_es.search import search  # noqa: E402
from plankit import spec  # noqa: E402
from webkit import app_client, get_json as _get, tree_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
torch.set_num_threads(1)

SPACE = {"optimizers.main.kwargs.lr": {"float": [1e-3, 0.3], "log": True}}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("web_studies") / "runs"
    search(spec(epochs=1), SPACE, 2, runs_root=runs, study_name="tiny", echo=lambda _line: None)
    return runs


@pytest.fixture(scope="module")
def client(root):
    return app_client(root)


def test_the_studies_list_and_a_studys_trials_are_their_runs_best_values(client, root):
    bests = {p.name: load_result(p).best.value for p in root.glob("tiny-t*")}  # the runs' own logs (before: it
    before = tree_state(root)  # opens them with LMDB's lock, as any reader)
    (row,) = _get(client, "/api/studies")["studies"]
    assert (row["name"], row["trials"], row["complete"], row["direction"]) == ("tiny", 2, 2, "minimize")
    doc = _get(client, "/api/studies/tiny")
    trials = doc["trials"]
    assert [t["number"] for t in trials] == [0, 1] and all(t["state"] == "COMPLETE" for t in trials)
    assert sorted(t["run_id"] for t in trials) == sorted(bests)
    for t in trials:
        assert t["value"] == bests[t["run_id"]] == t["run_best"]  # bit for bit, through the JSON
        assert t["run_url"] == f"/runs/{t['run_id']}" and t["run_status"] == "completed"
        assert set(t["params"]) == set(SPACE)
        assert _get(client, t["run_url"].replace("/runs/", "/api/runs/"))["run_id"] == t["run_id"]
    assert row["best"] == min(t["value"] for t in trials) == doc["best"]["value"]
    assert "tiny" in _get(client, "/api/runs")["studies"]
    for page in ("/studies", "/studies/tiny", "/"):
        assert client.get(page).status_code == 200
    assert tree_state(root) == before  # no journal.log.lock, no lock.mdb, no mtime moved
    assert not list(root.glob("studies/tiny/journal.log.lock*"))


def test_a_bad_or_missing_study_name_is_refused(client, root, tmp_path):
    before = tree_state(root)
    assert _get(client, "/api/studies/nope", 404)["error"]["type"] == "NoSuchStudyError"
    for bad in ("a%20b", "..%2F..", "%2E%2E", "x%00"):
        assert client.get(f"/api/studies/{bad}").status_code in (400, 404)
    assert not (root / "studies" / "nope").exists()
    assert tree_state(root) == before
    outside = tmp_path / "elsewhere"
    (outside / "linked").mkdir(parents=True)
    (outside / "linked" / "journal.log").write_bytes((root / "studies" / "tiny" / "journal.log").read_bytes())
    (root / "studies" / "linked").symlink_to(outside / "linked", target_is_directory=True)
    try:
        before = tree_state(root)
        assert client.get("/api/studies/linked").status_code == 403  # a link is refused, never followed
        assert [s["name"] for s in _get(client, "/api/studies")["studies"]] == ["tiny"]
        assert tree_state(root) == before
    finally:
        (root / "studies" / "linked").unlink()
