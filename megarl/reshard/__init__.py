"""The weight converter: Megatron (TP, PP) shards into vLLM TP shards, shard to shard."""
