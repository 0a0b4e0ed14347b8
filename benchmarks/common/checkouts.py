"""Two commits of kvcompress checked out side by side, for before / after comparisons.

A refactor should leave the figures unchanged; the comparison scripts
(``throughput/compare_checkouts.py``, ``quality/compare_quality_checkouts.py``) run each
commit's own benchmark script in a temporary ``git worktree`` with ``PYTHONPATH`` pointing
at that checkout, so the editable install loads that checkout's ``kvcompress``
(``kvcompress/patches`` is linked to its ``patches/`` so the patches package follows too),
and alternate which commit goes first so both see the same machine drift.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LABELS = ("before", "after")


@dataclass(frozen=True)
class Checkout:
    label: str  # "before" / "after"
    rev: str  # what was asked for ("." = this working tree)
    commit: str
    root: Path

    def record(self) -> dict[str, str]:
        """What a results file keeps of it (the temporary root is gone by then)."""
        return {"label": self.label, "rev": self.rev, "commit": self.commit}


def run_order(repeats: int) -> list[tuple[int, str]]:
    """(repetition, label) in run order: before first on even repetitions, after on odd."""
    order = []
    for rep in range(repeats):
        pair = LABELS if rep % 2 == 0 else LABELS[::-1]
        order.extend((rep, label) for label in pair)
    return order


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The comparison's own arguments and, after ``--``, the benchmark script's."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def open_checkout(label: str, rev: str, scratch: Path) -> Checkout:
    if rev == ".":
        return Checkout(label, rev, _git("rev-parse", "HEAD") + " + working tree", ROOT)
    root = scratch / label
    _git("worktree", "add", "--detach", str(root), rev)
    link = root / "kvcompress" / "patches"
    if (root / "patches").is_dir() and not link.exists():
        link.symlink_to("../patches")
    return Checkout(label, rev, _git("rev-parse", rev), root)


@contextlib.contextmanager
def opened_checkouts(before: str, after: str) -> Iterator[tuple[list[Checkout], Path]]:
    """The two checkouts (before, after) and a scratch folder for the runs' outputs; the
    temporary worktrees and the scratch folder are removed on the way out, whatever happened
    (read the runs' outputs inside)."""
    scratch = Path(tempfile.mkdtemp(prefix="kvc-compare-"))
    checkouts: list[Checkout] = []
    try:
        for label, rev in zip(LABELS, (before, after)):
            checkouts.append(open_checkout(label, rev, scratch))
        yield checkouts, scratch
    finally:
        for c in checkouts:
            if c.root != ROOT:
                _git("worktree", "remove", "--force", str(c.root))
        shutil.rmtree(scratch, ignore_errors=True)


def checkout_env(checkout: Checkout) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` set to the checkout alone."""
    return dict(os.environ, PYTHONPATH=str(checkout.root))


def check_imports_from(checkout: Checkout, env: dict) -> None:
    """Refuse to measure if ``kvcompress`` or its patches would load from another checkout."""
    probe = "import kvcompress, kvcompress.patches as p; print(kvcompress.__file__); print(p.__file__)"
    files = subprocess.run([sys.executable, "-c", probe], cwd=checkout.root, env=env, check=True,
                           capture_output=True, text=True).stdout.split()
    outside = [f for f in files if not Path(f).resolve().is_relative_to(checkout.root.resolve())]
    if outside:
        raise RuntimeError(f"{checkout.label} ({checkout.rev}) would import {outside} from outside {checkout.root}")


def run_script(checkout: Checkout, script_paths: tuple[str, ...], args: list[str]) -> None:
    """The checkout's own copy of a benchmark script (the first of ``script_paths``, newest
    layout first, that it has), run from its root with its imports checked first."""
    script = next((checkout.root / p for p in script_paths if (checkout.root / p).exists()), None)
    if script is None:
        raise FileNotFoundError(f"{checkout.label} ({checkout.rev}) has none of {script_paths}")
    env = checkout_env(checkout)
    check_imports_from(checkout, env)
    command = [sys.executable, str(script), *args]
    print(f"[{checkout.label}] {' '.join(command)}", flush=True)
    subprocess.run(command, cwd=checkout.root, env=env, check=True)


def fmt(value, spec: str) -> str:
    """A table cell: ``-`` for a missing value."""
    return "-" if value is None else format(value, spec)
