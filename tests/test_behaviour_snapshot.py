"""``benchmarks/behaviour_snapshot.py``: the refactor check finds a changed decision and
only that."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import behaviour_snapshot  # noqa: E402


def test_a_snapshot_equals_itself_and_names_a_changed_pick(tmp_path, capsys):
  first, second = tmp_path / "first.json", tmp_path / "second.json"
  assert behaviour_snapshot.main(["--out", str(first), "--parts", "auto"]) == 0
  snapshot = json.loads(first.read_text())
  assert len(snapshot["auto"]) == 6 * 7 * 12 * 5 * 2
  assert behaviour_snapshot.main(["--out", str(second), "--parts", "auto",
                                  "--compare", str(first)]) == 0
  key = sorted(snapshot["auto"])[0]
  snapshot["auto"][key] = "'changed'"
  first.write_text(json.dumps(snapshot))
  capsys.readouterr()
  assert behaviour_snapshot.main(["--out", str(second), "--parts", "auto",
                                  "--compare", str(first)]) == 1
  out = capsys.readouterr().out
  assert f"auto {key}: 'changed' ->" in out and "1 cases differ" in out
