"""``python -m rlhf_lightning.traces RUN [--step N] [--html out.html]``: a run's traced episodes.

RUN is a run directory (its ``traces.jsonl``) or a traces file. Without ``--html`` the episodes
are printed; with it, they are written as one HTML page (and a line says where).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf_lightning.traces.html import render_html
from rlhf_lightning.traces.text import render_text
from rlhf_lightning.traces.writer import FILE, read_traces


def traces_path(run: str) -> Path:
    path = Path(run)
    return path / FILE if path.is_dir() else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_lightning.traces",
        description="Show the episodes a run traced (trace.every_n_steps > 0) in traces.jsonl.",
    )
    parser.add_argument("run", help="a run directory, or a traces.jsonl file")
    parser.add_argument("--step", type=int, default=None, help="only the episodes of this training step")
    parser.add_argument(
        "--html", type=Path, default=None, help="write one HTML page here instead of printing"
    )
    parser.add_argument("--no-context", action="store_true", help="leave out each turn's context")
    args = parser.parse_args(argv)
    path = traces_path(args.run)
    if not path.is_file():
        print(f"no traces at {path}: run with trace.every_n_steps > 0 to write them", file=sys.stderr)
        return 1
    records = read_traces(path)
    steps = sorted({int(r.get("step", -1)) for r in records})
    if args.step is not None:
        records = [r for r in records if r.get("step") == args.step]
        if not records:
            print(f"no episodes of step {args.step} in {path}; traced steps: {steps}", file=sys.stderr)
            return 1
    if args.html is not None:
        title = f"traces of {path.parent.name}" + (f", step {args.step}" if args.step is not None else "")
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(render_html(records, title), encoding="utf-8")
        print(f"{len(records)} episodes written to {args.html}")
        return 0
    for record in records:
        print(render_text(record, context=not args.no_context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
