"""torchrun conformance: the scenarios of PyTorch's own launcher tests (test/distributed/launcher/
test_run.py, re-expressed as command lines, with worker scripts of our own), plus the ones a new user
tried, run with `torchrun` and with `trainguard run` in the same run. Each scenario
observes what the user sees (exit status, the files the workers touched, console lines, the files
under --log-dir, the workers' environment) and the two launchers must observe the same, except for
the documented differences (DIFFERENCES: each listed once, each named by the scenarios that show it).
Both launchers run with no extra flag, each in a fresh directory (trainguard's run dir is then
./trainguard-runs/...). It also times launch -> exit of every launch: the overhead ratio.

    python bench/conformance.py                 # every scenario
    python bench/conformance.py --only bash,env # some
    python bench/conformance.py --overhead 7    # + 7 launches of each tiny job with each launcher, alternating
    python bench/conformance.py --only none --overhead 7   # the overhead only
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHERS = ("torchrun", "trainguard")
TIMEOUT_S = 240.0

# Every way trainguard run differs from torchrun that a scenario here shows (see the README's
# "What differs from torchrun"): id -> what it is.
DIFFERENCES = {
    "usage-exit": "bad input is one line on stderr and exit 2 (torchrun: a traceback and exit 1)",
    "user-error-stops": "a worker's Python exception stops the job at once instead of spending restarts "
                        "(a retry would fail the same way); --restart-on-error gives torchrun's behaviour",
    "console-prefix": "every worker line on the console carries its rank ([rank<N>]: , or the "
                      "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE); torchrun prefixes only --tee'd lines",
}

TOUCH_PY = '''
import argparse, os, sys
p = argparse.ArgumentParser()
p.add_argument("--touch-file-dir")
p.add_argument("--fail", action="store_true")
p.add_argument("--fail-first-attempt", action="store_true")
a = p.parse_args()
assert os.environ["TEST_SENTINEL_PARENT"] == "FOOBAR", "the launcher's environment reaches the worker"
if a.fail or (a.fail_first_attempt and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
    raise RuntimeError("worker failure asked for")
rank = os.environ["RANK"]
print(f"creating {a.touch_file_dir}/{rank}", flush=True)
if a.touch_file_dir:
    open(os.path.join(a.touch_file_dir, rank), "w").close()
'''
TOUCH_SH = '#!/bin/bash\necho "creating $1/$RANK"\necho "err of $RANK" >&2\ntouch "$1/$RANK"\n'
LAUNCHED_PY = '''
import sys, torch.distributed as dist
out = sys.argv[1].split("=", 1)[1]
open(out, "w").write(str(dist.is_torchelastic_launched()))
'''
INIT_PY = '''
import os, sys, torch.distributed as dist
method = sys.argv[1].split("=", 1)[1]
dist.init_process_group("gloo", init_method=method, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
dist.barrier()
dist.destroy_process_group()
'''
ENV_SH = '#!/bin/bash\nenv | cut -d= -f1 | sort > "$1/$RANK"\n'
# The values of torchrun's worker variables, per attempt (what changes from run to run left out:
# addresses, ports, the run id, file paths); the last rank fails its first attempt once every rank
# has written (the others would be stopped before they could).
ENV_VALUES_PY = '''
import os, sys, time
same = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
out, count, rank = sys.argv[1], os.environ["TORCHELASTIC_RESTART_COUNT"], int(os.environ["RANK"])
with open(os.path.join(out, f"attempt{count}-rank{rank}.tmp"), "w") as f:
    f.write("\\n".join(f"{k}={os.environ.get(k)}" for k in same))
os.rename(os.path.join(out, f"attempt{count}-rank{rank}.tmp"), os.path.join(out, f"attempt{count}-rank{rank}"))
world = int(os.environ["WORLD_SIZE"])
if count == "0" and rank == world - 1:
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(out) if n.startswith("attempt0-") and not n.endswith(".tmp")]) < world:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise RuntimeError("the last rank fails its first attempt")
'''
SCRIPTS = {"touch.py": TOUCH_PY, "touch.sh": TOUCH_SH, "launched.py": LAUNCHED_PY, "init.py": INIT_PY, "env.sh": ENV_SH,
           "env_values.py": ENV_VALUES_PY}
# What torchrun sets for its workers (names; trainguard may add its own TRAINGUARD_* and a few more)
TORCH_ENV = re.compile(r"^(RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK|ROLE_NAME|LOCAL_WORLD_SIZE|WORLD_SIZE|GROUP_WORLD_SIZE|"
                       r"ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|TORCH_NCCL_\w+|OMP_NUM_THREADS)$")


@dataclass
class Result:
    launcher: str
    code: int
    out: str
    err: str
    work: Path
    seconds: float

    def touched(self) -> list[str]:
        d = self.work / "touched"
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@dataclass
class Scenario:
    name: str
    args: list[str]  # torchrun's flags, the script and its args; {touched} {port} {id} {w} are filled in
    observe: Callable[[Result], object] | None = None  # what else must be the same (besides the exit)
    env: dict[str, str] = field(default_factory=dict)
    agents: int = 1  # launchers started at once with the same arguments (nodes on one host)
    trainguard_flags: list[str] = field(default_factory=list)
    differs: str | None = None  # DIFFERENCES id this scenario shows
    expect_exit: tuple[int, int] | None = None  # (torchrun, trainguard) exit, when differs
    source: str = ""  # torch's test it comes from


def _touched(r: Result) -> object:
    return r.touched()


def _creating_lines(r: Result) -> object:
    """The workers' lines on the console, each with the rank it says it came from."""
    return sorted(ln for ln in r.out.splitlines() if "creating " in ln)


