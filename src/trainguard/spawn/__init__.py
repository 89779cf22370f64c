"""Worker processes: the zygote that imports torch once, spare workers, the process context, log pumps, failures."""
