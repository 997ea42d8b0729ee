"""Cachet tools: offline programs that compose several services' code (trace replay, trace generators).

This package sits above the services, like the ``cachet`` command: it may import any
service's pure modules, and no service or library may import it.
"""
