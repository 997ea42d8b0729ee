"""Cachet engine service."""
