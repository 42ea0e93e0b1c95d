"""Make the three HTML reports from small runs and save their screenshots as docs/img/report_run.png,
report_sweep.png and report_doctor.png (the pictures in docs/reports.md).

    python scripts/report_screenshots.py [--out docs/img] [--work DIR]

Runs, on the CPU: one W=2 run of the default job, a sweep ``-m dist.world_size=1,2``, and a W=2 run that fails
on rank 1 (``DISTEVAL_FAULTS=error@1:batch=1``) diagnosed by ``python -m diagnostics doctor``. Needs Debian's
chromium and chromium-driver (``apt-get install -y chromium chromium-driver``) and selenium."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICK = ["eval.progress=false"]


def chromium(user_data_dir: str, width: int = 1280):
    """Headless Chromium through /usr/bin/chromedriver (no Selenium Manager download, no background networking)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={user_data_dir}", f"--window-size={width},900", "--hide-scrollbars"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def full_page_png(driver, page: Path, out: Path, width: int = 1280, max_height: int = 3600) -> Path:
    """Open ``page`` from file:// and save a screenshot of its first ``max_height`` pixels to ``out``."""
    driver.set_window_size(width, 900)
    driver.get(page.resolve().as_uri())
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(width, min(height + 20, max_height))
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    return out


def disteval(*args: str, env: dict | None = None) -> int:
    """``python -m disteval ARGS`` from the checkout; returns its exit code."""
    return subprocess.run([sys.executable, "-m", "disteval", *args, *QUICK], cwd=REPO, env={**os.environ, **(env or {})},
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600).returncode


def make_reports(work: Path) -> dict[str, Path]:
    """The three reports (run, sweep, doctor) from small runs under ``work``."""
    run, sweep, failed = work / "run", work / "sweep", work / "failed"
    assert disteval("dist.world_size=2", f"hydra.run.dir={run}") == 0
    assert disteval("-m", "dist.world_size=1,2", f"hydra.sweep.dir={sweep}") == 0
    assert disteval("dist.world_size=2", f"hydra.run.dir={failed}", env={"DISTEVAL_FAULTS": "error@1:batch=1"}) == 1
    subprocess.run([sys.executable, "-m", "diagnostics", "doctor", str(failed)], cwd=REPO, stdout=subprocess.DEVNULL,
                   timeout=300)
    return {"run": run / "report.html", "sweep": sweep / "report.html", "doctor": failed / "doctor" / "report.html"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        reports = make_reports(work)
        driver = chromium(str(Path(tmp) / "chromium-profile"))
        try:
            for name, page in reports.items():
                print(full_page_png(driver, page, args.out / f"report_{name}.png"))
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
