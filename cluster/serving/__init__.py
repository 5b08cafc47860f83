"""The Ray Serve application: the HTTP layer, the API adapters, the planner and dispatcher,
the deployment builder and the one-machine launcher."""
