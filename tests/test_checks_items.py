"""Pre-flight check items: seed names and thresholds, `item` lines, and `trainguard check`."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tgtest import tmpfs

from trainguard.checks import items as I
from trainguard.checks import kernel_log
from trainguard.probes import nvml


def cfg(**kw) -> I.CheckConfig:
    base = dict(hostfile_globs=[], cache_path="/nonexistent-cache")
    base.update(kw)
    return I.CheckConfig(**base)


def by_name(results):
    return {r.item: r for r in results}


def run_cli(*args, env=None):
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "check", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=60,
    )


# ------------------------------------------------------------------------- names and lines


def test_all_seed_items_run_with_seed_names_and_defaults():
    c = I.CheckConfig()
    assert (c.root_min_gb, c.shm_min_gb, c.cache_min_gb) == (32.0, 1.0, 32.0)
    assert (c.ulimit_memlock_kb, c.ulimit_nofile, c.ulimit_stack_kb, c.ulimit_nproc) == (
        16000,
        1000000,
        8000,
        1000000,
    )
    results = I.run_checks(cfg())
    assert [r.item for r in results] == I.ITEM_NAMES
    for r in results:
        assert r.line().startswith(f"item {r.item} ... {r.status} (")
        assert r.status in (I.OK, I.FAILED, I.WARNING, I.SKIPPED)


def test_failed_line_says_what_to_do():
    r = I.ItemResult("dns", I.FAILED, "1 of 1 name(s) do not resolve: x", fix="check /etc/hosts")
    assert r.line() == "item dns ... failed (1 of 1 name(s) do not resolve: x); what to do: check /etc/hosts"
    assert I.ItemResult("dns", I.OK, "fine", fix="ignored").line() == "item dns ... ok (fine)"


def test_this_machine_passes_by_default_in_a_fraction_of_a_second():
    results = I.run_checks(cfg(cache_path="/cache"))
    assert I.passed(results), [r.line() for r in results if r.failed]
    # The pre-check runs before every job: report its cost (measured, not asserted).
    print("pre-check seconds:", round(sum(r.seconds for r in results), 4))


def test_a_crashing_item_becomes_a_warning_not_a_failure(monkeypatch):
    monkeypatch.setattr(I, "check_ulimit", lambda c: 1 / 0)
    r = by_name(I.run_checks(cfg()))["ulimit"]
    assert r.status == I.WARNING and "ZeroDivisionError" in r.detail


def test_skip_leaves_items_out():
    res = by_name(I.run_checks(cfg(skip={"disk-size", "gpu-check"})))
    assert all(
        res[n].status == I.SKIPPED
        for n in ("disk-size root", "disk-size shm", "disk-size cache", "gpu-check")
    )


# -------------------------------------------------------------------------------- disk-size


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 2 MB filesystem (needs root, as in the dev container)."""
    with tmpfs(tmp_path / "small", "2M") as mnt:
        yield mnt


def test_disk_thresholds_on_a_small_tmpfs(small_tmpfs):
    res = by_name(
        I.run_checks(cfg(root_path=str(small_tmpfs), shm_path=str(small_tmpfs), cache_path=str(small_tmpfs)))
    )
    for name in ("disk-size root", "disk-size shm", "disk-size cache"):
        assert res[name].status == I.FAILED, res[name].line()
        assert "MB free at" in res[name].detail and "what to do" in res[name].line()
    assert "need > 32 GB" in res["disk-size root"].detail
    assert "need > 1 GB" in res["disk-size shm"].detail
    low = by_name(I.run_checks(cfg(root_path=str(small_tmpfs), root_min_gb=0.001)))
    assert low["disk-size root"].status == I.OK  # 2 MB > 1 MB
    # Filling the disk turns the same threshold into a failure.
    (small_tmpfs / "fill").write_bytes(b"\0" * 1_500_000)
    full = by_name(I.run_checks(cfg(root_path=str(small_tmpfs), root_min_gb=0.001)))
    assert full["disk-size root"].status == I.FAILED


def test_check_cli_exit_code_and_threshold_flags(small_tmpfs):
    bad = run_cli("--root-dir", str(small_tmpfs))
    assert bad.returncode == 1
    assert "item disk-size root ... failed" in bad.stdout and "check failed: disk-size root" in bad.stdout
    good = run_cli("--root-dir", str(small_tmpfs), "--check-disk-root-gb", "0.001")
    assert good.returncode == 0, good.stdout
    assert "item disk-size root ... ok" in good.stdout


def test_cache_dir_absent_is_skipped_present_is_checked(tmp_path):
    assert by_name(I.run_checks(cfg()))["disk-size cache"].status == I.SKIPPED
    r = by_name(I.run_checks(cfg(cache_path=str(tmp_path), cache_min_gb=0.0)))["disk-size cache"]
    assert r.status == I.OK and str(tmp_path) in r.detail


def test_root_path_missing_fails():
    r = I.check_disk("root", "/no/such/dir", 1.0, "--check-disk-root-gb")
    assert r.status == I.FAILED


# -------------------------------------------------------------------------------------- dns


def test_dns_resolves_host_file_names_and_endpoints(tmp_path):
    hostfile = tmp_path / "worker.host"
    hostfile.write_text("localhost\n# comment\n127.0.0.1 localhost\n")
    r = I.check_dns(
        cfg(hostfile_globs=[str(tmp_path / "*.host")], endpoints=["localhost:29500", "10.0.0.1:1"])
    )
    assert r.status == I.OK and r.data["resolved"] == {"localhost": r.data["resolved"]["localhost"]}


def test_dns_names_what_does_not_resolve(tmp_path):
    (tmp_path / "w.host").write_text("localhost\nno-such-host.invalid\n")
    r = I.check_dns(cfg(hostfile_globs=[str(tmp_path / "*.host")]))
    assert r.status == I.FAILED and r.data["unresolved"] == ["no-such-host.invalid"]
    assert "item dns ... failed" in r.line()


def test_dns_without_names_is_skipped():
    assert I.check_dns(cfg()).status == I.SKIPPED


@pytest.mark.parametrize("ep,host", [("a:1", "a"), ("a", "a"), ("[::1]:5", "::1"), ("::1", "::1")])
def test_endpoint_host(ep, host):
    assert I.endpoint_host(ep) == host


# ----------------------------------------------------------------------------------- ulimit


def test_ulimit_only_with_infiniband_unless_forced(tmp_path):
    assert I.check_ulimit(cfg(ib_class_dir=str(tmp_path / "none"))).status == I.SKIPPED
    ib = tmp_path / "ib"
    (ib / "mlx5_0").mkdir(parents=True)
    r = I.check_ulimit(cfg(ib_class_dir=str(ib)))
    assert r.status in (I.OK, I.FAILED) and r.status != I.SKIPPED
    assert set(r.data) == {"max locked memory", "open files", "stack size", "max user processes"}


def test_ulimit_thresholds_against_this_process():
    soft_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    high = I.check_ulimit(
        cfg(ulimit_mode="always", ulimit_memlock_kb=0, ulimit_nofile=0, ulimit_stack_kb=0, ulimit_nproc=0)
    )
    assert high.status == I.OK
    low = I.check_ulimit(
        cfg(
            ulimit_mode="always",
            ulimit_memlock_kb=0,
            ulimit_nofile=soft_nofile,
            ulimit_stack_kb=0,
            ulimit_nproc=0,
        )
    )
    assert low.status == I.FAILED  # the seed's rule is strictly greater
    assert f"open files {soft_nofile} (need > {soft_nofile})" in low.detail and "ulimit -n" in low.fix


# -------------------------------------------------------------------------------- gpu-check


def test_gpu_check_without_gpus_is_clean():
    if nvml.available() and nvml.device_count():
        pytest.skip("this machine has GPUs")
    r = I.check_gpu(cfg(), {})
    assert r.status == I.SKIPPED and "not requested" in r.detail
    req = I.check_gpu(cfg(gpu_mode="require", nproc_per_node=2), {})
    assert req.status == I.FAILED and "nvidia-smi" in req.fix
    assert I.check_gpu(cfg(gpu_mode="off"), {}).status == I.SKIPPED
    assert nvml.utilization([0]) is None and nvml.health() is None
    assert nvml.unavailable_reason()


