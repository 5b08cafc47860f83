"""The Ray Serve application, the router, deploy configs and the `v41` command line."""
