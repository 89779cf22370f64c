"""Seeing a real job: its metrics scraped by a real Prometheus, its trace, `status`, `stacks`, the
dashboard in a real headless Chromium, the console, and --hold-on-failure.

One real run is shared by the module: examples/train_mlp.py on 2 ranks, rank 1 slow (a straggler),
rank 0 SIGKILLed at step 20 of the first attempt (worker_failed, diagnosis, restart, resume from the
in-memory checkpoint); the second attempt keeps training until the module ends, so the views are
checked on a live job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tgtest import EXAMPLE, REPO, Job, events, free_port, kill_tree, trainguard_cmd, wait_event, wait_for

from trainguard.events.metrics import METRICS
from trainguard.view.trace import validate

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
TORCH_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", re.MULTILINE)


def need(path: str | None, what: str) -> str:
    """A tool the test needs: CI installs it (.ci/run), so there its absence is a failure."""
    if path and os.path.exists(path):
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed (.ci/run installs it)")
    pytest.skip(f"{what} is not installed")


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observe")
    run = tmp / "run"
    prom = tmp / "trainguard.prom"
    job = Job(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--quiet", "--run-dir", run,
               "--metrics-port", "0", "--metrics-textfile", prom, "--hang-detect-time", "10",
               EXAMPLE, "--steps", "100000", "--step-time-ms", "40", "--slow-rank", "1", "--slow-factor", "2.5",
               "--ckpt-every", "5", "--ckpt", "trainguard", "--fail-rank", "0", "--fail-step", "20", "--fail-mode", "kill"],
              tmp / "job.out")
    try:
        wait_event(run, "diagnosis")
        wait_event(run, "job_started", pred=lambda e: e.evidence["attempt"] == 1)
        wait_event(run, "straggler_detected")
        wait_event(run, "checkpoint_loaded")
        listening = wait_event(run, "metrics_listening")
        yield {"run": run, "job": job, "tmp": tmp, "prom": prom, "endpoint": listening.evidence["endpoint"]}
    finally:
        job.kill()


def tg(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(trainguard_cmd(*args), capture_output=True, text=True, timeout=timeout)


def scrape(endpoint: str) -> dict[str, list]:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_console_shows_trainguard_lines_only(live_run):
    out = live_run["job"].output()
    assert "[worker_failed] rank=0" in out and "[diagnosis]" in out, out
    assert not TORCH_LOG_LINE.search(out), TORCH_LOG_LINE.findall(out)
    assert "failed (exitcode" not in out and "OMP_NUM_THREADS" not in out
    agent_log = next(live_run["run"].glob("agent-*.log")).read_text()
    assert " torch.distributed" in agent_log  # torch's own lines went to the agent log


def test_metrics_endpoint_and_textfile(live_run):
    host, _, port = live_run["endpoint"].rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    names = {n for n, _, _ in METRICS}

    def complete():  # right after a restart a rank has a step (the resumed one) but no step time yet
        fams = scrape(live_run["endpoint"])
        return fams if names <= {s.name for samples in fams.values() for s in samples} else None

    fams = wait_for(complete, what=f"all of {sorted(names)}")
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for samples in fams.values() for s in samples}
    assert value[("trainguard_max_restarts", ())] == 2
    assert value[("trainguard_restarts_used", ())] == 1
    assert value[("trainguard_restarts_total", (("reason", "worker_failure"),))] == 1
    assert sum(v for (n, _), v in value.items() if n == "trainguard_worker_failures_total") >= 1
    assert value[("trainguard_node_state", (("state", "running"),))] == 1
    assert value[("trainguard_straggler_ratio", (("rank", "1"),))] > value[("trainguard_straggler_ratio", (("rank", "0"),))]
    resumed = events(live_run["run"], "checkpoint_loaded")[0].evidence["step"]
    assert value[("trainguard_checkpoint_last_step", ())] >= resumed > 0
    text = wait_for(lambda: live_run["prom"].exists() and live_run["prom"].read_text(), what="textfile")
    assert {f.name for f in text_string_to_metric_families(text)} >= {"trainguard_restarts", "trainguard_step"}


def test_real_prometheus_scrapes_the_agent(live_run, tmp_path):
    exe = need(shutil.which("prometheus"), "prometheus (Debian package)")
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: trainguard\n    static_configs: [{{targets: ['{live_run['endpoint']}']}}]\n")
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([exe, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def query(q: str) -> list:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                data = json.load(r)
        except OSError:
            return []
        return data["data"]["result"] if data.get("status") == "success" else []

    try:
        up = wait_for(lambda: query('up{job="trainguard"} == 1'), timeout=120, what="prometheus scraping the agent")
        assert up[0]["metric"]["instance"] == live_run["endpoint"]
        restarts = wait_for(lambda: query("trainguard_restarts_total"), what="restarts in prometheus")
        assert restarts[0]["metric"]["reason"] == "worker_failure" and float(restarts[0]["value"][1]) == 1
        steps = wait_for(lambda: (r if len(r := query("trainguard_step")) == 2 else None), what="both ranks' steps")
        assert {s["metric"]["rank"] for s in steps} == {"0", "1"}
        assert float(query("trainguard_max_restarts")[0]["value"][1]) == 2
        assert query('trainguard_build_info{version!=""}')
        # Every panel of the Grafana dashboard in the repo is a valid query with data behind it.
        board = json.loads((REPO / "docs" / "grafana" / "trainguard.json").read_text())
        exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
        assert len(exprs) >= 10
        for expr in exprs:
            q = expr.replace("$job", ".+").replace("$__rate_interval", "1m")
            wait_for(lambda q=q: query(q), timeout=60, what=f"data for the dashboard query {q}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
        log.close()


def test_trace_has_every_rank_events_and_attempts(live_run, tmp_path):
    out = tmp_path / "trace.json"
    res = tg("trace", live_run["run"], "-o", out)
    assert res.returncode == 0, res.stderr
    assert re.search(r"^goodput \d+\.\d% of [\d.]+ s: productive [\d.]+ s, detection [\d.]+ s, restart [\d.]+ s, "
                     r"lost work [\d.]+ s \(\d+ step\(s\) redone\)", res.stdout, re.MULTILINE), res.stdout
    doc = json.loads(out.read_text())  # a real JSON parser
    assert validate(doc) == []
    evs = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    [pid] = procs
    assert {threads[(pid, 0)], threads[(pid, 1)]} == {"rank 0", "rank 1"}
    steps = [e for e in evs if e["ph"] == "X" and e["cat"] == "Step"]
    assert {e["tid"] for e in steps} == {0, 1} and all(e["dur"] > 0 for e in steps)
    assert {e["args"]["attempt"] for e in steps} == {0, 1}
    attempts = [e for e in evs if e["ph"] == "X" and e["cat"] == "attempt"]
    assert [a["name"] for a in attempts] == ["attempt 0", "attempt 1"]
    assert attempts[0]["ts"] + attempts[0]["dur"] <= attempts[1]["ts"]
    failed = [e for e in evs if e["ph"] == "i" and e["name"] == "worker_failed"]
    assert failed and failed[0]["tid"] == 0
    g = doc["otherData"]["goodput"]
    assert g["faults"] == 1 and g["attempts"] == 2 and 0 < g["goodput"] < 1 and g["lost_known"]


def test_status_once_shows_ranks_and_fault_tolerance_counts(live_run):
    res = tg("status", live_run["run"], "--once")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "job:         running" in out
    assert "max restarts 2, restarts used 1, reschedules for hardware faults 0" in out
    rows = {int(m.group(1)): m.group(0) for m in re.finditer(r"^ +(\d) +\S+ +\d+ +(\d+) .*$", out, re.MULTILINE)}
    assert set(rows) == {0, 1}, out
    assert "(straggler)" in rows[1] and "(straggler)" not in rows[0]
    snap = json.loads(tg("status", live_run["run"], "--json").stdout)
    assert snap["restarts_used"] == 1 and snap["failures_by_category"]


def test_stacks_of_every_rank(live_run):
    res = tg("stacks", live_run["run"], timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in (0, 1):
        assert re.search(rf"^=== rank {rank} \(node \S+, pid \d+, state \w", res.stdout, re.MULTILINE), res.stdout
    assert "train_mlp.py" in res.stdout and "Thread MainThread" in res.stdout


def test_dashboard_in_headless_chromium(live_run, tmp_path):
    need(CHROMIUM, "chromium (Debian package)")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    dash = subprocess.Popen(trainguard_cmd("dashboard", live_run["run"], "--port", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url = re.search(r"http://\S+", dash.stdout.readline()).group(0)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"])
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 1000})
                page.goto(url)
                page.wait_for_selector('#events tr.event[data-kind="worker_failed"]', timeout=60_000)
                for kind in ("job_started", "restart", "diagnosis", "straggler_detected", "checkpoint_loaded"):
                    assert page.locator(f'#events tr.event[data-kind="{kind}"]').count() >= 1, kind
                assert page.inner_text("#job-state") == "running"
                assert page.inner_text("#max-restarts") == "2" and page.inner_text("#restarts-used") == "1"
                for rank in (0, 1):  # the heatmap drew measured cells for both ranks
                    assert page.locator(f'#heatmap .cell[data-rank="{rank}"][data-value]').count() >= 2
                assert "⚑" in page.inner_text("#heatmap .rowlabel.flagged")
                assert page.locator("#diagnoses li.diagnosis").count() >= 1
                assert page.locator("#checkpoints tr.ckpt-loaded").count() >= 1
                # It updates while the job runs: rank 0's step moves on without a reload.
                step = page.inner_text('#ranks tr[data-rank="0"] td:nth-child(4)')
                cell = '#ranks tr[data-rank="0"] td:nth-child(4)'
                wait_for(lambda: page.inner_text(cell) != step, timeout=60, what="the page to update by itself")
                page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                if os.environ.get("TRAINGUARD_DOCS_SCREENSHOT"):
                    page.screenshot(path=os.environ["TRAINGUARD_DOCS_SCREENSHOT"], full_page=True)
            finally:
                browser.close()
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    finally:
        dash.send_signal(signal.SIGTERM)
        try:
            dash.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(dash.pid)
        dash.stdout.close()


def test_hold_on_failure_keeps_the_agent_until_sigterm(jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "--quiet", "--run-dir", run,
               "--hold-on-failure", "30", "--precheck", "off", EXAMPLE, "--steps", "50", "--fail-rank", "0",
               "--fail-step", "3", "--fail-mode", "raise")
    held = wait_event(run, "node_held")
    assert held.evidence["minutes"] == 30 and held.evidence["pid"] == job.proc.pid
    wait_for(lambda: "holding this node for inspection" in job.output(), what="the hold on the console")
    assert job.proc.poll() is None  # still there for inspection
    res = tg("status", run, "--once")
    assert "job:         held" in res.stdout, res.stdout
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 1, job.output()
    [ended] = events(run, "hold_ended")
    assert ended.evidence["ended_by"] == "SIGTERM"

