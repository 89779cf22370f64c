"""Hang detection inside the agent: the watch, the cross-node exchange of views, the readable report."""
