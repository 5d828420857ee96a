"""bench/gpu_check.py: the dry run on a machine without CUDA reports every check as skipped with
its reason and still writes the table; the runner's skip, budget and failure rows."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
spec.loader.exec_module(gpu_check)

NAMES = [
    "flash_packed",
    "liger_vs_ours",
    "qlora_memory",
    "deepspeed_zero2",
    "grpo_step_0p5b",
]


def table_rows(text: str) -> dict[str, list[str]]:
    rows = [
        line.strip("|").split("|")
        for line in text.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows[1:]}


def test_every_check_of_the_issue_is_listed():
    assert [c.name for c in gpu_check.CHECKS] == NAMES
    assert sum(c.budget_s for c in gpu_check.CHECKS) <= 8 * 60 and gpu_check.TOTAL_BUDGET_S <= 8 * 60


def test_the_dry_run_without_cuda_skips_every_check_naming_why(tmp_path, monkeypatch):
    monkeypatch.setattr(
        gpu_check, "cuda_problem", lambda: "no CUDA device (torch.cuda.is_available() is False)"
    )

    def never(check, timeout):
        raise AssertionError(f"{check.name} was started without CUDA")

    monkeypatch.setattr(gpu_check, "run_child", never)
    find = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(  # deepspeed absent, whether or not this environment has it
        gpu_check.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else find(name)
    )
    out = tmp_path / "sub" / "x.md"
    assert gpu_check.main(["--out", str(out)]) == 0
    rows = table_rows(out.read_text())
    assert list(rows) == NAMES
    for name, cells in rows.items():
        assert cells[2] == "skipped", name
        assert "no CUDA device" in cells[3], name
    # what else would be skipped is named too
    assert "deepspeed is not installed" in rows["deepspeed_zero2"][3]
    assert not list(out.parent.glob(".*tmp*"))  # written atomically, nothing left beside it


def test_the_cli_dry_run_exits_0_on_this_machine(tmp_path):
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real checks")
    out = tmp_path / "x.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().count("| skipped | no CUDA device") == len(NAMES)


def test_a_missing_library_skips_only_its_check_and_failures_get_rows(monkeypatch):
    monkeypatch.setattr(gpu_check, "cuda_problem", lambda: None)
    installed = {"peft", "liger_kernel", "triton", "hydra", "omegaconf", "lightning"}
    monkeypatch.setattr(
        gpu_check.importlib.util, "find_spec", lambda name: object() if name in installed else None
    )
    ran = []

    def child(check, timeout):
        ran.append((check.name, timeout))
        status = {"liger_vs_ours": "fail", "grpo_step_0p5b": "timeout"}.get(check.name, "pass")
        return gpu_check.Row(check, status, "x | y", 1.0, {"n": 1})

    rows = gpu_check.run_checks(gpu_check.CHECKS, total_budget=400, child=child)
    by = {r.check.name: r for r in rows}
    assert [n for n, _ in ran] == ["liger_vs_ours", "grpo_step_0p5b"]
    assert all(t <= 400 for _, t in ran)
    assert "flash-attn is not installed" in by["flash_packed"].result
    assert "bitsandbytes is not installed" in by["qlora_memory"].result
    assert "deepspeed is not installed" in by["deepspeed_zero2"].result
    assert (by["liger_vs_ours"].status, by["grpo_step_0p5b"].status) == ("fail", "timeout")
    text = gpu_check.table(rows)
    assert (
        "| liger_vs_ours | (b) Liger fused loss vs ours: values, peak memory | fail | x / y | 1.0 |" in text
    )
    assert '"grpo_step_0p5b": {' in text  # the numbers under the table


def test_a_spent_budget_skips_the_remaining_checks(monkeypatch):
    monkeypatch.setattr(gpu_check, "cuda_problem", lambda: None)
    monkeypatch.setattr(gpu_check, "missing_reason", lambda check: None)
    rows = gpu_check.run_checks(gpu_check.CHECKS, total_budget=5, child=lambda c, t: None)
    assert all(r.status == "skipped" and "budget is spent" in r.result for r in rows)


def test_a_child_that_raises_reports_an_error_row(capsys, monkeypatch):
    """In the child process every exception becomes the check's result (one JSON line)."""
    import json

    cases = type(sys)("gpu_check_cases")
    cases.boom = lambda: 1 / 0
    monkeypatch.setitem(sys.modules, "gpu_check_cases", cases)
    gpu_check.child_main("boom")
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "error" and out["result"].startswith("ZeroDivisionError: division by zero at ")