def test_a_gpu_job_on_a_node_without_gpus_fails_gpu_check_by_default():
    """Under the default --check-gpu auto, --nproc-per-node gpu asks for GPUs: a node where NVML sees
    none fails the item (not "skipped"), through the function and through `trainguard check`."""
    if nvml.available() and nvml.device_count():
        pytest.skip("this machine has GPUs")
    r = I.check_gpu(cfg(gpus_requested="--nproc-per-node gpu"), {})
    assert r.status == I.FAILED, r.line()
    assert r.detail.startswith("GPUs were requested (--nproc-per-node gpu) but NVML sees none: ")
    assert I.check_gpu(cfg(gpus_requested="--nproc-per-node gpu", gpu_mode="off"), {}).status == I.SKIPPED
    out = run_cli("--nproc-per-node", "gpu", "--skip", "ulimit")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "item gpu-check ... failed (GPUs were requested (--nproc-per-node gpu) but NVML sees none: " in out.stdout
    assert "check failed: gpu-check" in out.stdout
    plain = run_cli("--nproc-per-node", "2", "--skip", "ulimit")
    assert "item gpu-check ... skipped" in plain.stdout  # a number of processes may be CPU workers
    bad = run_cli("--nproc-per-node", "gpus")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_visible_gpus_follow_cuda_visible_devices():
    gpus = [nvml.GpuHealth(i, uuid=f"GPU-{i}aaa") for i in range(4)]
    assert I.visible_gpu_indices(gpus, {}) == [0, 1, 2, 3]
    assert I.visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "2,0"}) == [2, 0]
    assert I.visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert I.visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "1,7,2"}) == [1]
    assert I.visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "GPU-3"}) == [3]


def test_gpu_check_reports_faults_count_and_xids(monkeypatch):
    sick = nvml.GpuHealth(1, faults=["GPU 1: 3 uncorrectable ECC error(s) since driver load"])
    monkeypatch.setattr(nvml, "health", lambda indices=None: [nvml.GpuHealth(0), sick])
    monkeypatch.setattr(nvml, "driver_version", lambda: "550.0")
    monkeypatch.setattr(
        kernel_log, "read_xids", lambda window_s=None: [kernel_log.XidEvent(79, "PCI:0000:3b:00", "", 60.0)]
    )
    r = I.check_gpu(cfg(nproc_per_node=2), {})
    assert r.status == I.FAILED and "ECC" in r.detail and "Xid 79 (GPU has fallen off the bus)" in r.detail
    monkeypatch.setattr(nvml, "health", lambda indices=None: [nvml.GpuHealth(0)])
    monkeypatch.setattr(kernel_log, "read_xids", lambda window_s=None: None)
    few = I.check_gpu(cfg(nproc_per_node=2), {})
    assert few.status == I.WARNING and "1 GPU(s) visible but --nproc-per-node is 2" in few.detail
    assert "Xid errors not checked" in few.detail
    assert I.check_gpu(cfg(nproc_per_node=2, gpu_mode="require"), {}).status == I.FAILED
    assert I.check_gpu(cfg(nproc_per_node=1), {}).status == I.OK
    assert not I.hardware_check(cfg(), {}).faults


def test_kernel_log_xid_parsing():
    rec = "3,1234,5000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus."
    ev = kernel_log.parse_kmsg_record(rec, now_us=65_000_000)
    assert ev == kernel_log.XidEvent(79, "PCI:0000:3b:00", "pid=4242, GPU has fallen off the bus.", 60.0)
    assert ev.hardware
    assert not kernel_log.parse_kmsg_record(
        "6,1,1,-;NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception", None
    ).hardware
    assert kernel_log.parse_kmsg_record("6,1,1,-;eth0: link up", None) is None
    assert kernel_log.read_xids("/no/such/kmsg") is None
    real = kernel_log.read_xids()  # this machine's kernel log: readable or not, never raises
    assert real is None or all(isinstance(x, kernel_log.XidEvent) for x in real)


# ------------------------------------------------------------------------------------- rdma


def fake_ib_tree(root: Path, ports: dict[str, tuple[str, str]]) -> Path:
    """A sysfs-like /sys/class/infiniband: {"mlx5_0/1": (state, phys_state)}."""
    for name, (state, phys) in ports.items():
        dev, port = name.split("/")
        d = root / dev / "ports" / port
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "phys_state").write_text(phys + "\n")
    return root


