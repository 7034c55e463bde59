"""A persistent pool of gloo ranks per world size, for the CPU distributed tests (see _harness.spawn).

[Note: the rank pool] A spawned rank imports torch, hybridq and the job's modules (~5 s of CPU each on the CI
machine) and sets up a process group before its job runs; the suite spawned 83 times at 1dd8814. The pool starts
`world_size` processes once per pytest session (start method 'spawn': a process that imported torch is never
forked), initialises their gloo group once, and then runs each test's job on every rank: the job (a module-level
function, pickled by reference as `torch.multiprocessing.spawn` pickles it) and its kwargs go down a pipe, each
rank's JSON result comes back. What a fresh spawn gives a job, the pool gives it again before every job
(`_Baseline.restore`): the environment, hybridq's switches read from it, randomly seeded generators, the default dtype,
deterministic-algorithm and grad modes, thread count, warning filters, dynamo's caches, counters and configs.
A job that raises, a rank that dies and a job that outlives JOB_TIMEOUT_S fail the test with the rank's
traceback; the pool is then killed (a peer may sit in a collective) and the next job starts a new one. A pool
started under another environment than the caller's is replaced (env vars read at import time stay exact).
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings

JOB_TIMEOUT_S = 1800  # a job that runs longer is taken as hung (the slowest, test_tp_compile's, took 222 s under load)
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)  # (changes with every test; read by no job)


def _env_key() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}


class _Baseline:
    """What a freshly spawned rank starts a job with, captured once after the group is set up."""

    def __init__(self):
        import torch
        import torch._dynamo  # (imported here, so the configs' starting values are captured before any job)
        import torch._functorch.config
        import torch._inductor.config

        import hybridq  # noqa: F401 (a job's process imports it, which installs its Inductor pass: compiled_amax.py)

        self.env = dict(os.environ)
        self.dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.filters = list(warnings.filters)
        self.showwarning = warnings.showwarning
        self.configs = [(m, m.get_config_copy()) for m in (torch._dynamo.config, torch._inductor.config,
                                                          torch._functorch.config)]

    def restore(self) -> None:
        import torch
        import torch._dynamo

        if os.environ != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        switches = sys.modules.get("hybridq.switches")
        if switches is not None:  # each switch read from the environment again, as at its module's import
            for sw in switches.switches().values():
                type(sw).__init__(sw, sw.env, sw.default)
        torch.seed()  # (a new process's generators start from a random seed, as these)
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_num_threads(1)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        warnings.filters[:] = self.filters
        warnings.showwarning = self.showwarning
        warnings._filters_mutated()  # (the once-per-location registries start empty, as in a new process)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for module, config in self.configs:
            module.load_config(config)


def _rank_main(rank: int, world_size: int, store: str, timeout_s: float, conn) -> None:
    """A pooled rank: set up the group once, then run jobs until the pipe closes or a job fails."""
    # a native crash (a rank once died of SIGSEGV in a DCP job of CI, 2026-11-29, not reproduced) prints every
    # thread's Python stack to stderr, which the test's report captures
    faulthandler.enable(all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        baseline = _Baseline()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    device = torch.device("cpu")
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            break
        except BaseException:  # the job could not be unpickled (its module failed to import)
            conn.send(("error", traceback.format_exc()))
            break
        if msg is None:
            break
        job, kwargs = msg
        try:
            baseline.restore()
            result = job(rank=rank, world_size=world_size, device=device, **kwargs)
            text = json.dumps(result if result is not None else {})
            dist.barrier()  # nobody starts the next job while a peer still works on this one
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            break  # never reused after a failure: a peer may sit in a collective
        conn.send(("ok", text))
    # Leave without the interpreter's teardown, where gloo's background threads were seen to abort the process
    # once in CI ("terminate called without an active exception"); see _harness._entry.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """`world_size` gloo ranks that run one job after another (see [Note: the rank pool])."""

    def __init__(self, world_size: int, timeout_s: float):
        ctx = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.env = _env_key()
        self.dir = tempfile.mkdtemp(prefix="hybridq-pool-")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, world_size, os.path.join(self.dir, "store"), timeout_s,
                                                     child), name=f"hybridq-pool-{world_size}-rank{rank}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.alive = True

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(self, job, kwargs: dict) -> list[dict]:
        """Run `job(rank=, world_size=, device=, **kwargs)` on every rank; each rank's JSON result. A failure
        kills the pool and raises `ProcessRaisedException` (`ProcessExitedException` for a rank that died), as
        `torch.multiprocessing.spawn` does."""
        from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

        try:
            for c in self.conns:
                c.send((job, kwargs))
        except BaseException:
            self.close(kill=True)
            raise
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        failure = None
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while pending and failure is None:
            waiting = {self.conns[r]: r for r in pending}
            waiting.update({self.procs[r].sentinel: r for r in pending})
            ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                failure = ProcessRaisedException(
                    f"\n\n-- ranks {sorted(pending)} of the {self.world_size}-rank pool did not finish "
                    f"{getattr(job, '__name__', job)} within {JOB_TIMEOUT_S} s\n", min(pending), None)
                break
            for r in sorted({waiting[o] for o in ready}):
                conn, proc = self.conns[r], self.procs[r]
                try:
                    status, payload = conn.recv() if conn.poll() else (None, None)
                except (EOFError, OSError):
                    status, payload = None, None
                if status == "ok":
                    results[r] = json.loads(payload)
                    pending.discard(r)
                    continue
                if status == "error":
                    failure = ProcessRaisedException(
                        f"\n\n-- Process {r} terminated with the following error:\n{payload}", r, proc.pid)
                else:
                    proc.join(5)
                    failure = ProcessExitedException(
                        f"process {r} terminated with exit code {proc.exitcode}", error_index=r,
                        error_pid=proc.pid, exit_code=proc.exitcode)
                break
        if failure is not None:
            self.close(kill=True)
            raise failure
        return results

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: asked to leave when idle; killed after a failure (a peer may wait in a collective) or
        when they do not leave."""
        if not self.alive:
            return
        self.alive = False
        for c in self.conns:
            try:
                if not kill:
                    c.send(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(0 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[int, RankPool] = {}


def pool(world_size: int, timeout_s: float) -> RankPool:
    """The session's pool of `world_size` ranks, started on first use or after a failure, and started again when
    the environment differs from the one it started under."""
    p = _POOLS.get(world_size)
    if p is not None and (not p.alive or p.env != _env_key()):
        p.close()
        p = None
    if p is None:
        p = _POOLS[world_size] = RankPool(world_size, timeout_s)
    return p


def close_all() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_all)
