"""What every benchmark record says about the code it measured (bench/common.py ``code_version``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import common  # noqa: E402  (bench/ is not a package)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small git checkout with the bench layout, standing in for the repository."""
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "bench@example.invalid")
    git(tmp_path, "config", "user.name", "bench")
    (tmp_path / "protocol").mkdir()
    (tmp_path / "protocol" / "code.py").write_text("x = 1\n")
    (tmp_path / "bench" / "out").mkdir(parents=True)
    (tmp_path / "bench" / "out" / "runs.jsonl").write_text("{}\n")
    (tmp_path / "bench" / "RESULTS.md").write_text("# results\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "first")
    monkeypatch.setattr(common, "REPO", tmp_path)
    return tmp_path


def test_a_record_names_the_commit_and_a_clean_tree(checkout):
    assert common.record_base("x")["code"] == {"commit": git(checkout, "rev-parse", "--short", "HEAD").strip(),
                                               "dirty": False}


def test_the_benchmarks_own_outputs_do_not_make_the_code_dirty(checkout):
    (checkout / "bench" / "out" / "runs.jsonl").write_text("{}\n{}\n")
    (checkout / "bench" / "RESULTS.md").write_text("# results, regenerated\n")
    (checkout / "notes.txt").write_text("untracked\n")
    assert common.code_version()["dirty"] is False


def test_a_changed_source_file_makes_the_code_dirty(checkout):
    (checkout / "protocol" / "code.py").write_text("x = 2\n")
    assert common.code_version()["dirty"] is True


def test_outside_a_git_checkout_there_is_no_code_version(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "REPO", tmp_path)
    assert common.code_version() is None


def test_a_bench_folder_inside_another_repository_reports_no_version(checkout, monkeypatch):
    monkeypatch.setattr(common, "REPO", checkout / "protocol")  # a folder of a checkout, not its top
    assert common.code_version() is None
