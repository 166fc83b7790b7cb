"""``nnx-es serve`` in a real headless browser: Debian's chromium driven by Selenium through
``/usr/bin/chromedriver`` (selenium-manager downloads nothing). Each page loads on the runs of
:mod:`webkit` (and a study of ``nnx-es search``), a click reaches an event, the time-travel slider moves,
and the numbers shown equal the projections'. With ``NNX_ES_SCREENSHOTS=1`` (``make screenshots``) each
test also saves a screenshot of its page into ``docs/images/`` for README.md and docs/guides/web.md;
otherwise nothing is written outside the test's temporary directory.

The test set-up installs the browser (``make test``: ``apt-get install chromium chromium-driver`` when
they are missing and the set-up runs as root with apt); elsewhere these tests are skipped, saying why.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver")

from nnx_es.result import load_result  # noqa: E402
from nnx_es.web.app import create_app  # noqa: E402
from nnx_es.web.serve import serve_in_thread  # noqa: E402
from webkit import build_root, tree_state  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    pytest.skip(f"no browser: {CHROMIUM} and {CHROMEDRIVER} (Debian's chromium and chromium-driver) are not "
                "installed; `make test` installs them when run as root with apt", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build_root(tmp_path_factory.mktemp("web"))


#: events one answer of the per-update curves reads here: the run page asks several times (its loop is tested)
CURVE_BUDGET = 64


@pytest.fixture(scope="module")
def server(root):
    url, srv = serve_in_thread(create_app(root, curve_budget=CURVE_BUDGET))
    yield url
    srv.should_exit = True


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A served runs root holding a three-trial ``nnx-es search`` study of the learning rate."""
    pytest.importorskip("optuna")
    from nnx_es.search import search
    from plankit import spec

    runs = tmp_path_factory.mktemp("web_study") / "runs"
    search(spec(epochs=2), {"optimizers.main.kwargs.lr": {"float": [1e-3, 0.3], "log": True}}, 3, runs_root=runs,
           study_name="lr-search", echo=lambda _line: None)
    url, srv = serve_in_thread(create_app(runs))
    yield url, runs
    srv.should_exit = True


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _wait(browser, css, timeout=20):
    return WebDriverWait(browser, timeout).until(EC.presence_of_element_located((By.CSS_SELECTOR, css)))


def _shot(browser, name):
    """With ``NNX_ES_SCREENSHOTS=1``: a screenshot of the whole page (as tall as its content) into
    docs/images/web-<name>.png."""
    if os.environ.get("NNX_ES_SCREENSHOTS") != "1":
        return
    IMAGES.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return Math.min(2400, document.documentElement.scrollHeight)")
    browser.set_window_size(1280, max(700, height))
    time.sleep(0.2)
    browser.save_screenshot(str(IMAGES / f"web-{name}.png"))
    browser.set_window_size(1280, 900)


def _no_errors(browser):
    assert not browser.find_elements(By.ID, "error"), browser.find_element(By.ID, "error").text
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe  # a script error, a refused resource (the CSP), a failed request


def test_the_runs_page_lists_every_run_with_its_status_and_best(browser, server, root):
    browser.get(server + "/")
    _wait(browser, "#runs tr.run")
    rows = {r.get_attribute("data-run"): r for r in browser.find_elements(By.CSS_SELECTOR, "#runs tr.run")}
    assert sorted(rows) == ["base", "broken", "fork", "killed", "other", "resumed"]
    assert "running (no writer)" in rows["killed"].text
    best = load_result(root / "base").best
    cells = rows["base"].find_elements(By.TAG_NAME, "td")
    assert float(cells[3].get_attribute("data-value")) == best.value and float(cells[3].text) == pytest.approx(best.value, rel=1e-5)
    assert "forked from base" in rows["fork"].text
    _no_errors(browser)
    _shot(browser, "runs")


def test_the_run_page_shows_its_history_and_draws_its_curves(browser, server, root):
    browser.get(server + "/runs/base")
    _wait(browser, "#history tr[data-epoch]")
    history = load_result(root / "base").history
    for r in history:
        row = browser.find_element(By.CSS_SELECTOR, f'#history tr[data-epoch="{r.epoch}"]')
        shown = [c.get_attribute("data-value") for c in row.find_elements(By.CSS_SELECTOR, "td.num")]
        assert float(shown[1]) == r.train["loss"] and float(shown[2]) == r.val["val_loss"]
    # loss and lr per epoch, loss and lr per update: uPlot draws each on a canvas once its curves arrive; the
    # per-update curves come CURVE_BUDGET events an answer, the page asking again until they are complete
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "update-note").get_attribute("data-complete") == "true")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#update-charts .chart canvas")) >= 2
    assert len(browser.find_elements(By.CSS_SELECTOR, "#epoch-charts .chart canvas")) >= 2
    updates = sum(1 for _ in _committed_receipts(root / "base"))
    assert load_result(root / "base").events > CURVE_BUDGET  # so the page asked more than once
    assert browser.find_element(By.ID, "update-note").text == f"every committed update ({updates}), not downsampled"
    assert browser.find_element(By.ID, "events-count").text == str(load_result(root / "base").events)
    _no_errors(browser)
    _shot(browser, "run")


