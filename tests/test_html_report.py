"""The HTML reports as a person sees them: a W=2 run's RUN_DIR/report.html, a sweep's SWEEP_DIR/report.html and
the doctor's RUN_DIR/doctor/report.html of a failed run, each opened from file:// in headless Chromium (Debian's
chromium + chromium-driver, driven by selenium through /usr/bin/chromedriver, no network). Each page loads without
console errors, shows the numbers of the records (read here independently from the JSON files), holds only
embedded resources, and its figures are not blank. The task figures are also checked against numbers computed
here from the run's results.json."""
from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, SHARED, load_results, run_disteval
from recorded_runs import diagnostics_cli

pytestmark = pytest.mark.slow
CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
QUICK = ("eval.progress=false",)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium for the module (console messages kept: goog:loggingPrefs)."""
    if not (CHROMIUM.is_file() and DRIVER.is_file()):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}", "--window-size=1280,1600"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run, sweep, failed}: a W=2 run with bootstrap intervals, a sweep over W=1,2, a W=2 run failing on rank 1
    diagnosed by the doctor (as a person runs it: no --json)."""
    base = tmp_path_factory.mktemp("reports")
    run = base / "run"
    proc = run_disteval("dist.world_size=2", "eval.ci.resamples=50", *QUICK, run_dir=run)
    assert proc.returncode == 0, proc.stderr
    sweep = base / "sweep"
    proc = subprocess.run([sys.executable, "-m", "disteval", "-m", "dist.world_size=1,2", f"hydra.sweep.dir={sweep}",
                           *QUICK], cwd=base, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    failed = base / "failed"
    proc = run_disteval("dist.world_size=2", *QUICK, run_dir=failed, env={"DISTEVAL_FAULTS": "error@1:batch=1"})
    assert proc.returncode == 1, proc.stderr
    doctor = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", str(failed)], cwd=base,
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, COLUMNS="200"))
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    report = failed / "doctor" / "report.html"
    assert f"report: {report}" in " ".join(doctor.stdout.split())
    verdict = json.loads(diagnostics_cli(["doctor", str(failed), "--json"], cwd=base).stdout)["runs"][0]
    return {"run": run, "sweep": sweep, "failed": failed, "verdict": verdict}


