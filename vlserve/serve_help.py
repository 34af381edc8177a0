"""How `vlserve serve --help` reads: the help formatter that shows each flag's default, and the command's
description (the flags themselves are in `serve_args.py`)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's help with its default: argparse's ArgumentDefaultsHelpFormatter, except where the help already
    says what its default is (flags whose default is computed, or None meaning "off")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default is argparse.SUPPRESS:
            return help_text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{help_text} (default: %(default)s)"
        return help_text


SERVE_DESCRIPTION = """\
Serve MODEL (a local Hugging Face checkpoint directory; none: the embedded demo model) over the OpenAI API:
/v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health, /version, /metrics, and the
playground at /.
Flags are vLLM's, grouped as `vllm serve --help` groups them."""
