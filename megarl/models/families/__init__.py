"""The model families megarl supports, one module each, registered by HF ``model_type``.

A family is a ``megarl.models.arch.Family``: most build on ``base.DecoderFamily`` (the
shared Llama-style layer) and override what they change. Adding one is a new module
here and its line below.
"""

from megarl.models.arch import register_family
from megarl.models.families import deepseek_v3, gemma3, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe

# Registration order is the order "supported: ..." messages list them in.
register_family(llama.FAMILY)
register_family(mistral.FAMILY)
register_family(qwen2.FAMILY)
register_family(mixtral.FAMILY)
register_family(qwen3.FAMILY)
register_family(qwen3_moe.FAMILY)
register_family(qwen2_moe.FAMILY)
register_family(gemma3.FAMILY)
register_family(deepseek_v3.FAMILY)
