"""``python -m benchmarks``: run the paper's experiments and render the results page.

python -m benchmarks run [NAME ...|all] [--quick] [--model PATH]   run, then write docs/benchmarks.md
python -m benchmarks run --tiny --jobs 2                           harness check, two scripts at a time
python -m benchmarks report                                        re-render the page from the results
python -m benchmarks list                                          the experiments and their figures
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks import gpu_report
from benchmarks.experiments import EXPERIMENTS, Experiment
from benchmarks.harness.machine import output_root
from benchmarks.harness.machine_lock import MachineBusyError
from benchmarks.report import write_report
from benchmarks.runner import RunOptions, load_cpu_kinds, load_records, run_all, select


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run experiments, then write the results page")
    run.add_argument("names", nargs="*", metavar="NAME", help="experiments to run (default: all)")
    size = run.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="the small configurations (~15 min in all on 2 cores)"
    )
    size.add_argument("--tiny", action="store_true", help="harness check: seconds each, figures meaningless")
    run.add_argument(
        "--model",
        default=None,
        help='real-engine runs: "smollm2", "tiny", a .gguf file or a Hugging Face folder (default: each '
        "experiment's own, see `python -m benchmarks list`)",
    )
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds one experiment may take")
    run.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="with --tiny: experiments run this many at a time (measured sizes always run one at a time)",
    )
    for p in (run, sub.add_parser("report", help="re-render docs/benchmarks.md from the results")):
        # Defaults under the current directory (the checkout's root, run from there), not the package's.
        p.add_argument(
            "--results",
            type=Path,
            default=output_root() / "benchmarks" / "results",
            help="results folder (default: %(default)s)",
        )
        p.add_argument(
            "--docs",
            type=Path,
            default=output_root() / "docs",
            help="folder of the page and its img/ (default: %(default)s)",
        )
    sub.add_parser("list", help="the experiments, their paper figures and backends")
    return parser.parse_args(argv)


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    experiments = select(args.names)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    try:
        options = RunOptions(
            size=size, results_dir=args.results, model=args.model, timeout_s=args.timeout, jobs=args.jobs
        )
    except ValueError as exc:
        print(f"python -m benchmarks run: {exc}", file=sys.stderr)
        return 2
    failed: list[str] = []
    with tqdm(total=len(experiments), unit="exp", file=sys.stderr, dynamic_ncols=True) as bar:

        def progress(experiment: Experiment, record: dict[str, Any] | None) -> None:
            if record is None:
                bar.set_description(f"{experiment.name} ({experiment.figure})")
                return
            status = "ok" if record["ok"] else f"FAILED: {record.get('error')}"
            bar.write(f"{experiment.name}: {status} in {record['wall_s']:.0f} s")
            if not record["ok"]:
                failed.append(experiment.name)
            bar.update()

        try:
            run_all(experiments, options, progress)
        except MachineBusyError as exc:
            print(f"python -m benchmarks run: {exc}", file=sys.stderr)
            return 2
    page = write_report(
        load_records(args.results), args.docs, gpu_report.load(args.results), load_cpu_kinds(args.results)
    )
    print(f"results in {args.results}, page {page}")
    if failed:
        print(f"failed: {', '.join(failed)} (see their .log in {args.results})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "list":
        for e in EXPERIMENTS:
            model = e.default_model if e.backend == "engine" else "-"
            print(f"{e.name:<18} {e.figure:<16} {e.backend:<9} {model:<8} {e.title}")
        return 0
    if args.command == "report":
        records, kinds = load_records(args.results), load_cpu_kinds(args.results)
        print(write_report(records, args.docs, gpu_report.load(args.results), kinds))
        return 0
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
