"""Models: their architecture, their families, and megatron-core models built from them."""

# Registers every family before anything can look one up (megarl.models.arch.family_of).
from megarl.models import families  # noqa: F401
