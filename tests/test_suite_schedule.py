"""The test files' start order (longest first) and the seconds file it reads."""

from __future__ import annotations

from types import SimpleNamespace

from suite_schedule import FileSeconds, load_file_seconds, longest_files_first


def ids(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_start_longest_first_and_keep_their_own_order():
    items = ids("tests/a.py::x", "tests/b.py::y", "tests/a.py::z", "tests/c.py::w", "tests/d.py::v",
                "tests/b.py::u")
    seconds = {"tests/b.py": 300.0, "tests/d.py": 20.0, "tests/a.py": 5.0}
    order = [i.nodeid for i in longest_files_first(items, seconds)]
    assert order == ["tests/b.py::y", "tests/b.py::u", "tests/d.py::v", "tests/a.py::x", "tests/a.py::z",
                     "tests/c.py::w"]


def test_files_without_a_figure_follow_in_collection_order():
    items = ids("tests/z.py::a", "tests/m.py::b", "tests/a.py::c")
    assert [i.nodeid for i in longest_files_first(items, {})] == ["tests/z.py::a", "tests/m.py::b", "tests/a.py::c"]
    order = longest_files_first(items, {"tests/a.py": 0.0})
    assert [i.nodeid for i in order] == ["tests/a.py::c", "tests/z.py::a", "tests/m.py::b"]


def test_recorded_seconds_sum_phases_per_file_and_merge_with_the_old_figures(tmp_path):
    path = tmp_path / "file_seconds.json"
    assert load_file_seconds(path) == {}
    first = FileSeconds()
    for nodeid, duration in [("tests/a.py::x", 1.0), ("tests/a.py::x", 2.5), ("tests/a.py::y[1]", 0.25),
                             ("tests/b.py::z", 9.0)]:
        first.add(nodeid, duration)
    first.write(path)
    assert load_file_seconds(path) == {"tests/a.py": 3.8, "tests/b.py": 9.0}  # one decimal
    second = FileSeconds()
    second.add("tests/a.py::x", 20.0)
    second.write(path)
    assert load_file_seconds(path) == {"tests/a.py": 20.0, "tests/b.py": 9.0}
    assert list(load_file_seconds(path)) == ["tests/a.py", "tests/b.py"]  # longest first in the file


def test_the_committed_figures_name_test_files_that_exist():
    from suite_schedule import FILE_SECONDS

    seconds = load_file_seconds()
    assert seconds, f"{FILE_SECONDS} is empty or missing"
    root = FILE_SECONDS.parents[1]
    missing = [name for name in seconds if not (root / name).is_file()]
    assert not missing, f"{FILE_SECONDS} names files that are gone: {missing} (rerun with --record-file-seconds)"
