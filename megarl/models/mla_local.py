"""What megatron-core 0.16.1's multi-latent attention needs to build from the local layer spec
without Transformer Engine.

``megatron/core/transformer/multi_latent_attention.py`` imports Transformer Engine's linears from
``megatron.core.extensions.transformer_engine``, which without TE still imports and binds them to
placeholder objects; it then sets ``HAVE_TE = True`` and ``MultiLatentAttention.__init__`` calls
``isinstance(self.linear_proj, TELinear)``: "TypeError: isinstance() arg 2 must be a type" for
every MLA model on the local spec. Without TE the module's own flag must say so.
"""

from __future__ import annotations

import importlib.util


def allow_local_mla() -> None:
    """Sets megatron-core's MLA module's ``HAVE_TE`` to whether Transformer Engine is installed."""
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
