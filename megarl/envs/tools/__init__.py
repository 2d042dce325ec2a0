"""Tools a policy can call during an episode; one module per tool, registered by name here."""
