"""Llama (1 to 3.x): the reference Llama-style decoder, with nothing beyond ``DecoderFamily``.

Its RoPE scaling (``llama3``, ``linear``) is read for every family by ``megarl.models.hf_arch``.
"""

from __future__ import annotations

from megarl.models.families.base import DecoderFamily

FAMILY = DecoderFamily("llama")
