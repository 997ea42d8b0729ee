"""Cachet tools: the top layer. The ``cachet`` command (``cli``), ``run-local`` (every
service on this machine), and offline programs that compose several services' code
(trace replay, trace generators, usage reports).

This package sits above the services: it may import any service's pure modules, and no
service or library may import it.
"""
