"""Model output to answer content, reasoning and tool calls, one parser per output format.

``selection.output_parser_for`` picks the parsers for a request; every parser has
the ``PlainTextParser`` shape (``feed`` each text delta, ``finish`` once).
"""
