"""Environments of other ecosystems as agents on the rollout endpoint: ``env.kind:
verifiers:<environment>`` (``verifiers_env``) and ``openenv:<environment>`` (``openenv_env``)."""
