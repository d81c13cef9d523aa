"""The commit-msg hook `make hooks` enables (.githooks/commit-msg): a subject of at most 72
characters passes, a longer one is refused in one line; git's comment lines are not the subject."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"


def run_hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run(["bash", str(HOOK), str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("length", [1, 72])
def test_subject_of_at_most_72_characters_passes(tmp_path, length):
    res = run_hook(tmp_path, "# git's note\n" + "s" * length + "\n\n" + "b" * 200 + "\n")
    assert res.returncode == 0, res.stderr


def test_longer_subject_is_refused_in_one_line(tmp_path):
    res = run_hook(tmp_path, "s" * 73 + "\n\nbody\n")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "commit subject is 73 characters, at most 72 expected: shorten it and put the detail "
        "in the body after a blank line"]
