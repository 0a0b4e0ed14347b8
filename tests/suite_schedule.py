"""The order test files start in under pytest-xdist, and the seconds it is based on.

``--dist loadfile`` hands whole files to workers in collection order (``make test`` turns
xdist's reordering by test count off), each worker asking for the next file when its
own run low. Longest first keeps one worker from starting a 4-minute engine file while
the other has finished: the files are sorted by the seconds each took last time
(``tests/file_seconds.json``: setup + call + teardown of its tests, summed), which
``--record-file-seconds PATH`` writes after a run. Files not in it go last, in
collection order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence, TypeVar

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")

Item = TypeVar("Item")


def file_of(nodeid: str) -> str:
    """``tests/test_x.py::test_y[a]`` -> ``tests/test_x.py``."""
    return nodeid.split("::", 1)[0]


def load_file_seconds(path: Path = FILE_SECONDS) -> dict[str, float]:
    """``{test file: seconds}``; empty when the file is missing."""
    if not path.is_file():
        return {}
    return {name: float(seconds) for name, seconds in json.loads(path.read_text()).items()}


def longest_files_first(items: Sequence[Item], seconds: dict[str, float],
                        nodeid: Callable[[Item], str] = lambda item: item.nodeid) -> list[Item]:
    """``items`` regrouped file by file, the files by descending recorded seconds; a file's
    own tests keep their order, and files without a figure follow in collection order."""
    by_file: dict[str, list[Item]] = {}
    for item in items:
        by_file.setdefault(file_of(nodeid(item)), []).append(item)
    # sorted() is stable: equal figures, and the files without one, stay in collection order
    order = sorted(by_file, key=lambda name: -seconds.get(name, -1.0))
    return [item for name in order for item in by_file[name]]


class FileSeconds:
    """Seconds per test file from pytest's reports (setup, call and teardown phases)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, nodeid: str, duration: float) -> None:
        name = file_of(nodeid)
        self.seconds[name] = self.seconds.get(name, 0.0) + duration

    def merged_into(self, previous: dict[str, float]) -> dict[str, float]:
        """``previous`` with this run's files replaced (a run of some files keeps the rest)."""
        merged = dict(previous)
        merged.update(self.seconds)
        return merged

    def write(self, path: Path) -> None:
        merged = self.merged_into(load_file_seconds(path))
        ordered = dict(sorted(merged.items(), key=lambda pair: (-pair[1], pair[0])))
        path.write_text(json.dumps({name: round(s, 1) for name, s in ordered.items()}, indent=1) + "\n")

