"""Stage 3: passes over the partitioned forward and backward graphs (see `autosp.passes`)."""
