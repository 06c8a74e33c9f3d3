"""What runs in a worker process (and in the dispatching process)."""
