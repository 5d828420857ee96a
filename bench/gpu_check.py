"""Every GPU-only check of the project in one command, as one markdown table.

    python bench/gpu_check.py --out $OUT/gpu_check.md     # on a CUDA machine (~8 minutes at most)
    python bench/gpu_check.py --out /tmp/x.md             # anywhere else: every check skipped, why
    python bench/gpu_check.py --only liger_vs_ours deepspeed_zero2

Checks (bench/gpu_check_cases.py; each in its own process, with its own time budget):
  flash_packed     packed multi-row batch through Policy.token_logprobs under flash_attention_2
                   vs each sequence alone under sdpa: max |log-prob diff|
  liger_vs_ours    Liger's fused linear GRPO loss vs our chunked log-probs + objective: values,
                   gradients, peak memory
  qlora_memory     a 4-bit (bitsandbytes nf4) vs a bf16 Qwen2.5-0.5B-shaped base under LoRA: peak memory
  deepspeed_zero2  3 GRPO steps of the tiny model through run(cfg) with strategy=deepspeed_zero2
                   (strategy=deepspeed_zero3 is refused at start-up: docs/guides/scaling.md)
  grpo_step_0p5b   one LoRA GRPO update of a Qwen2.5-0.5B-shaped model at 4,096 tokens: peak memory

A check whose library is missing is skipped with the reason (the lent GPU machine has no network:
bench/gpu_wheels.txt lists the wheels to carry and how to install them). The table always comes
back: a check that fails, raises or runs out of time says so in its row, and the command exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = Path(__file__).resolve().parent / "gpu_check_cases.py"
TOTAL_BUDGET_S = 470.0  # the whole script, so that it ends within ~8 minutes on an H200


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    budget_s: float
    needs: tuple[str, ...] = ()  # importable modules (besides torch with CUDA)


CHECKS = (
    Check(
        "flash_packed", "(a) flash-attention packed rows = each sequence alone", 70, ("flash_attn", "peft")
    ),
    Check(
        "liger_vs_ours", "(b) Liger fused loss vs ours: values, peak memory", 100, ("liger_kernel", "triton")
    ),
    Check("qlora_memory", "(c) QLoRA 4-bit vs bf16 LoRA: peak memory", 100, ("bitsandbytes", "peft")),
    Check(
        "deepspeed_zero2",
        "(d) DeepSpeed ZeRO-2: 3 steps through run(cfg)",
        130,
        ("deepspeed", "hydra", "omegaconf", "lightning"),
    ),
    Check("grpo_step_0p5b", "(e) one LoRA GRPO step, Qwen2.5-0.5B shape, 4k tokens", 70, ("peft",)),
)
WHY_MISSING = {
    "flash_attn": "flash-attn is not installed (its wheels are hundreds of MB, over what travels to the "
    "lent machine; pip install flash-attn --no-build-isolation on a machine with a network)",
    "deepspeed": "deepspeed is not installed (pip install --no-index wheels/deepspeed-*.whl: bench/gpu_wheels.txt)",
}


@dataclass
class Row:
    check: Check
    status: str  # pass | fail | info | skipped | error | timeout
    result: str
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


def cuda_problem() -> str | None:
    """Why there is no CUDA device to check on, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): a GPU-only check"
    return None


def missing_reason(check: Check, find: Callable[[str], object] | None = None) -> str | None:
    find = find or importlib.util.find_spec  # looked up at call time (tests hide packages)
    for module in check.needs:
        try:
            found = find(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return WHY_MISSING.get(
                module, f"{module} is not installed (bench/gpu_wheels.txt lists its wheel)"
            )
    return None


def run_child(check: Check, timeout: float) -> Row:
    """``check`` in its own Python process (its memory peaks and a hang stay its own)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", check.name]
    started = time.perf_counter()
    # its own process group: on a timeout its helpers (compile workers) end with it
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        tail = one_line(stderr[-600:])
        return Row(check, "timeout", f"over its {timeout:.0f} s budget; last output: {tail}", timeout)
    seconds = time.perf_counter() - started
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return Row(check, "error", f"exit {proc.returncode}: {one_line(stderr[-800:])}", seconds)
    out = json.loads(lines[-1])
    return Row(check, out["status"], out["result"], seconds, out.get("details", {}))


def one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")[-400:]


def run_checks(
    checks: Sequence[Check],
    total_budget: float = TOTAL_BUDGET_S,
    child: Callable[[Check, float], Row] = run_child,
) -> list[Row]:
    """Each check, skipped (with the reason) when it cannot run here, within the total budget."""
    rows = []
    deadline = time.perf_counter() + total_budget
    no_cuda = cuda_problem()
    for check in checks:
        missing = missing_reason(check)
        reason = f"{no_cuda}; and {missing}" if no_cuda and missing else no_cuda or missing
        left = deadline - time.perf_counter()
        if reason is None and left < 15:
            reason = f"the script's {total_budget:.0f} s budget is spent"
        if reason is not None:
            rows.append(Row(check, "skipped", reason))
            continue
        rows.append(child(check, min(check.budget_s, left)))
        print(
            f"{check.name}: {rows[-1].status} ({rows[-1].seconds:.0f} s) {rows[-1].result}", file=sys.stderr
        )
    return rows


PACKAGES = ("torch", "lightning", "transformers", "peft", "triton", "hydra-core", "omegaconf",
            "deepspeed", "liger-kernel", "bitsandbytes", "flash-attn")  # fmt: skip


def machine_line() -> str:
    """The GPU, Python and the installed versions (read from the metadata, nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    problem = cuda_problem()
    gpu = problem.split(" (")[0] if problem else "CUDA device"
    if problem is None:
        try:
            import torch

            gpu = torch.cuda.get_device_name(0)
        except (AssertionError, RuntimeError):  # a CUDA-less torch
            pass
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            versions.append(f"{package} -")
    return f"{gpu}; Python {sys.version.split()[0]}; {', '.join(versions)}"


def table(rows: Sequence[Row]) -> str:
    lines = [
        "# GPU checks (bench/gpu_check.py)",
        "",
        machine_line(),
        "",
        "| check | what | status | result | time (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.check.name} | {r.check.what} | {r.status} | {one_line(r.result)} | {r.seconds:.1f} |"
        )
    details = {r.check.name: r.details for r in rows if r.details}
    if details:
        lines += ["", "Details:", "", "```json", json.dumps(details, indent=1, default=str), "```"]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def child_main(name: str) -> None:
    import importlib

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(CASES.parent))
    try:
        cases = importlib.import_module("gpu_check_cases")
        status, result, details = getattr(cases, name)()
    except Exception as err:  # any failure is the check's result
        import traceback

        frames = traceback.extract_tb(err.__traceback__)
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        traceback.print_exc()
        status, result, details = "error", f"{type(err).__name__}: {err}{where}", {}
    print(json.dumps({"status": status, "result": result, "details": details}, default=str))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="the markdown file to write (default: stdout)")
    ap.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], default=None)
    ap.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for the whole script")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child_main(a.child)
        return 0
    checks = [c for c in CHECKS if a.only is None or c.name in a.only]
    text = table(run_checks(checks, a.budget))
    if a.out is None:
        sys.stdout.write(text)
    else:
        write_atomic(a.out, text)
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
