"""Small agents for ``env.kind: package.module:function`` (``megarl.envs.agent``)."""