def test_rdma_ports_up_pass_and_a_down_port_fails_named(tmp_path):
    healthy = fake_ib_tree(tmp_path / "ok", {"mlx5_0/1": ("4: ACTIVE", "5: LinkUp"), "mlx5_1/1": ("4: ACTIVE", "5: LinkUp")})
    r = I.check_rdma(cfg(ib_class_dir=str(healthy)))
    assert r.status == I.OK and "2 RDMA port(s) ACTIVE and LinkUp: mlx5_0/1, mlx5_1/1" in r.detail
    down = fake_ib_tree(tmp_path / "down", {"mlx5_0/1": ("4: ACTIVE", "5: LinkUp"), "mlx5_1/1": ("1: DOWN", "2: Polling"),
                                            "mlx5_2/1": ("2: INIT", "5: LinkUp")})
    r = I.check_rdma(cfg(ib_class_dir=str(down)))
    assert r.status == I.FAILED, r.line()
    assert "2 of 3 RDMA port(s) not up" in r.detail
    assert "mlx5_1/1 state '1: DOWN', phys_state '2: Polling'" in r.detail and "mlx5_2/1 state '2: INIT'" in r.detail
    assert "mlx5_0/1" not in r.detail and "ibstat" in r.fix
    none = I.check_rdma(cfg(ib_class_dir=str(tmp_path / "absent")))
    assert none.status == I.SKIPPED and "no RDMA device" in none.detail
    out = run_cli("--ib-dir", str(down), "--skip", "ulimit")
    assert out.returncode == 1 and "item rdma ... failed (2 of 3 RDMA port(s) not up: " in out.stdout
    assert "item rdma ... ok" in run_cli("--ib-dir", str(healthy), "--ulimit", "never").stdout


# --------------------------------------------------------------------------------- nccl-env


def test_nccl_env_lint():
    ifaces, ib = ["lo", "eth0", "eth1"], []
    assert I.lint_nccl_env({}, ifaces, ib) == ([], [])
    errs, _ = I.lint_nccl_env({"NCCL_SOCKET_IFNAME": "ib0"}, ifaces, ib)
    assert errs and "matches no interface" in errs[0]
    assert I.lint_nccl_env({"NCCL_SOCKET_IFNAME": "eth"}, ifaces, ib) == ([], [])  # prefix match
    assert I.lint_nccl_env({"NCCL_SOCKET_IFNAME": "=eth"}, ifaces, ib)[0]  # exact: no "eth"
    assert I.lint_nccl_env({"NCCL_SOCKET_IFNAME": "^lo,docker"}, ifaces, ib) == ([], [])
    assert I.lint_nccl_env({"NCCL_SOCKET_IFNAME": "^lo,eth"}, ifaces, ib)[0]  # excludes everything
    assert I.lint_nccl_env({"GLOO_SOCKET_IFNAME": "eth9"}, ifaces, ib)[0]
    assert I.lint_nccl_env({"NCCL_TOPO_FILE": "/no/such.xml"}, ifaces, ib)[0]
    _, warns = I.lint_nccl_env(
        {
            "NCCL_DEBUG": "info",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_ALGO": "Ring",
            "NCCL_ASYNC_ERROR_HANDLING": "1",
        },
        ifaces,
        ib,
    )
    assert len(warns) == 4
    assert I.lint_nccl_env({"NCCL_IB_HCA": "mlx5_9"}, ifaces, ["mlx5_0"])[0]
    assert I.lint_nccl_env({"NCCL_IB_DISABLE": "1"}, ifaces, ["mlx5_0"])[1]


def test_nccl_env_item_statuses():
    assert I.check_nccl_env(cfg(), {}).status == I.OK
    assert I.check_nccl_env(cfg(), {"NCCL_DEBUG": "INFO"}).status == I.WARNING
    bad = I.check_nccl_env(cfg(), {"NCCL_SOCKET_IFNAME": "nope0"})
    assert bad.status == I.FAILED and "unset or correct" in bad.fix


# ------------------------------------------------------------------ master-port, cuda-toolkit


def test_master_port_free_and_taken():
    assert I.check_master_port(cfg()).status == I.SKIPPED
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        taken = I.check_master_port(cfg(master_addr="127.0.0.1", master_port=port))
        assert taken.status == I.FAILED and f"sport = :{port}" in taken.fix
    assert I.check_master_port(cfg(master_addr="127.0.0.1", master_port=port)).status == I.OK
    assert I.check_master_port(cfg(master_addr="192.0.2.1", master_port=port)).status == I.SKIPPED


def test_cuda_toolkit(tmp_path):
    assert I.check_cuda_toolkit(cfg(), {"PATH": str(tmp_path)}).status == I.SKIPPED
    assert I.check_cuda_toolkit(cfg(require_cuda_toolkit=True), {"PATH": str(tmp_path)}).status == I.FAILED
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    r = I.check_cuda_toolkit(cfg(require_cuda_toolkit=True), {"CUDA_HOME": str(tmp_path), "PATH": ""})
    assert r.status == I.OK and "release 12.4" in r.detail


# ------------------------------------------------------------------------------------- CLI


