"""Limits and budgets per API key and per tenant: counted before a call, settled after it, in this process's memory
or in a Redis every replica shares."""
