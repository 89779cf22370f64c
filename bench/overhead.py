"""Cost of trainguard's zero-code profiling in a worker: step time with and without it, and one span.

    python bench/overhead.py [--repeats 7] [--steps 300] [--hidden 1024]

Runs a small CPU training loop (DataLoader -> MLP forward -> backward -> SGD step) in fresh
processes, alternating plain and instrumented runs (bootstrap installed as under
``trainguard run``, profiling on), and prints the median step time of each, the overhead in % and
in µs per step, and the cost of one ``trainguard.span()`` (with an empty context manager measured
in the same process as the peer). Nothing drains the ring here: the writer never waits on a reader.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(steps: int, hidden: int, instrument: bool) -> dict:
    if instrument:
        from trainguard.worker import bootstrap

        bootstrap.install()
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(64 * 64, 256), torch.randn(64 * 64, 1))
    loader = DataLoader(data, batch_size=64, shuffle=True)

    def batches():
        while True:
            yield from loader

    it = batches()

    def run(n: int) -> list[int]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            x, y = next(it)  # the DataLoader wait is part of the step
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter_ns() - t0)
        return times

    run(steps // 5)  # warm-up (and the forward hooks' calibration step)
    out = {"step_us": statistics.median(run(steps)) / 1e3}
    if instrument:
        from trainguard.worker import spans

        rec = spans.recorder()
        assert rec is not None and rec.flags() & 1, "profiling not on"
        w0, s0 = rec.writer.write_index, rec.steps
        run(steps // 5)
        out["records_per_step"] = (rec.writer.write_index - w0) / (rec.steps - s0)
        # Same process, switch flipped in alternating blocks: the cost of recording itself.
        on, off = [], []
        for _ in range(6):
            rec.writer.u32[4] = 0
            off += run(steps // 10)
            rec.writer.u32[4] = 1
            on += run(steps // 10)
        out["switch_on_us"] = statistics.median(on) / 1e3
        out["switch_off_us"] = statistics.median(off) / 1e3
        out.update(_span_cost())
    return out


def _span_cost(n: int = 200_000) -> dict:
    import trainguard
    from trainguard.worker import spans

    class Empty:
        __slots__ = ()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    assert spans.recorder() is not None and spans.recorder().flags() & 1, "profiling not on"
    span = trainguard.span
    best_span, best_empty = [], []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            with span("bench"):
                pass
        best_span.append((time.perf_counter_ns() - t0) / n / 1e3)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            with Empty():
                pass
        best_empty.append((time.perf_counter_ns() - t0) / n / 1e3)
    return {"span_us": min(best_span), "empty_cm_us": min(best_empty)}


def run_child(steps: int, hidden: int, instrument: bool, prefix: str) -> dict:
    env = dict(os.environ)
    env.pop("TRAINGUARD_RING_PREFIX", None)
    if instrument:
        env.update({"TRAINGUARD_RING_PREFIX": prefix, "TRAINGUARD_PROFILING_FLAGS": "1", "RANK": "0",
                    "TRAINGUARD_RESTART_COUNT": "0"})
    cmd = [sys.executable, __file__, "--child", "on" if instrument else "off", "--steps", str(steps), "--hidden", str(hidden)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.steps, a.hidden, a.child == "on")))
        return
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    prefix = os.path.join(shm, f"trainguard-bench-{os.getpid()}")
    plain, inst, runs = [], [], []
    try:
        for _ in range(a.repeats):  # alternate, so drift in machine load hits both sides alike
            plain.append(run_child(a.steps, a.hidden, False, prefix)["step_us"])
            r = run_child(a.steps, a.hidden, True, prefix)
            inst.append(r["step_us"])
            runs.append(r)
    finally:
        for name in os.listdir(shm):
            if name.startswith(os.path.basename(prefix)):
                os.unlink(os.path.join(shm, name))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    mp, mi = statistics.median(plain), statistics.median(inst)
    lp, li = min(plain), min(inst)
    span_us, per_step = med("span_us"), med("records_per_step")
    print(f"step time over {a.repeats} alternating runs x {a.steps} steps (DataLoader + MLP hidden={a.hidden}, CPU, 1 thread):")
    print(f"  plain         median {mp:9.1f} us   best {lp:9.1f} us")
    print(f"  instrumented  median {mi:9.1f} us   best {li:9.1f} us")
    print(f"  overhead      median {100 * (mi - mp) / mp:+.2f} %   best {100 * (li - lp) / lp:+.2f} %")
    on, off = med("switch_on_us"), med("switch_off_us")
    print(f"  same process, switch on vs off (alternating blocks): {on:.1f} vs {off:.1f} us  ({100 * (on - off) / off:+.2f} %)")
    print(f"  records per step {per_step:.1f}; x span cost = {per_step * span_us:.1f} us "
          f"= {100 * per_step * span_us / mp:.3f} % of the median plain step")
    print(f"one span (with trainguard.span(...)): {span_us:.2f} us  "
          f"(an empty context manager, same process: {med('empty_cm_us'):.2f} us)")


if __name__ == "__main__":
    main()
