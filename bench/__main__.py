"""`python -m bench [--quick]`: run every benchmark, print tables, write JSON under bench/results/."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.engine_bench import run_engine_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer tokens, for a smoke run")
    parser.add_argument(
        "--model", default=None, help="model id or checkpoint dir (default: the default model)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    results = {"engine": run_engine_bench(model=args.model, dtype=args.dtype, quick=args.quick)}
    out_dir = Path("bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out_file.write_text(json.dumps(results, indent=2))
    print(f"\nresults written to {out_file}")


if __name__ == "__main__":
    main()
