"""The training job's flag table in docs/training-job.md, generated from `python launch/train.py --help`.

    python launch/flag_table.py            # rewrite the table between the markers of docs/training-job.md
    python launch/flag_table.py --check    # exit 1 when the page's table is not what --help says now

One row per flag (help text and default as argparse prints them), one header row per argument group, so the page
cannot drift from the flags the job accepts (tests/test_docs_snippets.py runs the check).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "training-job.md"
BEGIN = "<!-- flag-table: begin (generated from `launch/train.py --help` by `python launch/flag_table.py`) -->"
END = "<!-- flag-table: end -->"


def help_text() -> str:
    # a wide terminal: every help text on one line (argparse wraps at hyphens otherwise)
    env = dict(os.environ, COLUMNS="10000", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--help"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"launch/train.py --help failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def parse_help(text: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """[(group title, [(invocation, default, help), ...]), ...] from argparse's help output (usage, description
    and -h/--help left out)."""
    groups: list[tuple[str, list[list[str]]]] = []
    rows: list[list[str]] | None = None
    for line in text.splitlines():
        if re.match(r"^[^\s].*:$", line) and not line.startswith("usage:"):
            rows = []
            groups.append((line[:-1], rows))
        elif rows is None or not line.strip():
            continue
        elif m := re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line):
            rows.append([m.group(1), m.group(2) or ""])
        elif line.startswith("   ") and rows:
            rows[-1][1] = (rows[-1][1] + " " + line.strip()).strip()
    out = []
    for title, entries in groups:
        parsed = []
        for invocation, help_ in entries:
            if invocation.startswith("-h, --help"):
                continue
            m = re.match(r"^(.*?)\s*\(default: (.*)\)$", help_)
            parsed.append((invocation, m.group(2), m.group(1)) if m else (invocation, "", help_))
        if parsed:
            out.append((title, parsed))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(groups: list[tuple[str, list[tuple[str, str, str]]]]) -> str:
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for title, rows in groups:
        lines.append(f"| **{title}** | | |")
        for invocation, default, help_ in rows:
            lines.append(f"| `{_cell(invocation)}` | {_cell(default) if default else '-'} | {_cell(help_)} |")
    return "\n".join(lines)


def block(help_: str) -> str:
    return f"{BEGIN}\n{table(parse_help(help_))}\n{END}"


def _span(page: str) -> tuple[int, int]:
    i, j = page.find(BEGIN), page.find(END)
    if i < 0 or j < i:
        raise RuntimeError(f"{PAGE.relative_to(ROOT)} has no flag-table markers:\n{BEGIN}\n{END}")
    return i, j + len(END)


def current_block(page: str) -> str:
    i, j = _span(page)
    return page[i:j]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare, do not rewrite")
    args = p.parse_args(argv)
    page = PAGE.read_text()
    i, j = _span(page)
    new = block(help_text())
    if args.check:
        if page[i:j] != new:
            print(f"{PAGE.relative_to(ROOT)}: the flag table differs from launch/train.py --help "
                  f"(regenerate: python launch/flag_table.py)", file=sys.stderr)
            return 1
        print("the flag table matches launch/train.py --help")
        return 0
    PAGE.write_text(page[:i] + new + page[j:])
    print(f"rewrote the flag table of {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
