"""The rollout endpoint: an OpenAI-compatible server in front of a rollout engine while it runs
episodes, so an agent written against the ``openai`` client trains unchanged.

- ``protocol``: the OpenAI wire format (requests checked, answers and errors written);
- ``sessions``: each caller's turns recorded token-exactly and assembled into ``Trajectory``s
  (the trajectory splits where a prompt does not extend the tokens before it);
- ``prompts``: messages to prompt ids without re-tokenising the session's earlier turns;
- ``server``: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (aiohttp, loopback);
- ``link``: turns between the server's event loop and the engine's thread;
- ``agents``: ``env.kind: package.module:function`` episodes, each agent with a client bound to
  its session (``megarl.envs.agent``);
- ``vllm_requests``, ``vllm_agents``: the vLLM side, inside the engine actor;
- ``bound``: the endpoint for callers outside the run (``rollout.endpoint.port``), a Ray actor of
  its own in front of every engine, paused across weight syncs.
"""