def _creating_lines_unprefixed(r: Result) -> object:
    lines = (re.sub(r"^\[rank\d+\]: ", "", ln) for ln in r.out.splitlines())
    return sorted(ln for ln in lines if ln.startswith("creating "))


def _log_dir(r: Result) -> object:
    """torch's files under --log-dir: <run>_<random>/attempt_<n>/<local rank>/std{out,err}.log, with
    their content (the run's directory name normalised)."""
    root = r.work / "logs"
    files = {}
    for p in sorted(root.rglob("*.log")) if root.is_dir() else []:
        rel = p.relative_to(root).parts
        files["/".join(("<run>", *rel[1:]))] = p.read_text()
    return files


def _env_names(r: Result) -> object:
    names = set()
    for p in (r.work / "touched").iterdir():
        names |= {n for n in p.read_text().split() if TORCH_ENV.match(n)}
    return sorted(names)


def _touched_contents(r: Result) -> object:
    d = r.work / "touched"
    return {p.name: p.read_text() for p in sorted(d.iterdir())} if d.is_dir() else {}


def _file(name: str) -> Callable[[Result], object]:
    return lambda r: (r.work / name).read_text() if (r.work / name).exists() else None


def scenarios() -> list[Scenario]:
    sh = ["--no-python", "{w}/touch.sh", "{touched}"]
    py = ["{w}/touch.py", "--touch-file-dir={touched}"]
    base = ["--nnodes=1", "--rdzv-id={id}", "--monitor-interval=1", "--start-method=spawn"]
    elastic = ["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:{port}", "--rdzv-id={id}", "--monitor-interval=1"]
    usage = {"differs": "usage-exit", "expect_exit": (1, 2)}
    return [
        Scenario("python", [*base, "--nproc-per-node=4", *py], _touched, source="test_launch_user_script_python"),
        Scenario("caffe2-bc", ["--nnodes=1", "--nproc-per-node=4", "--monitor-interval=1", "--master-addr=localhost",
                               "--master-port={port}", "--node-rank=0", *py], _touched, source="test_launch_user_script_python_caffe2_bc"),
        Scenario("bash", [*base, "--nproc-per-node=4", *sh], _touched, source="test_launch_user_script_bash"),
        Scenario("no-python-with-module", [*base, "--nproc-per-node=4", "--no-python", "--module", "{w}/touch.sh", "{touched}"],
                 source="test_launch_user_script_bash", **usage),
        Scenario("default-nproc", [*base, *sh], _touched, source="test_launch_user_script_default_nproc"),
        Scenario("pet-env", ["{w}/touch.sh", "{touched}"], _touched, source="test_launch_with_env_vars",
                 env={"PET_NNODES": "1", "PET_NPROC_PER_NODE": "4", "PET_RDZV_ID": "{id}", "PET_MONITOR_INTERVAL": "1",
                      "PET_NO_PYTHON": "1", "PET_MODULE": "0"}),
        Scenario("pet-env-module", ["{w}/touch.sh", "{touched}"], source="test_launch_with_env_vars",
                 env={"PET_NNODES": "1", "PET_NPROC_PER_NODE": "4", "PET_NO_PYTHON": "1", "PET_MODULE": "1"}, **usage),
        Scenario("nproc-auto", [*base, "--nproc-per-node=auto", *sh], _touched, source="test_nproc_launch_auto_configurations"),
        Scenario("nproc-unknown", [*base, "--nproc-per-node=unknown", *sh], source="test_nproc_launch_unknown_configurations", **usage),
        Scenario("elastic", [*elastic, "--nproc-per-node=4", "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", *py],
                 _touched, source="test_launch_elastic"),
        Scenario("worker-raises", [*elastic, "--nproc-per-node=4", "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
                                   "--max-restarts=0", "{w}/touch.py", "--fail"],
                 source="test_launch_elastic_worker_raise_exception"),
        Scenario("standalone", ["--nnodes=1", "--nproc-per-node=4", "--standalone", "--monitor-interval=1", *py], _touched,
                 source="test_launch_standalone"),
        Scenario("run-path", ["--run-path", "--nnodes=1", "--nproc-per-node=4", "--monitor-interval=1", *py], _touched,
                 source="test_launch_run_path"),
        Scenario("multiple-agents", [*elastic, "--nproc-per-node=4", "--rdzv_conf=timeout=30", *py], _touched, agents=2,
                 source="test_launch_elastic_multiple_agents"),
        Scenario("nnodes-bad", ["--nnodes=2:20:30", "--nproc-per-node=1", *py], source="test_min_max_nodes_parse", **usage),
        Scenario("is-torchelastic-launched", ["--run-path", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=1",
                                              "{w}/launched.py", "--out-file={w}/out"], _file("out"), source="test_is_torchelastic_launched"),
        Scenario("logs-specs-default", ["--nnodes=1", "--nproc-per-node=1", "--monitor-interval=1", "--logs_specs=default",
                                        "{w}/launched.py", "--out-file={w}/out"], _file("out"),
                 source="test_is_torchelastic_launched_with_logs_spec_defined"),
        Scenario("logs-specs-missing", ["--nnodes=1", "--nproc-per-node=1", "--logs_specs=DOESNOT_EXIST", "{w}/launched.py",
                                        "--out-file={w}/out"], source="test_logs_logs_spec_entrypoint_must_be_defined", **usage),
        Scenario("init-method-tcp", ["--run-path", "--nnodes=1", "--nproc-per-node=4", "--master-addr=localhost", "--master-port={port}",
                                     "--monitor-interval=1", "{w}/init.py", "--init-method=tcp://localhost:{port}"],
                 source="test_init_method_tcp_with_torchelastic"),
        Scenario("init-method-env", ["--run-path", "--nnodes=1", "--nproc-per-node=4", "--master-addr=localhost", "--master-port={port}",
                                     "--monitor-interval=1", "{w}/init.py", "--init-method=env://"], source="test_init_method_env_with_torchelastic"),
        Scenario("capture-logs", [*base, "--nproc-per-node=4", "--redirect=3", "--tee=3", *sh], _creating_lines,
                 env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}, source="test_capture_logs_using_default_logs_specs"),
        # Beyond torch's tests: what a new user tried.
        Scenario("log-dir-files", [*base, "--nproc-per-node=2", "--redirects=3", "--log-dir={w}/logs", *sh], _log_dir),
        Scenario("tee-filter-files", [*base, "--nproc-per-node=3", "--tee=1", "--local-ranks-filter=0,2", "--log-dir={w}/logs", *sh],
                 _log_dir),
        Scenario("console-lines", [*base, "--nproc-per-node=16", *sh], _creating_lines_unprefixed, differs="console-prefix"),
        Scenario("worker-env", [*base, "--nproc-per-node=2", "--no-python", "{w}/env.sh", "{touched}"], _env_names),
        Scenario("raise-once-restarts", [*base, "--nproc-per-node=2", "--max-restarts=1", *py, "--fail-first-attempt"],
                 differs="user-error-stops", expect_exit=(0, 1)),
        Scenario("worker-env-values", [*base, "--nproc-per-node=2", "--max-restarts=2", "{w}/env_values.py", "{touched}"],
                 _touched_contents, trainguard_flags=["--restart-on-error"]),
        Scenario("raise-once-restart-on-error", [*base, "--nproc-per-node=2", "--max-restarts=1", *py, "--fail-first-attempt"],
                 _touched, trainguard_flags=["--restart-on-error"]),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(launcher: str, args: list[str], trainguard_flags: list[str]) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *args]
    return [sys.executable, "-m", "trainguard", "run", *trainguard_flags, *args]


