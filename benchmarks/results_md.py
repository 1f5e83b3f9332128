"""benchmarks/RESULTS.md is written by the benchmarks: each owns one section, between markers,
with the command that produced it; nothing in it is typed by hand."""

from __future__ import annotations

import platform
import re
import sys
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = (
    "# Results\n\nEvery table below is written by the benchmark named in its section, with "
    "the command that produced it. Re-run the command to refresh it.\n"
)


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_section(name: str, title: str, command: str, body: str, where: str | None = None) -> Path:
    """Replace (or append) section ``name`` of RESULTS.md (``where``: the machine, if not this)."""
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    block = (
        f"<!-- BEGIN {name} -->\n## {title}\n\n`{command}`\n\n_{date.today().isoformat()}, "
        f"{where or machine()}_\n\n{body.rstrip()}\n<!-- END {name} -->"
    )
    pattern = re.compile(
        rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
    return RESULTS


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    """The command that ran, as typed from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(RESULTS.parent.parent)
    except ValueError:
        pass
    return "python " + " ".join([script.as_posix(), *sys.argv[1:]])


def recording_print(lines: list[str]):
    """A print() that also keeps each line, for a section of RESULTS.md written as printed."""

    def out(*parts, **kwargs):
        text = " ".join(str(p) for p in parts)
        lines.append(text)
        print(text, **kwargs)

    return out


def write_printed_section(name: str, title: str, lines: list[str]) -> Path:
    """Section ``name`` of RESULTS.md: the lines a benchmark printed, as they were printed."""
    return write_section(name, title, command_line(), "```\n" + "\n".join(lines) + "\n```")


def save_outputs(
    json_path: Path, data, results: bool, name: str, title: str, lines: list[str]
) -> None:
    """A benchmark's outputs: its rows as JSON, and with ``--results`` its printed lines as
    section ``name`` of RESULTS.md."""
    import json

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=1))
    if results:
        write_printed_section(name, title, lines)
