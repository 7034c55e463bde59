"""Every ```python block of README.md and docs/*.md runs as written, on the CPU, each in its own process.

A block runs with `python` unless the line before its fence (blank lines aside) is a marker:

    <!-- run: torchrun N -->     launched as `torchrun --standalone --nproc-per-node N` (gloo on the CPU)
    <!-- fragment: REASON -->    not runnable on its own (e.g. continues the block above); listed as skipped with
                                 its reason, never silently left out

Each block runs in its own process in an empty temporary folder with CUDA hidden, so what it writes (checkpoints,
files) goes there; every process of a block is forked from one interpreter that has imported torch and hybridq
(a `torchrun N` block's N processes with the environment torchrun gives its workers).
Relative links between the pages must resolve too (files and #anchors).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import select
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(run|fragment):\s*(.*?)\s*-->$")
TIMEOUT_S = 180


@dataclasses.dataclass(frozen=True)
class Snippet:
    page: pathlib.Path
    line: int  # of the opening fence, 1-based
    code: str
    nproc: int  # 0: python; N: torchrun with N processes
    fragment: str | None  # the reason, for a block that is not run

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _marker(lines: list[str], fence: int, page: pathlib.Path) -> tuple[int, str | None]:
    k = fence - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    m = MARKER.match(lines[k].strip()) if k >= 0 else None
    if m is None:
        if k >= 0 and lines[k].strip().startswith("<!--") and ("run" in lines[k] or "fragment" in lines[k]):
            raise ValueError(f"{page.name}:{k + 1}: malformed snippet marker {lines[k].strip()!r}")
        return 0, None
    kind, arg = m.groups()
    if kind == "fragment":
        if not arg:
            raise ValueError(f"{page.name}:{k + 1}: a fragment marker needs its reason")
        return 0, arg
    if arg == "python":
        return 0, None
    launcher = re.fullmatch(r"torchrun (\d+)", arg)
    if launcher is None:
        raise ValueError(f"{page.name}:{k + 1}: unknown launcher {arg!r} (python, or torchrun N)")
    return int(launcher.group(1)), None


def snippets(page: pathlib.Path) -> list[Snippet]:
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+)\s*(\S*)", lines[i])
        if fence is None:
            i += 1
            continue
        ticks, lang = fence.group(2), fence.group(3)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            j += 1
        if lang == "python":
            nproc, fragment = _marker(lines, i, page)
            out.append(Snippet(page, i + 1, "\n".join(lines[i + 1:j]) + "\n", nproc, fragment))
        i = j + 1
    return out


ALL = [s for page in PAGES for s in snippets(page)]


# One warm interpreter that has imported torch and hybridq (~5 s of CPU per process, most of a small snippet's
# cost) forks a fresh child per process of a snippet: each runs alone, from a clean __main__, in its folder. A
# `torchrun N` snippet gets N children with the environment torchrun gives its workers (RANK, LOCAL_RANK,
# WORLD_SIZE, MASTER_ADDR / MASTER_PORT of a rendezvous store), the store hosted as torchrun's agent hosts it (its
# own process, port 0: no port to find free); when one child fails the others are stopped, as torchrun does.
_SERVER = r"""
import os, runpy, signal, sys, time, traceback
import torch, hybridq  # noqa: F401

def child(script, log, env):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    os.chdir(os.path.dirname(script))
    sys.argv = [script]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

def store(nproc):
    # the rendezvous store in a process of its own (the server forks the workers: it starts no thread itself)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        st = torch.distributed.TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False)
        os.write(w, str(st.port).encode() + b"\n")
        signal.pause()
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        return pid, int(f.readline())

for line in sys.stdin:
    script, log, nproc = line.rstrip("\n").split("\t")
    nproc = int(nproc)
    envs = [{}]
    holder = None
    if nproc:
        holder, port = store(nproc)
        common = dict(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        envs = [dict(common, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r)) for r in range(nproc)]
    pids = {}
    for r, env in enumerate(envs):
        pid = os.fork()
        if pid == 0:
            child(script, log if r == 0 else f"{log}.rank{r}", env)
        pids[pid] = r
    code = 0
    while pids:
        pid, status = os.wait()
        if pid not in pids:
            continue
        pids.pop(pid)
        c = os.waitstatus_to_exitcode(status)
        if c != 0 and code == 0:
            code = c
            for other in pids:  # a failed worker: stop the others (they may wait in a collective)
                os.kill(other, signal.SIGKILL)
    if holder is not None:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    print(code, flush=True)
