"""The machinery of the ``python`` tool (``megarl.envs.tools.python_sandbox``): the child's bootstrap,
the limited process that runs it, and the text the policy reads back."""
