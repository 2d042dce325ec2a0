"""Rollout engines: generation in vLLM, inside Ray actors."""