def run_one(sc: Scenario, launcher: str, work: Path) -> Result:
    work.mkdir(parents=True)
    (work / "touched").mkdir()
    (work / "tmp").mkdir()
    for name, text in SCRIPTS.items():
        (work / name).write_text(text)
        (work / name).chmod(0o755)
    fill = {"touched": str(work / "touched"), "port": str(_free_port()), "port2": str(_free_port()),
            "id": uuid.uuid4().hex[:12], "w": str(work)}  # fmt: skip
    args = [a.format(**fill) if "{" in a and "rdzv-conf" not in a else a for a in sc.args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.update({k: v.format(**fill) if "${" not in v else v for k, v in sc.env.items()})
    env.update({"TEST_SENTINEL_PARENT": "FOOBAR", "TMPDIR": str(work / "tmp")})
    cmd = command(launcher, args, sc.trainguard_flags if launcher == "trainguard" else [])
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(sc.agents)]  # fmt: skip
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=TIMEOUT_S))
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill(q)
            outs.append(("", f"timed out after {TIMEOUT_S:.0f} s"))
    seconds = time.monotonic() - t0
    code = max((p.returncode for p in procs), key=lambda c: c != 0)
    return Result(launcher, code, "".join(o for o, _ in outs), "".join(e for _, e in outs), work, seconds)


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def judge(sc: Scenario, results: dict[str, Result]) -> list[str]:
    """What differs between the launchers beyond the scenario's documented difference."""
    tr, tg = results["torchrun"], results["trainguard"]
    problems = []
    if sc.expect_exit is not None:
        if (tr.code, tg.code) != sc.expect_exit:
            problems.append(f"exit torchrun {tr.code}, trainguard {tg.code}; documented: {sc.expect_exit}")
        if sc.differs == "usage-exit" and len(tg.err.strip().splitlines()) != 1:
            problems.append(f"trainguard's bad-input message is not one line: {tg.err.strip()[-500:]!r}")
    elif (tr.code == 0) != (tg.code == 0) or tr.code != tg.code:
        problems.append(f"exit torchrun {tr.code}, trainguard {tg.code}")
    if sc.observe is not None:  # each in its own work dir: the paths in what they observed are made the same
        a, b = (repr(sc.observe(r)).replace(str(r.work), "<w>") for r in (tr, tg))
        if a != b:
            problems.append(f"torchrun observed {str(a)[:300]!s}, trainguard {str(b)[:300]!s}")
    empty = [p.name for p in (tg.work / "tmp").glob("torchelastic_*") if not any(f.is_file() for f in p.rglob("*"))]
    if empty:  # torch's files without --log-dir land in one (as with torchrun); an empty one is litter
        problems.append(f"trainguard left the empty {empty} in TMPDIR")
    return problems


