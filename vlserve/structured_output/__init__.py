"""Structured outputs: requests constrained to a JSON schema, regex, choice or grammar (xgrammar, llguidance)."""

from vlserve.structured_output.params import StructuredOutputsConfig, StructuredOutputsParams

__all__ = ["StructuredOutputsConfig", "StructuredOutputsParams"]
