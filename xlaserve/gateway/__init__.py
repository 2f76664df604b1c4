"""The gateway (issue 15): routing clients' calls to workers. So far its placement function."""
