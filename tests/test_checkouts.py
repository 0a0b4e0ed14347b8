"""benchmarks/common/checkouts.py: a commit is checked out in a temporary git worktree with its
patches linked, and the worktree and scratch folder are gone afterwards; ``--`` splits the
arguments."""

import subprocess

from benchmarks.common import checkouts


def test_split_argv_hands_everything_after_the_dashes_to_the_script():
    assert checkouts.split_argv(["--before", "x", "--", "--quick", "--"]) == (["--before", "x"], ["--quick", "--"])
    assert checkouts.split_argv(["--before", "x"]) == (["--before", "x"], [])


def test_opened_checkouts_open_a_worktree_and_remove_it():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkouts.ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    with checkouts.opened_checkouts("HEAD", ".") as (opened, scratch):
        before, after = opened
        assert (before.label, before.commit, after.root) == ("before", head, checkouts.ROOT)
        assert before.root.parent == scratch and (before.root / "kvcompress" / "__init__.py").is_file()
        assert (before.root / "kvcompress" / "patches").resolve() == (before.root / "patches").resolve()
        listed = subprocess.run(["git", "worktree", "list"], cwd=checkouts.ROOT, check=True, capture_output=True,
                                text=True).stdout
        assert str(before.root) in listed
    assert not scratch.exists()
    listed = subprocess.run(["git", "worktree", "list"], cwd=checkouts.ROOT, check=True, capture_output=True,
                            text=True).stdout
    assert str(before.root) not in listed
