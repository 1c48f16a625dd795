"""Studies over many runs: sweeps and their shared run cache (the comparison and schedule commands build on them)."""
