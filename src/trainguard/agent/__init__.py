"""The node's agent: torch elastic's LocalElasticAgent with trainguard's monitors and policy, and its launch."""
