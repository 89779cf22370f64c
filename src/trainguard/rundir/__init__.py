"""The run directory's files and their formats, shared by the agent that writes them and the commands that read them."""
