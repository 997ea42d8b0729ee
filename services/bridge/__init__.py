"""Cachet bridge service."""