def test_check_cli_lines_json_and_usage(tmp_path):
    out = run_cli("--cache-dir", str(tmp_path), "--check-disk-cache-gb", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("item ")]
    assert [ln.split(" ... ")[0][5:] for ln in lines] == I.ITEM_NAMES
    assert "item disk-size cache ... ok" in out.stdout
    js = run_cli("--json", "--gpu", "require")
    data = json.loads(js.stdout)
    gpu = next(i for i in data["items"] if i["item"] == "gpu-check")
    if gpu["status"] == "failed":
        assert js.returncode == 1 and data["passed"] is False
    env_bad = run_cli("--skip", "gpu-check", env={"NCCL_SOCKET_IFNAME": "nope0"})
    assert env_bad.returncode == 1 and "item nccl-env ... failed" in env_bad.stdout
    usage = run_cli("--gpu", "maybe")
    assert usage.returncode == 2 and usage.stderr.count("\n") == 1


def test_hostfile_flag(tmp_path):
    (tmp_path / "a.host").write_text("no-such-host.invalid\n")
    out = run_cli("--hostfile", str(tmp_path / "*.host"))
    assert out.returncode == 1 and "item dns ... failed" in out.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU")
def test_real_gpu_is_seen_through_nvml():
    n = nvml.device_count()
    assert n and n > 0
    util = nvml.utilization(list(range(n)))
    assert util is not None and all(0 <= u <= 100 for u in util)
    r = I.check_gpu(cfg(gpu_mode="require", nproc_per_node=1), os.environ)
    assert r.status in (I.OK, I.FAILED), r.line()
    assert Path("/dev/nvidia0").exists() or r.data["gpus"]


class FakeNVML:
    """The slice of the pynvml API that probes/nvml.py calls, with one sick GPU."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1

    class NVMLError(Exception):
        pass

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        assert (kind, counter) == (1, 0)
        return 2 if h == 1 else 0

    def nvmlDeviceGetRetiredPages(self, h, cause):
        return [0x1000] if h == 1 else []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        raise self.NVMLError("Not Supported")  # Ampere+: row remapping instead

    def nvmlDeviceGetRemappedRows(self, h):
        return (0, 1, 0, 1) if h == 1 else (0, 0, 0, 0)

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("Util", (), {"gpu": 40 + h, "memory": 5})()

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"


def test_nvml_probe_reads_health_and_utilisation_through_the_pynvml_api(monkeypatch):
    monkeypatch.setattr(nvml, "_nv", FakeNVML())
    monkeypatch.setitem(nvml._state, "initialised", False)
    try:
        assert nvml.available() and nvml.device_count() == 2 and nvml.unavailable_reason() is None
        assert nvml.utilization([0, 1]) == [40.0, 41.0]
        assert nvml.utilization([5]) == [45.0]
        good, sick = nvml.health()
        assert good.faults == [] and good.name == "NVIDIA H100" and good.retired_pages_pending is None
        assert sick.ecc_uncorrected_volatile == 2 and sick.retired_pages_dbe == 1 and sick.remap_failed
        assert len(sick.faults) == 2
        assert nvml.driver_version() == "550.54.15"
        r = I.check_gpu(cfg(nproc_per_node=2), {"CUDA_VISIBLE_DEVICES": "0"})
        assert r.status == I.WARNING  # the sick GPU is not visible to the job; one GPU for two ranks
        assert I.check_gpu(cfg(nproc_per_node=2), {}).status == I.FAILED
        assert not I.hardware_check(cfg(), {}).healthy
    finally:
        nvml._state["initialised"] = False


def test_check_refuses_unknown_items_bad_ports_and_binary_host_files(tmp_path, capsys):
    """An unknown --skip and `localhost:notaport` were accepted; a binary host
    file was read as host names."""
    from trainguard.checks.items import CheckConfig, check_dns
    from trainguard.cli import main as cli_main

    for argv in (["--skip", "bogus"], ["--rdzv-endpoint", "localhost:notaport"], ["--rdzv-endpoint", "[::1]:0"]):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["check", *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error" in err[0], err
    hosts = tmp_path / "job.host"
    hosts.write_bytes(b"node-1\x00\xff\xfe\x89PNG\r\n")
    r = check_dns(CheckConfig(hostfile_globs=[str(hosts)]))
    assert r.status == "failed" and "not a text host file" in r.detail, r
    hosts.write_text("node-1 node-2\n")
    assert "not a" not in check_dns(CheckConfig(hostfile_globs=[str(hosts)], dns_timeout_s=1)).detail
