"""What agents share through the rendezvous store: exchange scopes, signed keys, peers, the run id, the keeper."""
