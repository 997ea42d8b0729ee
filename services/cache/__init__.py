"""Cachet cache service."""
