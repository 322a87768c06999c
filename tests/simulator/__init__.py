"""Tests of the simulator package: schema, cost model, topology, engine timelines, memory, search, CLI."""