"""


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def warm_python():
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env())

    def run(script: pathlib.Path, nproc: int = 0) -> tuple[int, str]:
        """(exit code, output): one process, or `nproc` as torchrun would start them (rank 0's output first)."""
        log = script.with_suffix(".log")
        proc.stdin.write(f"{script}\t{log}\t{nproc}\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
        if not ready:
            proc.kill()
            raise TimeoutError(f"{script.name} ran longer than {TIMEOUT_S} s")
        code = int(proc.stdout.readline())
        logs = [log] + [log.with_name(f"{log.name}.rank{r}") for r in range(1, nproc)]
        return code, "\n".join(f"[rank {r}]\n{p.read_text()}" if nproc else p.read_text()
                               for r, p in enumerate(logs) if p.exists())

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_runs(snippet: Snippet, tmp_path, warm_python):
    if snippet.fragment is not None:
        pytest.skip(f"fragment: {snippet.fragment}")
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    code, output = warm_python(script, snippet.nproc)
    how = f"torchrun --nproc-per-node {snippet.nproc} (its workers' environment)" if snippet.nproc else "python"
    output = output[-6000:]
    assert code == 0, f"{snippet.name} failed (exit {code}) under {how}:\n{output}"


def test_the_runner_reports_a_failing_block(tmp_path, warm_python):
    script = tmp_path / "snippet.py"
    script.write_text("import hybridq\nprint('before')\nhybridq.recipe('no_such_preset')\n")
    code, output = warm_python(script)
    assert code == 1 and "before" in output and "no_such_preset" in output, (code, output)
    script.write_text("import sys\nsys.exit(3)\n")
    assert warm_python(script)[0] == 3


def test_markers_are_parsed(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("a\n\n<!-- run: torchrun 2 -->\n```python\nx = 1\n```\n\n<!-- fragment: continues above -->\n"
                    "```python\ny = x\n```\n\n```python\nz = 2\n```\n\n```bash\nls\n```\n")
    found = [(s.line, s.nproc, s.fragment, s.code) for s in snippets(page)]
    assert found == [(4, 2, None, "x = 1\n"), (9, 0, "continues above", "y = x\n"), (13, 0, None, "z = 2\n")]
    page.write_text("<!-- run: mpirun 2 -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown launcher 'mpirun 2'"):
        snippets(page)


def test_pages_have_runnable_snippets():
    # the test must not pass by finding nothing: the README and every user-guide page hold runnable code
    run = {s.page for s in ALL if s.fragment is None}
    guide = [p for p in PAGES if p.name not in ("architecture.md", "numerics.md")]
    assert [p.relative_to(ROOT) for p in guide if p not in run] == []


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    out, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(_anchor(line.lstrip("#")))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve(page: pathlib.Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(broken)


def test_training_job_flag_table_matches_the_job_help():
    sys.path.insert(0, str(ROOT / "launch"))
    import flag_table
    shown = flag_table.current_block(flag_table.PAGE.read_text())
    assert shown == flag_table.block(flag_table.help_text()), (
        "docs/training-job.md's flag table differs from `launch/train.py --help`: run python launch/flag_table.py")


def test_flag_table_reads_argparse_help(monkeypatch):
    import argparse
    sys.path.insert(0, str(ROOT / "launch"))
    import flag_table
    monkeypatch.setenv("COLUMNS", "10000")
    p = argparse.ArgumentParser(description="d", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=128, help="model width (multiple of 32)")
    g.add_argument("--a-very-long-flag-name", metavar="A_VERY_LONG_VALUE", default="x|y", help="pipes | escaped")
    g.add_argument("--flag", action="store_true", help="on or off")
    assert flag_table.parse_help(p.format_help()) == [
        ("model", [("--d-model D_MODEL", "128", "model width (multiple of 32)"),
                   ("--a-very-long-flag-name A_VERY_LONG_VALUE", "x|y", "pipes | escaped"),
                   ("--flag", "False", "on or off")])]
    assert "| `--a-very-long-flag-name A_VERY_LONG_VALUE` | x\\|y | pipes \\| escaped |" in flag_table.table(
        flag_table.parse_help(p.format_help()))
