"""Names shared by everything that writes or reads trajectories: where one came from, its status, why a run
ended, how a tool call went.

They live here, with the store, so the reward engine and training read them without importing the gateway
that writes them; the names are a public contract (the API's ``termination_reason``).
"""

# Where a trajectory came from.
PROXY, AGENT, BOT, DEMO, ROLLOUT, IMPORT = "proxy", "agent", "bot", "demo", "rollout", "import"

# A trajectory's status (an agent run's too); a model call's is ``ok``, ``error`` or ``client_disconnected``.
RUNNING, COMPLETED, TERMINATED, ERROR, INTERRUPTED, PENDING_APPROVAL = (
    "running", "completed", "terminated", "error", "interrupted", "pending_approval")
TRAJECTORY_STATUSES = frozenset({RUNNING, COMPLETED, TERMINATED, ERROR, INTERRUPTED, PENDING_APPROVAL,
                                 "client_disconnected"})
CALL_OK = "ok"
CALL_STATUSES = frozenset({CALL_OK, ERROR, "client_disconnected"})

MAX_STEPS = "max_steps"
MAX_TOTAL_TOKENS = "max_total_tokens"
DEADLINE = "deadline"
TOOL_FAILURES = "tool_failures"
LOOP_DETECTED = "loop_detected"
CLIENT_DISCONNECTED = "client_disconnected"
BACKEND_ERROR = "backend_error"
BUDGET_EXCEEDED = "budget_exceeded"  # the limits of the key or tenant that started the run


# Tool-call statuses meaning the call was not allowed to run as made (``retried``: the proxy guard sent an
# invalid call back to the model; such rows also have valid = 0, and the valid calls beside it were not run).
REFUSED_STATUSES = frozenset({"invalid", "denied"})
