"""Every ```python block of README.md and docs/*.md runs as written, on the CPU, each in its own process.

A block runs with `python` unless the line before its fence (blank lines aside) is a marker:

    <!-- run: torchrun N -->     launched as `torchrun --standalone --nproc-per-node N` (gloo on the CPU)
    <!-- fragment: REASON -->    not runnable on its own (e.g. continues the block above); listed as skipped with
                                 its reason, never silently left out

Each block runs in an empty temporary folder with CUDA hidden, so what it writes (checkpoints, files) goes there.
Relative links between the pages must resolve too (files and #anchors).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
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


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_runs(snippet: Snippet, tmp_path):
    if snippet.fragment is not None:
        pytest.skip(f"fragment: {snippet.fragment}")
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    if snippet.nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(snippet.nproc),
               str(script)]
    else:
        cmd = [sys.executable, str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, (f"{snippet.name} failed (exit {r.returncode}) as `{' '.join(cmd[1:])}`:\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


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
