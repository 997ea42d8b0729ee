"""What a service freezes before it serves is out of the collector's reach; later objects are not."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_startup_objects_are_frozen_once_and_later_ones_collected() -> None:
    # A fresh interpreter: freezing is once per process, and this one may have done it.
    script = textwrap.dedent(
        """
        import gc
        import weakref
        from cachet.startup_heap import freeze_startup_heap

        class Node:
            pass

        def cycle():
            a, b = Node(), Node()
            a.other, b.other = b, a
            return a

        kept = cycle()
        garbage = weakref.ref(cycle())
        assert garbage() is not None, "only the collector frees a cycle"
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        freeze_startup_heap()
        assert gc.get_freeze_count() == frozen, "a second call froze again"
        assert garbage() is None, "startup garbage was frozen instead of collected"
        assert not any(o is kept for o in gc.get_objects()), "what startup kept is out of the collector's reach"
        later = cycle()
        del later
        assert gc.collect() >= 2, "a cycle made while serving is still collected"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
