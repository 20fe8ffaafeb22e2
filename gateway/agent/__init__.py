"""The agent runtime: tool-call parsing, validation, limits and the loop."""
