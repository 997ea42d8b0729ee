"""``python -m cachet.engine``: one engine replica.

A single-rank replica's loop process starts first, so its imports (torch, the model code)
run beside this process's own.
"""

from cachet.engine.core_process import launch_early

loop_process = launch_early()

from cachet.engine.main import main  # noqa: E402 - after the loop process has started

main(loop_process=loop_process)
