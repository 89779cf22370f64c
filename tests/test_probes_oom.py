"""OOM-killer evidence: parsing of the kernel's counters, and the before/after comparison."""

from __future__ import annotations

import os

from trainguard.probes import oom

VMSTAT = "nr_free_pages 1234\npgfault 99\noom_kill 3\nnr_unstable 0\n"
EVENTS_V2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n"
CONTROL_V1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n"


def test_parsers_read_the_oom_kill_field():
    assert oom.parse_vmstat(VMSTAT) == 3
    assert oom.parse_memory_events(EVENTS_V2) == 1
    assert oom.parse_oom_control(CONTROL_V1) == 4
    assert oom.parse_vmstat("pgfault 1\n") is None  # kernels before 4.13 have no counter
    assert oom.parse_oom_control("oom_kill abc\n") is None


def test_counter_files_for_v1_v2_and_hybrid_hierarchies():
    v2 = oom.counter_files("0::/system.slice/job.scope\n", "/cg")
    assert v2 == [
        "/cg/system.slice/job.scope/memory.events",
        "/cg/unified/system.slice/job.scope/memory.events",
    ]
    v1 = oom.counter_files("4:memory:/process_api/abc\n3:cpuset:/\n0::/\n", "/cg")
    assert "/cg/memory/process_api/abc/memory.oom_control" in v1
    assert oom.counter_files("2:cpu,memory:/a\n", "/cg") == ["/cg/memory/a/memory.oom_control"]
    assert oom.counter_files("garbage\n1:memory:relative\n0::/../../etc\n", "/cg") == []


def test_cgroup_counters_decide_and_vmstat_only_without_them():
    cg = "/sys/fs/cgroup/memory/job/memory.oom_control"
    before = oom.OomCounters({cg: 0, oom.VMSTAT: 10})
    host_only = oom.compare(before, oom.OomCounters({cg: 0, oom.VMSTAT: 11}))
    assert not host_only.moved  # another process on the host was OOM-killed, not ours
    ours = oom.compare(before, oom.OomCounters({cg: 2, oom.VMSTAT: 12}))
    assert ours.moved and ours.delta == 2 and ours.sources == [cg]
    no_cgroup = oom.compare(oom.OomCounters({oom.VMSTAT: 5}), oom.OomCounters({oom.VMSTAT: 6}))
    assert no_cgroup.moved and no_cgroup.sources == [oom.VMSTAT]
    unreadable = oom.compare(oom.OomCounters({}), oom.OomCounters({}))
    assert not unreadable.moved and unreadable.checked == []
    assert set(ours.to_dict()) == {"moved", "delta", "sources", "checked"}


def test_reader_reads_this_machines_counters_without_raising():
    files = oom.files_for([os.getpid(), 2**22 + 12345])  # a pid that does not exist is ignored
    assert files[-1] == oom.VMSTAT
    counters = oom.read_counters(files + ["/nonexistent/memory.events"])
    assert all(isinstance(v, int) for v in counters.values.values())
    oom.compare(counters, oom.read_counters(files))  # reading again works (a live host may OOM meanwhile)
