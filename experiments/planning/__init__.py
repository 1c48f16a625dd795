"""Memory and compute planning: GPU/TPU targets, the planner, costs read from jaxprs and HLO, optimizer-state accounting."""
