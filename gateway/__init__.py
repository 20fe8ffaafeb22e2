"""The OpenAI-compatible gateway and the agent runtime."""
