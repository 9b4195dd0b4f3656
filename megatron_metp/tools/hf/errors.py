"""The error of the Hugging Face tools: :class:`HFConfigError`, raised by every module of the
package (:mod:`.config` re-exports it, where callers import it from).
"""

from __future__ import annotations


class HFConfigError(ValueError):
    """The Hugging Face checkpoint cannot be converted; the message names the field and the fix."""
