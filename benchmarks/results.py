"""Appending a measured table to benchmarks/RESULTS.md with date, machine and command."""
from __future__ import annotations

import datetime
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def report(table: str, summary: str, *, append: bool, title: str, command: str, what: str) -> None:
    """Print a benchmark's table and summary; with `append`, also record them in RESULTS.md."""
    print(table)
    print(summary)
    if append:
        append_result(title, command, what, f"{table}\n\n{summary}")


def append_result(title: str, command: str, what: str, body: str) -> None:
    machine = f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}"
    with RESULTS.open("a") as f:
        f.write(f"\n### {title}, {datetime.date.today()}, {machine}\n\n`{command}` ({what})\n\n{body}\n")
