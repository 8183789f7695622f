"""Everything that imports Ray: cluster connection, run supervisor actor, run backend."""
