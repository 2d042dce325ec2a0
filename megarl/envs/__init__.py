"""Environments and tools for multi-turn rollouts: the ``Environment`` protocol (``base``), its
built-ins (single-turn rewards, tool use, remote over HTTP), the tools and their call parsers."""
