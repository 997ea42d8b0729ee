"""Cachet usage service."""
