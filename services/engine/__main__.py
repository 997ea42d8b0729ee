"""``python -m cachet.engine``: one engine replica.

A single-rank replica's loop process starts first, before this process imports torch and
the model code, so the two interpreters import side by side.
"""

from cachet.engine.core_process import launch_early

loop_process = launch_early()

from cachet.engine.main import main  # noqa: E402 - after the loop process has started

main(loop_process=loop_process)
