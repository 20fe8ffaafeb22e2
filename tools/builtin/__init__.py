"""The built-in tools; each module's ``build(settings)`` returns its ``ToolSpec``."""
