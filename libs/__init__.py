"""Cachet: shared libraries (config, logging, tracing, gRPC server, block hash) and the `cachet` command."""
