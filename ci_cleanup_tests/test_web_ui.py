"""`ci-cleanup dev`: what it serves (the schedules, on localhost only), its UI in a real headless Chromium
(Debian's) driven by Playwright, and Ctrl-C stopping it and every server it started. One dev stack for them all."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from .harness import clean_env, free_port, servers_of, wait_for_ui
from .test_code_location import SCHEDULES

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
BIN = Path(sys.executable).parent
# Flags this workplace's Chromium needs: no sandbox as root, and no background calls to the closed network.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

try:
    from playwright import sync_api
except ImportError:
    sync_api = None

# Its module fixture is the costly part: on one xdist worker (``--dist loadgroup``), it is set up once.
pytestmark = pytest.mark.xdist_group("web_ui")


@dataclass
class Dev:
    data_dir: Path
    port: int
    process: subprocess.Popen

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def dev(servers_dir):
    """`ci-cleanup dev` on a fresh embedded stack, which it seeds (its GitLab database is empty), stopped by the last
    test as Ctrl-C would (here if it is not)."""
    data_dir, port = servers_dir / "ui" / "dev", free_port()
    process = subprocess.Popen(
        [BIN / "ci-cleanup", "--data-dir", str(data_dir), "dev", "--port", str(port)],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        wait_for_ui(f"http://127.0.0.1:{port}", process)
        yield Dev(data_dir, port, process)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            process.communicate(timeout=60)
    assert servers_of(data_dir) == []


@pytest.fixture
def dev_ui(dev) -> str:
    return dev.base


@pytest.fixture
def page(dev_ui):
    if sync_api is None:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Chromium is not installed (apt-get install chromium); .ci/run installs it")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        # Dagster's first-visit newsletter dialog may open over what a test clicks, on any page, once it settles:
        # dismissed whenever it shows, with no wait where it does not.
        page.add_locator_handler(page.get_by_role("button", name="Skip"), lambda skip: skip.first.click())
        yield page
        browser.close()


def open_page(page, url: str) -> None:
    page.goto(url, wait_until="networkidle")


def go_within_the_app(page, url: str) -> None:
    """To ``url`` as the UI's own links go (its router renders the page; no reload of Dagster's scripts, which is
    most of a page's CPU)."""
    page.evaluate("url => { history.pushState({}, '', url); dispatchEvent(new PopStateEvent('popstate')); }", url)
    page.wait_for_load_state("networkidle")


def test_dev_serves_the_schedules_on_localhost_only(dev):
    query = (
        '{ schedulesOrError(repositorySelector: {repositoryName: "__repository__", '
        'repositoryLocationName: "ci_cleanup"}) '
        "{ ... on Schedules { results { name cronSchedule executionTimezone } } } }"
    )
    request = urllib.request.Request(
        f"{dev.base}/graphql", data=json.dumps({"query": query}).encode(), headers={"Content-Type": "application/json"},
    )
    listed = json.load(urllib.request.urlopen(request, timeout=30))["data"]["schedulesOrError"]["results"]
    shown = {s["name"]: (s["cronSchedule"], s["executionTimezone"]) for s in listed if s["name"] in SCHEDULES}
    assert shown == {name: (cron, "UTC") for name, (_, cron) in SCHEDULES.items()}
    listening = {
        c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.laddr.port == dev.port
    }
    assert listening == {"127.0.0.1"}


def test_the_five_jobs_and_schedules_are_listed_with_their_crons(dev_ui, page):
    open_page(page, dev_ui + "/jobs")
    for _, (job, _) in SCHEDULES.items():
        sync_api.expect(page.get_by_text(job, exact=True).first).to_be_visible()

    for name, (_job, cron) in SCHEDULES.items():
        go_within_the_app(page, f"{dev_ui}/locations/ci_cleanup/schedules/{name}")
        assert page.url == f"{dev_ui}/locations/ci_cleanup/schedules/{name}"
        sync_api.expect(page.get_by_text(f"({cron})", exact=True)).to_be_visible()
        sync_api.expect(page.get_by_text("UTC", exact=True)).to_be_visible()