def test_a_click_on_an_event_row_reaches_the_event_and_its_commit_group(browser, server):
    browser.get(server + "/runs/base/events?limit=50")
    _wait(browser, "#events tr.event")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#events tr.event")) == 50
    _shot(browser, "events")
    browser.find_element(By.ID, "next").click()
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.CSS_SELECTOR, "#events tr.event").get_attribute("data-seq") == "50")
    browser.get(server + "/runs/resumed/events?kind=best_committed")
    row = _wait(browser, "#events tr.event")
    seq = row.get_attribute("data-seq")
    row.find_elements(By.TAG_NAME, "td")[2].click()  # the row, not its link
    _wait(browser, "#fields")
    assert browser.current_url.endswith(f"/runs/resumed/events/{seq}")
    assert browser.find_element(By.ID, "event-kind").text == "best_committed"
    assert "committed" in browser.find_element(By.ID, "commit-state").text
    group = browser.find_elements(By.CSS_SELECTOR, "#group tr.hit")
    assert len(group) == 1  # the event, highlighted in its LAST's group
    _no_errors(browser)
    _shot(browser, "event")
    browser.find_element(By.ID, "committed-by").click()
    _wait(browser, "#event-kind")
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "event-kind").text == "last_committed")


def test_the_time_travel_slider_moves_and_shows_the_projections_there(browser, server, root):
    browser.get(server + "/runs/resumed/at?seq=5")
    _wait(browser, "#at-line")
    slider = browser.find_element(By.ID, "slider")
    before = browser.find_element(By.ID, "at-line").get_attribute("data-seq")
    total = int(slider.get_attribute("max"))
    slider.click()  # the middle of the slider
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "at-line").get_attribute("data-seq") != before)
    from selenium.webdriver.common.keys import Keys

    for _ in range(3):
        slider.send_keys(Keys.ARROW_RIGHT)
    want = int(slider.get_attribute("value"))
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "at-line").get_attribute("data-seq") == str(want))
    assert 5 < want <= total
    from events.log import LmdbLog
    from nnx_es.cli.projected import at_doc

    with LmdbLog(root / "resumed" / "events.lmdb", readonly=True) as log:
        doc = at_doc(log, want)
    for name, value in doc["projections"]["counters"].items():
        assert browser.find_element(By.CSS_SELECTOR, f'[data-counter="{name}"]').get_attribute("data-value") == str(value)
    assert f"?seq={want}" in browser.current_url
    _no_errors(browser)
    _shot(browser, "at")


def test_the_audit_page_links_each_violation_to_its_event(browser, server):
    browser.get(server + "/runs/broken/audit")
    _wait(browser, "#verdict")
    assert browser.find_element(By.ID, "verdict").text == "FAILED"
    link = browser.find_element(By.CSS_SELECTOR, "#violations tr.violation a")
    seq = link.text
    _shot(browser, "audit")
    link.click()
    _wait(browser, "#event-seq")
    assert browser.find_element(By.ID, "event-seq").text == seq
    browser.get(server + "/runs/base/audit")
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "verdict").text == "ok")
    _no_errors(browser)


def test_the_diff_page_shows_both_runs_from_their_first_difference(browser, server):
    browser.get(server + "/diff?a=base&b=other")
    _wait(browser, "#difference")
    assert "first difference at seq 0" in browser.find_element(By.ID, "difference").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.diff-side tr.hit")) == 2
    _no_errors(browser)
    _shot(browser, "diff")


def test_the_rows_page_draws_the_data_map(browser, server):
    browser.get(server + "/runs/base/rows")
    canvas = _wait(browser, "#map")
    painted = browser.execute_script(
        "const c = arguments[0], d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] && (d[i] !== d[i + 1] || d[i + 1] !== d[i + 2])) n++;"
        "return n;", canvas)
    assert painted > 200  # coloured points were drawn (axes and labels are grey)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#hardest tr")) == 26
    _no_errors(browser)
    _shot(browser, "rows")
    browser.get(server + "/runs/resumed/rows")
    _wait(browser, "#no-rows")


def _committed_receipts(run_dir):
    from events.log import LmdbLog
    from projections import committed

    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return [e for _, e in committed(log.read()) if e.KIND == "update_committed"]


def test_the_study_pages_show_each_trial_beside_its_runs_best(browser, study):
    url, runs = study
    browser.get(url + "/studies")
    row = _wait(browser, '#studies tr.study[data-study="lr-search"]')
    cells = row.find_elements(By.TAG_NAME, "td")
    assert [c.text for c in cells[1:4]] == ["minimize", "3", "3"]
    _no_errors(browser)
    _shot(browser, "studies")
    cells[0].find_element(By.TAG_NAME, "a").click()
    _wait(browser, "#trials tr.trial")
    trials = {int(r.get_attribute("data-trial")): r for r in browser.find_elements(By.CSS_SELECTOR, "#trials tr.trial")}
    assert sorted(trials) == [0, 1, 2]
    bests = {}
    for number, r in trials.items():
        run_id = r.find_element(By.CSS_SELECTOR, "td a").text
        best = load_result(runs / run_id).best.value  # the run's own log
        value = r.find_elements(By.CSS_SELECTOR, "td.num")[1]
        assert float(value.get_attribute("data-value")) == best == float(r.find_elements(By.CSS_SELECTOR, "td.num")[-1].get_attribute("data-value"))
        assert "COMPLETE" in r.text and "completed" in r.text
        bests[number] = best
    best_trial = min(bests, key=lambda n: (bests[n], n))
    assert [n for n, r in trials.items() if "best" in r.get_attribute("class").split()] == [best_trial]
    _no_errors(browser)
    _shot(browser, "study")
    link = trials[best_trial].find_element(By.CSS_SELECTOR, "td a")
    run_id = link.text
    link.click()
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "run-id").text == run_id)


def test_browsing_changed_nothing_under_the_root(browser, server, root):
    before = tree_state(root)
    for path in ("/", "/runs/fork", "/runs/killed/events", "/runs/killed/at", "/runs/fork/audit"):
        browser.get(server + path)
        _wait(browser, "main > *:not(.muted)")
    time.sleep(0.5)
    assert tree_state(root) == before
    assert shutil.which("chromium") or Path(CHROMIUM).exists()
