"""The web console at ``/ui``: server-rendered pages over the store (trajectories, approvals, adapters, training
runs), signed in with an API key, with the API's tenancy. See ``gateway.console.app``."""
