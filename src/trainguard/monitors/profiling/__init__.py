"""Profiling: the monitor that reads the workers' rings, the record files, the `profile` switch."""
