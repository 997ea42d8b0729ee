"""Cachet router service."""