def run_scenario(sc: Scenario, root: Path) -> tuple[dict[str, Result], list[str]]:
    results = {name: run_one(sc, name, root / sc.name / name) for name in LAUNCHERS}
    return results, judge(sc, results)


TINY_JOBS = {
    "tiny": ["--nproc-per-node=1", "{w}/touch.py"],  # one worker that returns at once, no torch in it
    "tiny-gloo": ["--nproc-per-node=2", "{w}/init.py", "--init-method=env://"],  # imports torch, one gloo barrier
}


def overhead(n: int, root: Path, job: str) -> dict[str, list[float]]:
    """Launch -> exit of a tiny job, n times with each launcher, alternating."""
    sc = Scenario(job, TINY_JOBS[job])
    times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    for i in range(n):
        for name in LAUNCHERS:
            r = run_one(sc, name, root / f"{job}-{i}" / name)
            if r.code != 0:
                raise SystemExit(f"{name} failed the {job} job: {r.err[-2000:]}")
            times[name].append(r.seconds)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--overhead", type=int, default=0, metavar="N", help="also time N launches of a tiny job with each")
    ap.add_argument("--keep", default=None, help="keep the work dirs under this directory")
    args = ap.parse_args()
    chosen = [s for s in scenarios() if not args.only or s.name in args.only.split(",")] if args.only != "none" else []
    root = Path(tempfile.mkdtemp(prefix="tgconf-", dir=args.keep))
    failed, shown, walls = 0, set(), {name: [] for name in LAUNCHERS}
    print(f"{'scenario':<30} {'torchrun':>9} {'trainguard':>11}  result")
    for sc in chosen:
        results, problems = run_scenario(sc, root)
        for name, r in results.items():
            walls[name].append(r.seconds)
        verdict = "same" if not problems else "DIFFERENT: " + "; ".join(problems)
        if not problems and sc.differs:
            verdict, _ = f"same but the documented difference [{sc.differs}]", shown.add(sc.differs)
        failed += bool(problems)
        tr, tg = results["torchrun"], results["trainguard"]
        print(f"{sc.name:<30} {tr.code:>3} {tr.seconds:5.1f}s {tg.code:>5} {tg.seconds:5.1f}s  {verdict}", flush=True)
    print("\ndocumented differences shown:")
    for key, text in DIFFERENCES.items():
        print(f"  [{key}] {text}" + ("" if key in shown else "  (no scenario ran that shows it)"))
    ratios = [b / a for a, b in zip(walls["torchrun"], walls["trainguard"], strict=True) if a > 0]
    if ratios:
        print(f"\nlaunch -> exit, trainguard/torchrun per scenario: median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    for job in TINY_JOBS if args.overhead else ():
        t = overhead(args.overhead, root, job)
        tr, tg = statistics.median(t["torchrun"]), statistics.median(t["trainguard"])
        print(f"{job} job launch -> exit, {args.overhead} each: torchrun median {tr:.2f} s, trainguard median {tg:.2f} s, "
              f"ratio {tg / tr:.2f}x", flush=True)
    if args.keep is None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{len(chosen) - failed}/{len(chosen)} scenarios as torchrun (documented differences aside)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