def open_page(driver, page: Path, shot: Path) -> np.ndarray:
    """Open ``page`` from file://, assert no console errors, save a screenshot; returns it as an RGB array."""
    from PIL import Image

    driver.get_log("browser")  # drop what an earlier page left
    driver.get(page.resolve().as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
    driver.save_screenshot(str(shot))
    return np.asarray(Image.open(shot).convert("RGB"))


def images_of(driver) -> list[np.ndarray]:
    """Every <img> of the open page: its src is an embedded PNG (no file, no network), decoded to RGB arrays; each
    was laid out by the browser (natural width > 0)."""
    from PIL import Image

    out = []
    for img in driver.find_elements("tag name", "img"):
        src = img.get_attribute("src")
        assert src.startswith("data:image/png;base64,"), src[:80]
        assert driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 0
        out.append(np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")))
    return out


def not_blank(image: np.ndarray, min_fraction: float = 0.02) -> bool:
    """More than ``min_fraction`` of the pixels differ from the most common colour (the background), and the
    pixel values vary."""
    flat = image.reshape(-1, image.shape[-1])
    colours, counts = np.unique(flat, axis=0, return_counts=True)
    return 1 - counts.max() / len(flat) > min_fraction and float(image.std()) > 5


def self_contained(html: str) -> None:
    """No external resource: no http(s) URL in src/href, no <script src>, no <link rel=stylesheet>."""
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, re.I)
    assert "<link" not in html.lower() and "<script" not in html.lower()


def test_run_report(browser, runs, tmp_path):
    run = runs["run"]
    results = load_results(run)
    shot = open_page(browser, run / "report.html", tmp_path / "run.png")
    assert shot.shape[1] >= 1000 and not_blank(shot)
    self_contained((run / "report.html").read_text())
    el = browser.find_element
    # identity, read independently from results.json and launch.json
    assert el("id", "id-world-size").text == "2" == str(results["world_size"])
    assert el("id", "id-mode").text == results["mode"] == "bitwise"
    assert el("id", "id-fingerprint").text == results["config_digest"]
    assert results["model"]["name"] in el("id", "id-model").text and results["dataset"]["name"] in el("id", "id-data").text
    assert el("id", "id-outcome").text.startswith(json.loads((run / "launch.json").read_text())["outcome"])
    # every scalar metric, its value exactly (data-value) and its bootstrap interval
    cells = {c.get_attribute("data-metric"): c for c in browser.find_elements("css selector", "td[data-metric]")}
    scalars = {k: v for k, v in results["metrics"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert set(cells) == set(scalars)
    for key, value in scalars.items():
        assert float(cells[key].get_attribute("data-value")) == value, key
    ci = results["confidence_intervals"]
    with_ci = browser.find_elements("css selector", "td[data-ci-low]")
    assert with_ci and len(with_ci) == sum(isinstance(v, dict) and k in scalars for k, v in ci.items())
    for td in with_ci:
        key = td.find_element("xpath", "..").find_element("css selector", "td[data-metric]").get_attribute("data-metric")
        assert (float(td.get_attribute("data-ci-low")), float(td.get_attribute("data-ci-high"))) == \
            (ci[key]["low"], ci[key]["high"])
    # the sync and the ranks
    assert int(el("id", "collectives").text) == results["comm"]["collectives"]
    assert int(el("id", "comm-bytes").get_attribute("data-bytes")) == results["comm"]["bytes"]
    samples = [int(td.get_attribute("data-samples")) for td in browser.find_elements("css selector", "td[data-samples]")]
    assert samples == [p["samples"] for p in results["per_rank"]] and sum(samples) == 540
    # who waited for whom: the last rank to enter each collective, from the status records' entry times
    status = {r: json.loads((run / "ranks" / f"rank{r}" / "status.json").read_text()) for r in (0, 1)}
    calls = min(len(s["collectives_done"]) for s in status.values())
    want = [max((0, 1), key=lambda r: status[r]["collectives_done"][i]["t_end"] - status[r]["collectives_done"][i]["seconds"])
            for i in range(calls)]
    got = [int(td.get_attribute("data-last-rank")) for td in browser.find_elements("css selector", "td[data-last-rank]")]
    assert got == want and calls >= 2
    assert el("id", "no-warnings").text == "none" and results["warnings"] == []
    # the task's figures and the timeline, embedded and not blank
    figures = [f.get_attribute("data-figure") for f in browser.find_elements("css selector", "figure[data-figure]")]
    assert figures == ["confusion", "per_class_accuracy", "reliability", "timeline"]
    images = images_of(browser)
    assert len(images) == 4 and all(not_blank(i) for i in images)


def test_sweep_report(browser, runs, tmp_path):
    sweep = runs["sweep"]
    shot = open_page(browser, sweep / "report.html", tmp_path / "sweep.png")
    assert not_blank(shot)
    self_contained((sweep / "report.html").read_text())
    jobs = {w: load_results(sweep / str(j)) for j, w in ((0, 1), (1, 2))}
    assert [r["world_size"] for r in jobs.values()] == [1, 2]
    assert browser.find_element("id", "identity-verdict").get_attribute("data-equal") == "true"
    rows = browser.find_elements("css selector", "#identity-table tr[data-metric]")
    assert len(rows) > 10 and all(r.get_attribute("data-equal") == "true" for r in rows)
    assert jobs[1]["metrics"] == jobs[2]["metrics"]  # bitwise mode: what the page says, checked here
    for w, res in jobs.items():
        row = browser.find_element("css selector", f"#jobs tr[data-world-size='{w}']")
        assert float(row.find_element("css selector", "[data-value]").get_attribute("data-value")) == res["metrics"]["top1"]
        assert float(row.find_element("css selector", "[data-eval]").get_attribute("data-eval")) == \
            res["timings"]["evaluation_s"]
        assert float(row.find_element("css selector", "[data-images-per-s]").get_attribute("data-images-per-s")) == \
            res["throughput"]["images_per_s"]
        launch = json.loads((Path(res["run_dir"]) / "launch.json").read_text())
        assert float(row.find_element("css selector", "[data-job-wall]").get_attribute("data-job-wall")) == \
            launch["t_end"] - launch["t_start"]
    images = images_of(browser)
    assert len(images) == 1 and not_blank(images[0])


def test_doctor_report(browser, runs, tmp_path):
    failed, verdict = runs["failed"], runs["verdict"]
    shot = open_page(browser, failed / "doctor" / "report.html", tmp_path / "doctor.png")
    assert not_blank(shot)
    self_contained((failed / "doctor" / "report.html").read_text())
    v = verdict["verdict"]
    assert (v["state"], v["check"], verdict["culprit_rank"]) == ("INIT", "ranks_ran", 1)  # the doctor's --json
    line = browser.find_element("id", "verdict-line")
    assert (line.get_attribute("data-state"), line.get_attribute("data-check")) == (v["state"], v["check"])
    # the culprit as the rank's own status record names it
    errors = {r: json.loads((failed / "ranks" / f"rank{r}" / "status.json").read_text())["error"] for r in (0, 1)}
    failing = [r for r, e in errors.items() if e["type"] == "RuntimeError" and e["message"].startswith("DISTEVAL_FAULTS")]
    assert browser.find_element("id", "culprit-rank").get_attribute("data-rank") == str(failing[0]) == "1"
    states = browser.find_elements("css selector", "svg#states g.state")
    assert [s.get_attribute("data-state") for s in states] == ["INIT", "SHARDS", "CONVERGENCE", "COMM", "RESULT"]
    roles = {s.get_attribute("data-state"): s.get_attribute("data-role") for s in states}
    assert roles["INIT"] == "failing" and all(r == "after" for k, r in roles.items() if k != "INIT")
    assert all(s.is_displayed() and s.rect["width"] > 100 for s in states)  # drawn, not only in the markup
    evidence = browser.find_elements("css selector", "#evidence tr")[1:]
    assert len(evidence) == len(v["evidence"]) and v["evidence"][0]["source"] in evidence[0].text
    checks = browser.find_elements("css selector", "tr[data-check]")
    assert [c.get_attribute("data-check") for c in checks] == [f"{c['state']}/{c['check']}" for c in verdict["checks"]]
    # the page's state-machine strip is coloured: a red box (the failing state) on screen
    red = (np.abs(shot.astype(int) - [0xF4, 0xB4, 0xB4]).sum(axis=2) < 12).mean()
    assert red > 0.002


def test_report_modules_import_without_torch():
    """The report layer renders from records alone: importing it loads neither torch nor any task."""
    code = ("import sys, disteval.job.htmlreport, disteval.job.run_report; "
            "assert not [m for m in sys.modules if m == 'torch' or m.startswith('disteval.tasks')], 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_task_figures_from_results(runs):
    """classification's figures from the W=2 run's metrics: the confusion matrix's diagonal / row sums equal the
    per-class accuracy, the reliability bins reproduce the ECE, and each figure has drawn pixels."""
    from disteval.job.htmlreport.render import png_uri
    from disteval.tasks import ClassificationTask
    from PIL import Image

    m = load_results(runs["run"])["metrics"]
    cm = np.array(m["confusion"])
    assert cm.sum() == m["num_samples"] and (cm.sum(1) == m["per_class_support"]).all()
    np.testing.assert_array_equal(np.diag(cm) / cm.sum(1), m["per_class_accuracy"])
    rel = m["reliability"]
    ece = np.abs(np.array(rel["correct"]) - np.array(rel["confidence_sum"])).sum() / sum(rel["count"])
    assert ece == pytest.approx(m["ece"], rel=1e-12) and sum(rel["correct"]) == round(m["top1"] * m["num_samples"])
    figures = ClassificationTask.report_figures(m)
    assert [f.key for f in figures] == ["confusion", "per_class_accuracy", "reliability"]
    for f in figures:
        png = base64.b64decode(png_uri(f.figure).split(",", 1)[1])
        assert not_blank(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")))
    assert ClassificationTask.report_figures({}) == []  # an older record without the data: no figures


FAMILY_RUNS = {  # a W=1 run of each other task family, the task that draws its figures, the figure keys it draws
    "detection": (["+experiment=coco_replay", "data.annotations={fce}/instances_val2014_100.json",
                   "data.predictions={fce}/instances_val2014_fakebbox100_results.json"], "CocoReplayTask"),
    "segmentation": (["+experiment=coco_semseg_replay"], "SegmentationTask"),
    "embedding": (["+experiment=fashion_mnist_knn", "eval.embedding.gallery_limit=3000",  # figures, not scale
                   "eval.embedding.query_limit=600"], "EmbeddingTask"),
}


@pytest.mark.parametrize("family", sorted(FAMILY_RUNS))
def test_every_task_family_draws_its_figures(family, tmp_path):
    """A real W=1 run of detection (COCO bbox replay), segmentation (COCO segm replay) and embedding (kNN) writes
    report.html with its task's figures (data-figure keys), each a non-blank PNG, and the task's figures from
    results.json alone are the page's; the main metric read from results.json is in the page."""
    fce = SHARED / "data" / "coco" / "fce_cocoapi"
    if not fce.is_dir():
        pytest.skip(f"the shared COCO files are not at {fce}")
    from disteval import tasks
    from disteval.job.htmlreport.render import png_uri
    from PIL import Image

    overrides, task_name = FAMILY_RUNS[family]
    run_dir = tmp_path / family
    proc = subprocess.run([sys.executable, "-m", "disteval", *[o.format(fce=fce) for o in overrides],
                           f"hydra.run.dir={run_dir}", "eval.progress=false", "dist.world_size=1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = load_results(run_dir)["metrics"]
    figures = [f for f in getattr(tasks, task_name).report_figures(metrics) if hasattr(f, "figure")]
    assert figures, f"{task_name} drew no figure from {sorted(metrics)}"
    html = (run_dir / "report.html").read_text()
    self_contained(html)
    for f in figures:
        assert f'data-figure="{f.key}"' in html, f.key
        png = base64.b64decode(png_uri(f.figure).split(",", 1)[1])
        assert not_blank(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))), f.key
    main = {"detection": "AP", "segmentation": "mIoU", "embedding": "knn_weighted_k20_top1"}[family]
    assert f"{metrics[main]:.4f}" in html, (main, metrics[main])


def test_a_tensor_parallel_run_writes_its_report(tmp_path):
    """``+experiment=imagenet_vit_tp`` (a device mesh: its comm record has no per-op bytes) writes report.html
    with its collectives, the input pipeline and the metrics (it failed with "'dict object' has no attribute
    'bytes_by_op'"); a ViT-B/16 at 32 px on 8 of the shipped images keeps it to seconds."""
    from conftest import SAMPLE, sample_tree

    if not SAMPLE.is_dir():
        pytest.skip(f"the shipped ImageNet sample is not at {SAMPLE}")
    root = sample_tree(tmp_path / "val", limit=8)
    run_dir = tmp_path / "tp"
    proc = subprocess.run([sys.executable, "-m", "disteval", "+experiment=imagenet_vit_tp", f"data.root={root}",
                           "data.resize_size=32", "data.crop_size=32", "+model.kwargs.image_size=32", "model.num_classes=8",
                           f"hydra.run.dir={run_dir}", "eval.progress=false"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "could not write" not in proc.stderr, proc.stderr[-2000:]
    res = load_results(run_dir)
    html = (run_dir / "report.html").read_text()
    self_contained(html)
    assert res["parallel"] and f"{res['metrics']['top1']:.4f}" in html
    for op in res["comm"]["by_op"]:
        assert f"<td>{op}</td>" in html, op
    assert '<section id="pipeline">' in html
