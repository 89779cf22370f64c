"""Monitors that plug into the agent (api.py is the contract, plugins.py the list): one module per concern."""