def test_launchpad_dry_run_of_drop_canceling_builds_succeeds_with_its_metadata(dev_ui, page):
    open_page(page, f"{dev_ui}/locations/ci_cleanup/jobs/drop_canceling_builds/playground")
    editor = page.locator(".CodeMirror").first
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")
    page.keyboard.type("resources: {run_options: {config: {dry_run: true}}}")
    page.get_by_role("button", name="Launch Run").click()

    page.wait_for_url(re.compile(r".*/runs/[0-9a-f-]{36}.*"))
    sync_api.expect(page.get_by_text("Success", exact=True).first).to_be_visible(timeout=120_000)
    sync_api.expect(page.get_by_text("RUN_SUCCESS").first).to_be_visible(timeout=60_000)
    sync_api.expect(page.get_by_text("dry run", exact=True).first).to_be_visible()  # report_dropped_builds' status
    sync_api.expect(page.get_by_text("rows_changed", exact=True).first).to_be_visible()
    sync_api.expect(page.get_by_text("would_drop_count", exact=True).first).to_be_visible()  # dev seeded its data
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "drop_canceling_builds_dry_run.png"))

    page.get_by_role("button", name="View tags and config").click()
    sync_api.expect(page.get_by_text("ci_cleanup/dry_run").first).to_be_visible()


def test_an_out_of_range_setting_launched_from_the_launchpad_fails_in_one_line_changing_nothing(dev_ui, page):
    """Dagster's config schema has no bounds: the Launchpad accepts batch_size 0 (its description names the bounds),
    and the run fails in its first op with the one line naming the setting and the bound."""
    open_page(page, f"{dev_ui}/locations/ci_cleanup/jobs/drop_canceling_builds/playground")
    editor = page.locator(".CodeMirror").first
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")
    page.keyboard.type("ops: {find_canceling_builds: {config: {batch_size: 0}}}")
    page.get_by_role("button", name="Launch Run").click()

    page.wait_for_url(re.compile(r".*/runs/[0-9a-f-]{36}.*"))
    sync_api.expect(page.get_by_text("Failure", exact=True).first).to_be_visible(timeout=120_000)
    sync_api.expect(page.get_by_text("ValueError: batch_size must be at least 1, not 0").first).to_be_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "batch_size_0.png"))


def test_a_run_launched_from_the_ui_is_plotted_where_docs_ui_md_says(dev_ui, page):
    """docs/ui.md: Catalog → gitlab → ci_builds → Metadata → Plots, one plot per number the batches observe."""
    open_page(page, f"{dev_ui}/locations/ci_cleanup/jobs/drop_canceling_builds/playground")
    page.get_by_role("button", name="Launch Run").click()
    page.wait_for_url(re.compile(r".*/runs/[0-9a-f-]{36}.*"))
    sync_api.expect(page.get_by_text("Success", exact=True).first).to_be_visible(timeout=120_000)

    go_within_the_app(page, f"{dev_ui}/assets/gitlab/ci_builds")
    page.get_by_text("Plots", exact=True).first.click()
    for number in ("dropped", "doomed", "changed_concurrently", "batches"):
        sync_api.expect(page.get_by_text(number, exact=True).first).to_be_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "ci_builds_plots.png"))


def test_ctrl_c_stops_dev_and_every_server_it_started(dev):
    """Last in this module: the dev stack the tests above used ends here."""
    os.killpg(dev.process.pid, signal.SIGINT)  # Ctrl-C, as in a terminal
    output, _ = dev.process.communicate(timeout=60)
    assert dev.process.returncode == 0, output[-3000:]
    assert servers_of(dev.data_dir) == []
    # Its first start seeded the empty GitLab database, so that a first launch from the UI has work to do.
    assert "The embedded GitLab database is empty: seeding the demo dataset into it" in output
    assert "Seeded the demo GitLab dataset\n" in output
