"""``python -m bench [--quick] [--only NAME ...]``: run the benchmarks, write the results and
render the report.

Each family runs in a temporary directory of its own and returns a JSON-able dict, which is
stored under ``families.<name>`` in ``bench/results.json`` as soon as it is done (with
``--only``, the other families' earlier results are kept). ``docs/benchmarks.md`` is then
rendered from that file alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

from bench import checkpoints, failover, overhead, precision, redis_cost, report, scale
from bench._common import ROOT, Json, log, machine, write_json

FAMILIES: dict[str, ModuleType] = {
    "precision": precision,
    "failover": failover,
    "redis_cost": redis_cost,
    "overhead": overhead,
    "scale": scale,
    "checkpoints": checkpoints,
}
RESULTS = ROOT / "bench" / "results.json"
REPORT = ROOT / "docs" / "benchmarks.md"


def _load(path: Path) -> Json:
    if not path.exists():
        return {}
    data: Json = json.loads(path.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    """Run the selected families (all by default); return 1 if any of them failed."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer ticks, trials and replicas (< 2 minutes)"
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(FAMILIES), metavar="NAME", help=", ".join(FAMILIES)
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="where to write results")
    parser.add_argument("--report", type=Path, default=REPORT, help="where to render the report")
    parser.add_argument("--keep", action="store_true", help="keep the work directories (logs)")
    args = parser.parse_args(argv)

    names = args.only or list(FAMILIES)
    results = _load(args.results) if args.only else {}
    started = time.monotonic()
    results["machine"] = machine()
    results.setdefault("families", {})
    failed = []
    for name in names:
        log(f"bench: {name} ...")
        began = time.monotonic()
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        try:
            data: Json = FAMILIES[name].run(args.quick, workdir)
        except Exception:
            failed.append(name)
            data = {"error": traceback.format_exc(limit=8)}
            log(data["error"])
        finally:
            if not args.keep:
                _remove(workdir)
        data["meta"] = {
            "mode": "quick" if args.quick else "full",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "duration_s": round(time.monotonic() - began, 1),
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        }
        results["families"][name] = data
        log(f"bench: {name} took {data['meta']['duration_s']} s")
        write_json(args.results, results)
    results["run"] = {
        "mode": "quick" if args.quick else "full",
        "families": names,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    write_json(args.results, results)
    report.write(args.results, args.report)
    log(f"bench: wrote {args.results} and {args.report}")
    if args.keep:
        log(f"bench: work directories kept under {tempfile.gettempdir()}")
    return 1 if failed else 0


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
