"""Shared by every test folder: pytest puts tests/ on sys.path for this conftest, so
``from service_processes import start_service`` works anywhere (real processes over loopback)."""
