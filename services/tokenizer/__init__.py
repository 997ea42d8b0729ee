"""Cachet tokenizer service."""
