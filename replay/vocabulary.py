"""Names shared by everything that writes or reads trajectories: why a run ended, in the store's words.

They live here, with the store, so the reward engine and training read them without importing the gateway
that writes them; the names are a public contract (the API's ``termination_reason``).
"""

MAX_STEPS = "max_steps"
MAX_TOTAL_TOKENS = "max_total_tokens"
DEADLINE = "deadline"
TOOL_FAILURES = "tool_failures"
LOOP_DETECTED = "loop_detected"
CLIENT_DISCONNECTED = "client_disconnected"
BACKEND_ERROR = "backend_error"

