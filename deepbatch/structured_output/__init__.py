"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) that constrain sampling.

``grammar``: compile and cache per (kind, spec); ``matcher``: one sequence's state in its grammar;
``bitmask``: the per-step token mask, filled on the host and applied to the logits on the device.
xgrammar is imported only when a request asks for structured outputs.
"""
