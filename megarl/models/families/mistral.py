"""Mistral: a Llama-style decoder attending within a sliding window (``sliding_window``).

``DecoderFamily`` reads the window; megatron-core gets it as ``window_size`` from
``megarl.models.gpt`` and the run validation refuses what the window rules out.
"""

from __future__ import annotations

from megarl.models.families.base import DecoderFamily

FAMILY = DecoderFamily("mistral")
