"""Tools a policy can call during an episode; one module per tool, registered by name here (the
``python`` tool's bootstrap, process and output handling live in ``sandbox/``)."""
