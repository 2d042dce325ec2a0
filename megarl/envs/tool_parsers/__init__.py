"""How a model writes tool calls: one parser per format behind ``ToolCallParser`` (``base``),
registered by name in ``registry``."""
