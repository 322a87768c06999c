"""Stage 1: passes over the Dynamo graph of one rank's shard (see `autosp.passes`)."""
