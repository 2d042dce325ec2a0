"""The server side of ``openenv_sums``: its ``Environment`` (served by OpenEnv's ``create_app``)."""
