"""Smoke test of bench/disk_tier.py: two chunks per size, in a temporary directory."""

from __future__ import annotations

import sys

from bench import disk_tier as bench


def test_bench_prints_a_row_per_plan_file_size(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["disk_tier", "--chunks", "2", "--dir", str(tmp_path)])
    bench.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| llama") or "| gemma" in line]
    assert len(rows) == 2, out
    assert "| 8 MiB |" in rows[0] and "| 16 MiB | 6 |" in rows[1]
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself
